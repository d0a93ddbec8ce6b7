"""Compare two Traces tap by tap and position by position, and find the first divergence.

Shape legend:
    R = requests     L_r = positions of request r     K = experts chosen per token

Every metric is a per-request vector [L_r] with an explicit mask [L_r] of the positions compared (a
position is compared where both sides produced the tap and the scenario asks for it). Outside the mask
the vector holds NaN, for display only; inside it a NaN or Inf the model produced has already become a
failing value (metrics.py: rel_l2 inf, cosine -1, KL inf), so summaries over the mask see it.
A tap the zoo did not produce at a position it computed (`have`) is a gap, and a failure too.
The first divergence is the earliest tap in execution order with a position out of tolerance, and
in that tap the lowest such position (then the lowest request).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from parity import metrics
from parity.align import Trace
from parity.taps import LOGITS, SAMPLED, layer_of, role_of

NAN = float("nan")


def _cat(xs: list[torch.Tensor], masks: list[torch.Tensor]) -> torch.Tensor:
    """The values at compared positions, all requests (non-finite values included)."""
    xs = [x[m] for x, m in zip(xs, masks)]
    return torch.cat(xs) if xs else torch.zeros(0, dtype=torch.float64)


@dataclass
class TapResult:
    name: str
    role: str
    layer: int | None
    rel_l2: list[torch.Tensor]  # per request [L_r] float64 (NaN outside `mask`)
    max_abs: list[torch.Tensor]
    cosine: list[torch.Tensor]
    experts: list[torch.Tensor] | None = None  # router taps: fraction of chosen experts shared, [L_r]
    mask: list[torch.Tensor] = field(default_factory=list)  # per request [L_r] bool: positions compared

    def worst(self) -> dict[str, float]:
        def over_positions(xs, f):
            v = _cat(xs, self.mask)
            return f(v).item() if v.numel() else NAN

        out = {"rel_l2": over_positions(self.rel_l2, torch.max), "max_abs": over_positions(self.max_abs, torch.max),
               "cosine": over_positions(self.cosine, torch.min)}
        if self.experts is not None:
            out["experts"] = over_positions(self.experts, torch.min)
        return out

    def bad(self, tol: dict[str, float]) -> list[torch.Tensor]:
        """Per request [L_r] bool: compared positions out of tolerance."""
        out = []
        for r, (rel, cos, m) in enumerate(zip(self.rel_l2, self.cosine, self.mask)):
            b = (rel > tol["rel_l2"]) | (cos < tol["cosine"])
            if self.experts is not None:
                b = b | (self.experts[r] < tol["experts"])
            out.append(b & m)
        return out


@dataclass
class LogitResult:
    kl: list[torch.Tensor]  # per request [L_r] float64 (NaN outside `mask`)
    top1: list[torch.Tensor]  # [L_r] float64 1/0
    top5: list[torch.Tensor]
    p_diff: list[torch.Tensor]
    margin: list[torch.Tensor]
    mask: list[torch.Tensor] = field(default_factory=list)  # per request [L_r] bool: positions compared

    def summary(self, tol: dict[str, float]) -> dict[str, float]:
        kl = _cat(self.kl, self.mask)
        decisive = _cat(self.margin, self.mask) > tol["top1_margin"]
        top1 = _cat(self.top1, self.mask)
        some = kl.numel() > 0
        return {
            "kl_mean": kl.mean().item() if some else NAN,
            "kl_p99": metrics.percentile(kl, 99),
            "kl_max": kl.max().item() if some else NAN,
            "top1": top1.mean().item() if some else NAN,
            "top1_decisive": top1[decisive].mean().item() if decisive.any() else 1.0,
            "top5": _cat(self.top5, self.mask).mean().item() if some else NAN,
            "p_diff_max": _cat(self.p_diff, self.mask).max().item() if some else NAN,
            "positions": int(kl.numel()),
        }

    def bad(self, tol: dict[str, float]) -> list[torch.Tensor]:
        return [((kl > tol["kl_max"]) | ((t1 == 0) & (m > tol["top1_margin"]))) & mask
                for kl, t1, m, mask in zip(self.kl, self.top1, self.margin, self.mask)]


@dataclass
class Comparison:
    taps: list[TapResult]  # execution order, logits excluded
    logit_taps: dict[str, LogitResult]  # LOGITS (every row) and SAMPLED (rows the runtime sampled from)
    compared: list[torch.Tensor]  # per request [L_r] bool: positions compared in at least one tap
    missing: list[str] = field(default_factory=list)  # reference taps the other side did not produce
    gaps: dict[str, int] = field(default_factory=dict)  # tap -> positions computed but without a row of it

    @property
    def logits(self) -> LogitResult | None:
        return self.logit_taps.get(LOGITS)


def _scatter(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    out = torch.full((mask.shape[0],), NAN, dtype=torch.float64)
    out[mask] = values.to(torch.float64)
    return out


def _rows(trace: Trace, name: str, r: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(rows [L_r, *D] or None, present [L_r] bool) of tap `name` for request r."""
    rows = trace.rows[name][r]
    present = trace.mask(name)[r]
    return rows, present if rows is not None else torch.zeros_like(present)


def compare(ref: Trace, got: Trace, *, only: list[torch.Tensor] | None = None) -> Comparison:
    """Metrics of `got` against `ref` at the positions both hold (and `only` allows).

    Presence is each trace's mask per tap (SAMPLED rows exist only where the runtime sampled); a value
    is never taken for absence. SAMPLED is compared with the reference's LOGITS when the reference has
    no SAMPLED of its own.
    """
    if ref.lengths != got.lengths:
        raise ValueError(f"the two traces hold different requests: lengths {ref.lengths} vs {got.lengths}")
    wanted = [a & b for a, b in zip(ref.have, got.have)]
    if only is not None:
        wanted = [c & o for c, o in zip(wanted, only)]
    compared = [torch.zeros_like(w) for w in wanted]
    names = list(ref.order) + [SAMPLED] * (SAMPLED in got.rows and SAMPLED not in ref.order)
    taps, missing, logit_taps, gaps = [], [], {}, {}
    for name in names:
        ref_name = name if name in ref.rows else (LOGITS if name == SAMPLED else None)
        if name not in got.rows or ref_name not in ref.rows:
            missing.append(name)
            continue
        per = {"rel_l2": [], "max_abs": [], "cosine": [], "experts": []}
        lm = {"kl": [], "top1": [], "top5": [], "p_diff": [], "margin": []}
        masks = []
        for r, want in enumerate(wanted):
            (a, ref_has), (g, got_has) = _rows(ref, ref_name, r), _rows(got, name, r)
            mask = want & ref_has & got_has
            if name != SAMPLED:  # every other tap runs at every position a step computes
                gaps[name] = gaps.get(name, 0) + int((want & ref_has & ~got_has).sum())
            masks.append(mask)
            compared[r] |= mask
            a, b = (a[mask], g[mask]) if mask.any() else 2 * ((a if a is not None else g)[:0],)
            if role_of(name) == "logits":
                m = metrics.compare_logits(a, b, name=f"{name} (request {r})")
                for k in lm:
                    lm[k].append(_scatter(getattr(m, k), mask))
                continue
            m = metrics.compare_rows(a, b, name=f"{name} (request {r})")
            for k in ("rel_l2", "max_abs", "cosine"):
                per[k].append(_scatter(getattr(m, k), mask))
            if name in ref.experts and name in got.experts:
                we, ge = ref.experts[name][r], got.experts[name][r]
                e = metrics.compare_experts(we[mask], ge[mask]) if we is not None and ge is not None else \
                    torch.zeros(int(mask.sum()), dtype=torch.float64)  # a side without chosen experts: none agree
                per["experts"].append(_scatter(e, mask))
        if role_of(name) == "logits":
            logit_taps[name] = LogitResult(**lm, mask=masks)
        else:
            taps.append(TapResult(name, role_of(name) or "?", layer_of(name), per["rel_l2"], per["max_abs"],
                                  per["cosine"], per["experts"] or None, mask=masks))
    return Comparison(taps, logit_taps, compared, missing, {k: n for k, n in gaps.items() if n})


def first_bad(bad: list[torch.Tensor]) -> tuple[int, int] | None:
    """(request, position) of the lowest bad position, the lowest request on ties."""
    best = None
    for r, b in enumerate(bad):
        idx = torch.nonzero(b).flatten()
        if idx.numel() and (best is None or int(idx[0]) < best[1]):
            best = (r, int(idx[0]))
    return best


def first_divergence(cmp: Comparison, tol: dict[str, float]) -> dict | None:
    """The first (tap, request, position) out of tolerance, in execution order; None if all pass."""
    for tap in cmp.taps:
        hit = first_bad(tap.bad(tol))
        if hit is not None:
            r, p = hit
            out = {"tap": tap.name, "role": tap.role, "layer": tap.layer, "request": r, "position": p,
                   "rel_l2": tap.rel_l2[r][p].item(), "cosine": tap.cosine[r][p].item(),
                   "max_abs": tap.max_abs[r][p].item(),
                   "positions_bad": int(sum(int(b.sum()) for b in tap.bad(tol)))}
            if tap.experts is not None:
                out["experts"] = tap.experts[r][p].item()  # fraction of the reference's experts chosen
            return out
    for name, lr in cmp.logit_taps.items():
        hit = first_bad(lr.bad(tol))
        if hit is not None:
            r, p = hit
            return {"tap": name, "role": "logits", "layer": None, "request": r, "position": p,
                    "kl": lr.kl[r][p].item(), "top1": bool(lr.top1[r][p].item() == 1)}
    return None


def verdict(cmp: Comparison, tol: dict[str, float]) -> list[str]:
    """Human-readable failures of a comparison; empty when it passes."""
    fails = []
    for tap in cmp.taps:
        w = tap.worst()
        if w["rel_l2"] > tol["rel_l2"] or w["cosine"] < tol["cosine"]:
            fails.append(f"{tap.name}: rel_l2 {w['rel_l2']:.2e} (tol {tol['rel_l2']:.0e}), cosine {w['cosine']:.8f}")
        if "experts" in w and w["experts"] < tol["experts"]:
            fails.append(f"{tap.name}: chosen experts agree {w['experts']:.2%} (tol {tol['experts']:.0%})")
    for name, lr in cmp.logit_taps.items():
        s = lr.summary(tol)
        if s["kl_max"] > tol["kl_max"]:
            fails.append(f"{name}: KL max {s['kl_max']:.2e} (tol {tol['kl_max']:.0e})")
        if s["kl_mean"] > tol["kl_mean"]:
            fails.append(f"{name}: KL mean {s['kl_mean']:.2e} (tol {tol['kl_mean']:.0e})")
        if s["top1_decisive"] < tol["top1"]:
            fails.append(f"{name}: top-1 agreement {s['top1_decisive']:.2%} on decisive positions (tol {tol['top1']:.0%})")
    for name, n in cmp.gaps.items():
        fails.append(f"{name}: no row at {n} position{'s' * (n != 1)} the zoo computed (the module did not run there)")
    if not any(c.any() for c in cmp.compared):
        fails.append("no position was computed by both sides")
    return fails
