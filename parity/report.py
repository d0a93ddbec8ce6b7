"""Reports of a ParityResult: the terminal summary and the machine-readable JSON document.

JSON layout (every number float64 rounded to 6 significant digits; null = position not compared;
the strings "inf" / "-inf" = a non-finite metric, i.e. the model produced NaN/Inf at a compared position):
    {"model", "architecture", "family", "passed", "tolerances", "meta": {versions, checkpoint_sha256,
     "dtype": "float32" | "bfloat16" (the zoo side's; parity/bfloat16.py), "reference": {"route": "checkpoint as is" |
     "rounded copy" (bfloat16: a copy with the tensors the zoo stores in bfloat16 rounded), "rounded_tensors", "cache",
     "note"}, "tolerance_set": "moe", "dense + QUANTIZED", "mla + BFLOAT16" ..., seed,
     "quantization": {"mode": "blocks" (a GGUF's blocks kept on the zoo side) | "dequantized" | "none",
     "file_types": {GGML type: tensors}, "types": {block type: weights kept}, "weights": {parameter:
     layout}, "activation_bits": 16 | 8 | 0 (float32 math; blocks only), "note"}, ...}, "prompts": [[ids]], "prompt_texts", "hints",
     "inputs": {"notes": [prompts the harness replaced or added], "exercised", "not_exercised": [features]},
     "constants": {"checked": [module constant], "mismatches": [text]},
     "scenarios": {name: {"passed", "description", "failures", "info", "lengths", "first_divergence",
        "taps": [{"name", "role", "layer", "worst": {...}, "rel_l2": [[per position] per request],
                  "cosine": [...], "max_abs": [...], "experts"?: [...]}],        (execution order)
        "logits": {"logits"|"sampled_logits": {"summary": {...}, "kl": [[...]], "top1": [[...]],
                   "top5": [[...]], "p_diff": [[...]]}},
        "localization": {"culprit", "hints", "blocks": [{"name", "layer", "inherited", "total",
                          "local", "sub": {tap: local}}]}}}}
"""
from __future__ import annotations

import json
import math

import torch

from parity.harness import ParityResult, ScenarioResult
from parity.taps import SAMPLED, TP_REPLICATED_ROLES, role_of, short
from zoo.table import format_table


def _num(x) -> float | None:
    x = float(x)
    return None if math.isnan(x) else float(f"{x:.6g}")


def _rows(xs: list[torch.Tensor]) -> list[list[float | None]]:
    return [[_num(v) for v in x.tolist()] for x in xs]


def scenario_dict(s: ScenarioResult) -> dict:
    out = {"passed": s.passed, "description": s.description, "failures": s.failures, "info": s.info,
           "lengths": s.lengths, "first_divergence": s.first_divergence, "tolerances": s.tol}
    cmp = s.comparison
    if cmp is not None:
        out["taps"] = []
        for t in cmp.taps:
            d = {"name": t.name, "role": t.role, "layer": t.layer,
                 "worst": {k: _num(v) for k, v in t.worst().items()},
                 "rel_l2": _rows(t.rel_l2), "cosine": _rows(t.cosine), "max_abs": _rows(t.max_abs)}
            if t.experts is not None:
                d["experts"] = _rows(t.experts)
            out["taps"].append(d)
        out["missing_taps"] = cmp.missing
        out["logits"] = {name: {"summary": {k: _num(v) for k, v in lr.summary(s.tol).items()},
                                "kl": _rows(lr.kl), "top1": _rows(lr.top1), "top5": _rows(lr.top5),
                                "p_diff": _rows(lr.p_diff)}
                         for name, lr in cmp.logit_taps.items()}
    loc = s.localization
    if loc is not None:
        out["localization"] = {
            "culprit": loc.culprit, "hints": loc.hints,
            "blocks": [{"name": b.name, "layer": b.layer, "inherited": _num(b.inherited), "total": _num(b.total),
                        "local": _num(b.local), "sub": {k: _num(v) for k, v in b.sub.items()}} for b in loc.blocks]}
    return out


def to_json(result: ParityResult) -> dict:
    return {
        "model": result.model, "architecture": result.architecture, "family": result.family,
        "passed": result.passed, "tolerances": result.tol, "meta": result.meta,
        "prompts": result.prompts, "prompt_texts": result.prompt_texts, "hints": result.hints,
        "inputs": result.inputs, "constants": result.constants,
        "scenarios": {name: scenario_dict(s) for name, s in result.scenarios.items()},
    }


def _strict(x):
    """NaN -> None (not compared), +-inf -> "inf" / "-inf" (a failure), so the file is valid JSON."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {str(k): _strict(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_strict(v) for v in x]
    return x


def images_json(images) -> dict:
    """parity.multimodal.ImageParity: its one-shot taps and its scenarios (as the text scenarios are written)."""
    from dataclasses import asdict

    return {"passed": images.passed, "first_divergence": images.first_divergence,
            "tensor_parallel_size": images.tensor_parallel_size,
            "taps": [asdict(t) for t in images.taps],
            "scenarios": {name: scenario_dict(s) for name, s in images.scenarios.items()}}


def write_json(result: ParityResult, path, images=None) -> None:
    """`images`: the ImageParity of `zoo parity --image`, written under "images" ("passed" then covers both)."""
    doc = to_json(result)
    if images is not None:
        doc["images"] = images_json(images)
        doc["passed"] = doc["passed"] and images.passed
    with open(path, "w") as f:
        json.dump(_strict(doc), f, indent=1, allow_nan=False)


def _e(x) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1e}"


def format_summary(result: ParityResult) -> str:
    meta = result.meta or {}
    named = f" ({meta['tolerance_set']})" if "tolerance_set" in meta else ""
    lines = [f"zoo parity: {result.architecture} ({result.family}) from {result.model}",
             f"tolerances{named}: " + ", ".join(f"{k}={v:g}" for k, v in result.tol.items()), ""]
    missing = sorted({t for s in result.scenarios.values() if s.comparison for t in s.comparison.missing
                      if "tensor_parallel" not in result.meta or role_of(t) in TP_REPLICATED_ROLES})
    if missing:
        lines.insert(2, f"not compared (no zoo module joins these reference taps; see parity_taps in parity/taps.py): "
                        f"{', '.join(missing)}")
    lines[2:2] = input_lines(result)
    quant = meta.get("quantization") or {}
    if quant.get("mode") == "blocks":
        kinds = ", ".join(f"{k} x{n}" for k, n in quant.get("types", {}).items())
        lines.insert(2, f"quantized: the zoo side runs {len(quant.get('weights', {}))} weights as GGUF blocks "
                        f"({kinds}) on the block kernels; the reference is transformers' dequantized float32 model; "
                        f"quantized tolerances (parity/tolerances.py QUANTIZED)")
    elif quant.get("mode") == "dequantized":
        lines.insert(2, f"dequantized: {quant['note']}")
    if meta.get("dtype") == "bfloat16":
        ref = meta["reference"]
        lines.insert(2, f"bfloat16: the zoo side stores its matrices, embeddings and KV caches in bfloat16 (float32 "
                        f"math); the reference is transformers float32 on {ref['note']}, its {ref['cache']}; "
                        + ("bfloat16 tolerances (parity/tolerances.py BFLOAT16)" if "BFLOAT16" in meta["tolerance_set"]
                           else "no KV cache to round: the family's float32 tolerances"))
    if "tensor_parallel" in result.meta:
        tp = result.meta["tensor_parallel"]
        lines.insert(2, f"tensor parallel size {tp['size']} (gloo): compared at {tp['taps']}")
    if "pipeline_parallel" in result.meta:
        pp = result.meta["pipeline_parallel"]
        ranks = f" x tensor parallel size {pp['tensor_parallel_size']}" * (pp["tensor_parallel_size"] > 1)
        lines.insert(2, f"pipeline parallel size {pp['size']}{ranks} (gloo): compared {pp['compared']}")
    rows = []
    for name, s in result.scenarios.items():
        cmp = s.comparison
        worst = max(cmp.taps, key=lambda t: _nan0(t.worst()["rel_l2"]), default=None) if cmp else None
        lr = (cmp.logits or cmp.logit_taps.get(SAMPLED)) if cmp else None  # served: its sampled logits only
        lg = lr.summary(s.tol) if lr else {}
        rows.append([name, "pass" if s.passed else "DIVERGES", s.info.get("steps", "-"),
                     f"{_e(worst.worst()['rel_l2'])} {short(worst.name)}" if worst else "-",
                     f"{min(t.worst()['cosine'] for t in cmp.taps):.9f}" if cmp and cmp.taps else "-",
                     _e(lg.get("kl_mean")), _e(lg.get("kl_p99")), _e(lg.get("kl_max")),
                     f"{lg['top1']:.1%}" if lg else "-", f"{lg['top5']:.1%}" if lg else "-"])
    lines.append(format_table(["scenario", "result", "steps", "worst rel_l2 (tap)", "min cosine", "KL mean",
                               "KL p99", "KL max", "top-1", "top-5"], rows))
    for name, s in result.scenarios.items():
        if s.passed:
            continue
        lines += ["", f"[{name}] {s.description}"]
        lines += [f"  fails: {f}" for f in s.failures[:8]]
        if len(s.failures) > 8:
            lines.append(f"  ... and {len(s.failures) - 8} more")
        fd = s.first_divergence
        if fd:
            what = (f"rel_l2 {fd['rel_l2']:.2e}, cosine {fd['cosine']:.6f}" if "rel_l2" in fd
                    else f"KL {fd['kl']:.2e}, top-1 {'agrees' if fd['top1'] else 'differs'}")
            if "experts" in fd:
                what += f", {fd['experts']:.0%} of the reference's experts chosen"
            lines.append(f"  first divergence: {fd['tap']} (request {fd['request']}, position {fd['position']}): {what}")
        loc = s.localization
        if loc is not None:
            c = loc.culprit
            if c:
                experts = f", {c['experts']:.0%} of its experts" if "experts" in c else ""
                lines.append(f"  culprit: {c['block']} -> {c['tap']} at position {c['position']} (request "
                             f"{c['request']}), local rel_l2 {c['local']:.2e}{experts} on the zoo's own input")
            rows = [[short(b.name), _e(b.inherited), _e(b.total), _e(b.local),
                     (lambda k: f"{short(k)} {_e(b.sub[k])}")(max(b.sub, key=lambda k: _nan0(b.sub[k]))) if b.sub else "-"]
                    for b in loc.blocks]
            table = format_table(["block", "inherited", "total", "local (added)", "worst sub-block (local)"], rows)
            lines += ["  " + line for line in table.splitlines()]
            lines += [f"  hint: {h}" for h in loc.hints]
    lines += [f"hint: {h}" for h in result.hints]
    failed = [n for n, s in result.scenarios.items() if not s.passed] + \
        ["built constants"] * bool((result.constants or {}).get("mismatches"))
    lines += ["", "PASS" if result.passed else "DIVERGES: " + ", ".join(failed)]
    return "\n".join(lines)


def input_lines(result: ParityResult) -> list[str]:
    """What the harness did to its inputs and which length-dependent features they do not reach."""
    inputs, constants = result.inputs or {}, result.constants or {}
    return ([f"NOTE: {t}: the config ties them, the zoo uses the checkpoint's own weights"
             for t in (result.meta or {}).get("untied", [])] +
            [f"inputs: {n}" for n in inputs.get("notes", [])] +
            [f"NOT EXERCISED: {n}" for n in inputs.get("not_exercised", [])] +
            [f"CONSTANT DIFFERS: {m}" for m in constants.get("mismatches", [])] +
            ([f"constants: {len(constants['checked'])} built constants equal the reference's (eps, attention scale, "
              f"window, softcaps, rope)"] if constants.get("checked") and not constants.get("mismatches") else []))


def _nan0(x: float) -> float:
    return -1.0 if x is None or math.isnan(x) else x
