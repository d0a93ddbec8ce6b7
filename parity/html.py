"""The HTML report: one self-contained page (no external assets): per scenario a tap x position heatmap
of relative error and the distribution of KL(ref || zoo) over positions, drawn as inline SVG by a small
script from the JSON embedded in the page. The script marks <body data-rendered="true"> when done and
each heatmap <svg> carries data-cells (the number of cells it drew).
"""
from __future__ import annotations

import html
import json
import math

from parity.harness import ParityResult
from parity.report import input_lines, scenario_dict
from parity.taps import short


def _heat(sd: dict) -> dict:
    """rows: taps in execution order; value at (tap, position) = max rel_l2 over requests (None: absent)."""
    width = max(sd["lengths"], default=0)
    rows, names = [], []
    for tap in sd.get("taps", []):
        row = []
        for p in range(width):
            vals = [r[p] for r in tap["rel_l2"] if p < len(r) and r[p] is not None]
            nums = [v for v in vals if isinstance(v, (int, float)) and math.isfinite(v)]
            row.append("inf" if len(nums) < len(vals) else max(nums) if nums else None)  # "inf": non-finite
        rows.append(row)
        names.append(short(tap["name"]))
    kl = [v for r in sd.get("logits", {}).get("logits", {}).get("kl", []) for v in r
          if isinstance(v, (int, float)) and math.isfinite(v)]
    return {"taps": names, "rows": rows, "width": width, "kl": kl, "tol": sd["tolerances"].get("rel_l2", 1e-4),
            "kl_tol": sd["tolerances"].get("kl_max", 1e-6)}


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>zoo parity: {title}</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; }}
h1 {{ font-size: 20px; }} h2 {{ font-size: 17px; margin-top: 32px; }}
.pass {{ color: #1a7f37; font-weight: 600; }} .fail {{ color: #cf222e; font-weight: 600; }}
table {{ border-collapse: collapse; margin: 8px 0; }} td, th {{ border: 1px solid #ddd; padding: 2px 8px; text-align: left; }}
code {{ background: #f3f3f3; padding: 0 3px; }} .hint {{ color: #7d4e00; }}
svg text {{ font: 10px monospace; fill: #333; }}
.legend span {{ display: inline-block; margin-right: 14px; }} .legend i {{ display: inline-block; width: 11px;
  height: 11px; margin-right: 4px; vertical-align: -1px; border: 1px solid #ccc; }}
</style></head>
<body data-rendered="false">
<h1>zoo parity: {title} <span class="{cls}">{verdict}</span></h1>
<p>{meta}</p>
{inputs}
{sections}
<script type="application/json" id="parity-data">{data}</script>
<script>
(function () {{
  const NS = "http://www.w3.org/2000/svg";
  const data = JSON.parse(document.getElementById("parity-data").textContent);
  const el = (name, attrs, parent) => {{
    const e = document.createElementNS(NS, name);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  }};
  const color = (v, tol) => {{
    if (v === null) return "#eee";
    if (typeof v === "string") return "#000";  // non-finite (NaN/Inf produced by the model)
    const t = Math.min(1, Math.max(0, (Math.log10(Math.max(v, 1e-10)) + 10) / 10));  // 1e-10 .. 1
    const hue = v > tol ? 0 : 120 - 80 * t;
    return "hsl(" + hue + ",70%," + (v > tol ? 45 : 75 - 30 * t) + "%)";
  }};
  let total = 0;
  for (const [name, s] of Object.entries(data)) {{
    const box = document.getElementById("heat-" + name);
    if (!box) continue;
    const cw = 12, ch = 12, top = 20;
    const svg = el("svg", {{width: 10, height: top + s.taps.length * ch + 10, class: "heatmap", "data-scenario": name}}, box);
    // the grid starts right of the longest tap name, measured as drawn
    const labels = s.taps.map((t, i) => {{
      const e = el("text", {{x: 0, y: top + i * ch + 10, class: "tap-label"}}, svg);
      e.textContent = t;
      return e;
    }});
    const left = Math.ceil(Math.max(60, ...labels.map(e => e.getComputedTextLength()))) + 8;
    svg.setAttribute("width", left + s.width * cw + 10);
    svg.setAttribute("data-left", left);
    svg.setAttribute("data-label-width", Math.ceil(Math.max(0, ...labels.map(e => e.getComputedTextLength()))));
    for (let p = 0; p < s.width; p += 5) el("text", {{x: left + p * cw, y: 12}}, svg).textContent = p;
    let cells = 0;
    s.rows.forEach((row, i) => {{
      row.forEach((v, p) => {{
        const r = el("rect", {{x: left + p * cw, y: top + i * ch, width: cw - 1, height: ch - 1,
                             fill: color(v, s.tol), class: "cell", "data-tap": s.taps[i], "data-pos": p}}, svg);
        const shown = v === null ? "not compared" : typeof v === "string" ? "non-finite" : v.toExponential(2);
        el("title", {{}}, r).textContent = s.taps[i] + " @ " + p + ": " + shown;
        cells++;
      }});
    }});
    svg.setAttribute("data-cells", cells);
    total += cells;
    const kbox = document.getElementById("kl-" + name);
    if (kbox && s.kl.length) {{
      const bins = new Array(20).fill(0);  // log10 KL from -20 to 0
      s.kl.forEach(v => {{ bins[Math.min(19, Math.max(0, Math.floor(Math.log10(Math.max(v, 1e-20)) + 20)))]++; }});
      const h = 80, bw = 18, max = Math.max(...bins);
      const ks = el("svg", {{width: 20 * bw + 60, height: h + 30, class: "kl-hist", "data-positions": s.kl.length}}, kbox);
      bins.forEach((n, i) => {{
        const bh = max ? h * n / max : 0;
        const r = el("rect", {{x: 30 + i * bw, y: h - bh + 5, width: bw - 2, height: bh, fill: "#4a7ab8", class: "kl-bin"}}, ks);
        el("title", {{}}, r).textContent = "1e" + (i - 20) + " .. 1e" + (i - 19) + ": " + n + " positions";
      }});
      [-20, -15, -10, -5, 0].forEach(e => {{ el("text", {{x: 30 + (e + 20) * bw - 6, y: h + 20}}, ks).textContent = "1e" + e; }});
      const tx = 30 + (Math.log10(s.kl_tol) + 20) * bw;  // the kl_max tolerance on the same log axis
      el("line", {{x1: tx, x2: tx, y1: 0, y2: h + 5, stroke: "#cf222e", "stroke-width": 2, "stroke-dasharray": "4 2",
                  class: "kl-tol", "data-tol": s.kl_tol}}, ks);
      el("text", {{x: tx + 3, y: 10, fill: "#cf222e"}}, ks).textContent = "kl_max tol " + s.kl_tol.toExponential(0);
    }}
  }}
  document.body.setAttribute("data-cells", total);
  document.body.setAttribute("data-rendered", "true");
}})();
</script>
</body></html>
"""


LEGEND = ('<p class="legend">'
          '<span><i style="background:hsl(120,70%,75%)"></i><i style="background:hsl(72,70%,57%)"></i>'
          'within tolerance (light: 1e-10, darker: nearer the tolerance)</span>'
          '<span><i style="background:hsl(0,70%,45%)"></i>above tolerance</span>'
          '<span><i style="background:#000"></i>non-finite (NaN/Inf at a compared position)</span>'
          '<span><i style="background:#eee"></i>not compared: outside the scenario (a prompt position of the prefix '
          'scenario, the prompt in decode), past a shorter request, or a row the runtime did not produce (sampled '
          'logits)</span></p>')


def _table(header: list[str], rows: list[list]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _e(x) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2e}"


def _cell(key: str, v) -> str:
    if v is None:
        return "-"
    if key == "positions":
        return str(int(v))
    return f"{v:.2%}" if key.startswith("top") else _e(v)


def render(result: ParityResult) -> str:
    sections, data = [], {}
    for name, s in result.scenarios.items():
        sd = scenario_dict(s)
        data[name] = _heat(sd)
        part = [f'<h2 id="scenario-{name}">{html.escape(name)}: <span class="{"pass" if s.passed else "fail"}">'
                f'{"pass" if s.passed else "diverges"}</span></h2>', f"<p>{html.escape(s.description)}</p>"]
        part += [f'<p class="fail">{html.escape(f)}</p>' for f in s.failures[:10]]
        fd = s.first_divergence
        if fd:
            part.append(f"<p>first divergence: <code>{html.escape(fd['tap'])}</code>, request {fd['request']}, "
                        f"position {fd['position']}</p>")
        loc = sd.get("localization")
        if loc:
            c = loc["culprit"]
            if c:
                part.append(f"<p>culprit: <code>{html.escape(c['tap'])}</code> in <code>{html.escape(c['block'])}"
                            f"</code> at position {c['position']} (local rel_l2 {_e(c['local'])})</p>")
            part += [f'<p class="hint">hint: {html.escape(h)}</p>' for h in loc["hints"]]
            part.append(_table(["block", "inherited", "total", "local (added)"],
                               [[short(b["name"]), _e(b["inherited"]), _e(b["total"]), _e(b["local"])]
                                for b in loc["blocks"]]))
        logit_rows = [[lname] + [_cell(k, v) for k, v in lg["summary"].items()] for lname, lg in sd.get("logits", {}).items()]
        if logit_rows:
            part.append(_table(["logits of"] + list(next(iter(sd["logits"].values()))["summary"]), logit_rows))
        part.append(f"<h3>relative L2 error, tap x position (max over requests; red: above {_e(data[name]['tol'])})</h3>"
                    f'{LEGEND}<div id="heat-{name}"></div><h3>KL(ref || zoo) over positions (log10 bins; dashed: '
                    f'the kl_max tolerance, {_e(s.tol.get("kl_max"))})</h3>'
                    f'<div id="kl-{name}"></div>')
        sections.append("\n".join(part))
    meta = result.meta
    info = (f"family {result.family}; transformers {meta['versions']['transformers']}, torch "
            f"{meta['versions']['torch']}, zoo {meta['versions']['zoo']}; {meta['dtype']} (metrics in "
            f"{meta['metrics_dtype']}); seed {meta['seed']}; checkpoint sha256 {meta['checkpoint_sha256'][:16]}...")
    payload = json.dumps(data, allow_nan=False).replace("</", "<\\/")  # never closes the script element early
    return PAGE.format(title=html.escape(f"{result.architecture} ({result.model})"),
                       cls="pass" if result.passed else "fail", verdict="PASS" if result.passed else "DIVERGES",
                       meta=html.escape(info), inputs="\n".join(f'<p class="hint">{html.escape(line)}</p>'
                                                                  for line in input_lines(result)),
                       sections="\n".join(sections), data=payload)


def write_html(result: ParityResult, path) -> None:
    with open(path, "w") as f:
        f.write(render(result))
