"""Per-position comparison metrics, always computed in float64.

Shape legend:
    P = token positions compared (rows)      D = features of one tap row (hidden size, experts...)
    V = vocabulary

`compare_rows(ref[P, D], got[P, D])` -> max abs diff, relative L2 and cosine per row.
`compare_logits(ref[P, V], got[P, V])` -> KL(ref || got), top-1 agreement, top-5 overlap and the
difference in probability of the reference's top token, per row.

Relative L2 is ||got - ref|| / ||ref||; a reference row of norm 0 uses ||got|| alone (0 when both are 0).
Cosine is dot / (|ref| |got|) in float64; a value above 1 + 1e-12 means the metric itself is broken and
raises, tiny float64 overshoots are clipped back to 1. Two zero rows have cosine 1 (they agree).

A row holding a NaN or Inf on either side is a failure, never a gap: max abs and relative L2 are inf,
cosine -1; for logits KL is inf, top-1 and top-5 agree on nothing, p_diff is 1 and the margin inf
(decisive). Positions that were not computed are left out by the caller's masks, before any metric.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

COSINE_SLACK = 1e-12  # float64 rounding allowance above |cos| = 1


@dataclass
class RowMetrics:
    max_abs: torch.Tensor  # [P] float64
    rel_l2: torch.Tensor  # [P] float64
    cosine: torch.Tensor  # [P] float64


@dataclass
class LogitMetrics:
    kl: torch.Tensor  # [P] float64, KL(ref || got) in nats
    top1: torch.Tensor  # [P] bool, argmax agrees
    top5: torch.Tensor  # [P] float64, |top5(ref) & top5(got)| / 5
    p_diff: torch.Tensor  # [P] float64, |p_ref(t) - p_got(t)| for t = argmax of ref
    margin: torch.Tensor  # [P] float64, ref's top-1 minus top-2 logit (small margins may flip top-1)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x = x.detach().to(torch.float64)
    return x.reshape(x.shape[0], int(torch.tensor(x.shape[1:]).prod()))  # [P, D]


def _finite(x: torch.Tensor) -> torch.Tensor:
    """[P] bool: every value of the row is finite."""
    return torch.isfinite(x).all(dim=1) if x.shape[1] else torch.ones(x.shape[0], dtype=torch.bool)


def compare_rows(ref: torch.Tensor, got: torch.Tensor, *, name: str = "tap") -> RowMetrics:
    """Row-wise metrics of `got` against `ref`; both [P, ...] with the same shape."""
    if ref.shape != got.shape:
        raise ValueError(f"{name}: reference rows have shape {tuple(ref.shape)}, zoo rows {tuple(got.shape)}")
    r, g = _rows(ref), _rows(got)
    diff = g - r
    max_abs = diff.abs().amax(dim=1) if r.shape[1] else torch.zeros(r.shape[0], dtype=torch.float64)
    nr, ng, nd = r.norm(dim=1), g.norm(dim=1), diff.norm(dim=1)
    rel = torch.where(nr > 0, nd / nr.clamp_min(torch.finfo(torch.float64).tiny), ng)
    denom = nr * ng
    cos = torch.where(denom > 0, (r * g).sum(dim=1) / denom.clamp_min(torch.finfo(torch.float64).tiny),
                      torch.where((nr == 0) & (ng == 0), 1.0, 0.0).to(torch.float64))
    bad = ~(_finite(r) & _finite(g))  # [P]
    worst = cos[~bad].abs().max().item() if (~bad).any() else 0.0
    if worst > 1 + COSINE_SLACK:
        raise ArithmeticError(f"{name}: cosine {worst!r} > 1, the metric is broken")
    inf = torch.tensor(float("inf"), dtype=torch.float64)
    return RowMetrics(max_abs.where(~bad, inf), rel.where(~bad, inf), cos.clamp(-1.0, 1.0).where(~bad, -1.0))


def compare_logits(ref: torch.Tensor, got: torch.Tensor, *, name: str = "logits") -> LogitMetrics:
    """Distribution metrics per row of logits [P, V]."""
    if ref.shape != got.shape:
        raise ValueError(f"{name}: reference logits have shape {tuple(ref.shape)}, zoo logits {tuple(got.shape)}")
    r, g = _rows(ref), _rows(got)
    lr, lg = torch.log_softmax(r, dim=1), torch.log_softmax(g, dim=1)  # [P, V]
    pr = lr.exp()
    kl = (pr * (lr - lg)).sum(dim=1).clamp_min(0.0)  # rounding can give -1e-17
    k = min(5, r.shape[1])
    top_r, top_g = r.topk(k, dim=1).indices, g.topk(k, dim=1).indices  # [P, k]
    overlap = (top_r.unsqueeze(2) == top_g.unsqueeze(1)).any(dim=2).sum(dim=1).to(torch.float64) / k
    t = top_r[:, :1]  # [P, 1]
    p_diff = (pr.gather(1, t) - lg.exp().gather(1, t)).abs().squeeze(1)
    two = r.topk(min(2, r.shape[1]), dim=1).values
    margin = two[:, 0] - two[:, -1]
    bad = ~(_finite(r) & _finite(g))  # [P]
    inf = torch.tensor(float("inf"), dtype=torch.float64)
    return LogitMetrics(kl.where(~bad, inf), (top_r[:, 0] == top_g[:, 0]) & ~bad, overlap.where(~bad, 0.0),
                        p_diff.where(~bad, 1.0), margin.where(~bad, inf))


def compare_experts(ref: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """[P] float64: the fraction of the reference's chosen experts [P, K] that the zoo also chose."""
    if ref.shape != got.shape:
        raise ValueError(f"chosen experts: reference {tuple(ref.shape)} vs zoo {tuple(got.shape)}")
    hit = (ref.unsqueeze(2) == got.unsqueeze(1)).any(dim=2)  # [P, K]
    return hit.to(torch.float64).mean(dim=1)


def percentile(x: torch.Tensor, q: float) -> float:
    """The q-th percentile (0..100) of a 1-D tensor, float64, linear interpolation; 0.0 when empty."""
    if x.numel() == 0:
        return 0.0
    x = x.to(torch.float64)
    v = torch.quantile(x, q / 100.0).item()
    return torch.quantile(x, q / 100.0, interpolation="higher").item() if v != v else v  # inf * 0 weight -> NaN
