"""One layout for both sides: tap rows per request and token position.

Shape legend:
    R = requests (prompts)      L_r = tokens of request r (prompt + any decoded tokens)
    T = tokens of one zoo step (flattened, all requests)      D = features of a tap row

The reference runs [B, S] batches (one prompt unpadded, or several right-padded with an attention
mask); `from_padded` keeps row (b, s) for s < length[b] only, so padded positions never reach a
metric. The zoo runs flattened steps [T]; `from_steps` puts row j of a step at (request, positions[j]),
request i of the step owning rows query_start_loc[i]:query_start_loc[i+1]. A position the zoo did not
compute in the scenario (a prefix-cache hit) stays absent (`have` False) and is never compared.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Trace:
    order: list[str]  # tap names in execution order
    lengths: list[int]  # [R] tokens per request
    rows: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # tap -> per request [L_r, *D]
    have: list[torch.Tensor] = field(default_factory=list)  # per request [L_r] bool: rows present
    experts: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # router tap -> per request [L_r, K]
    tokens: list[list[int]] = field(default_factory=list)  # [R][L_r] the token ids


def from_padded(batches: list[tuple[list[int], int, dict[str, torch.Tensor], dict[str, torch.Tensor]]],
                order: list[str], tokens: list[list[int]]) -> Trace:
    """Reference batches -> Trace. Each batch is (request indices, S, taps {tap: [B, S, *D] or [B*S, *D]},
    experts {tap: [B*S, K]}); request r of the batch holds len(tokens[r]) real rows from s = 0."""
    lengths = [len(t) for t in tokens]
    trace = Trace(order=list(order), lengths=lengths, tokens=[list(t) for t in tokens])
    trace.have = [torch.ones(n, dtype=torch.bool) for n in lengths]
    for reqs, s, taps, experts in batches:
        b = len(reqs)
        for out, values in ((trace.rows, taps), (trace.experts, experts)):
            for tap, x in values.items():
                if tuple(x.shape[:2]) != (b, s):
                    if x.shape[0] != b * s:  # routers see the flattened [B*S, H] input
                        raise ValueError(f"{tap}: shape {tuple(x.shape)} is neither [{b}, {s}, ...] nor [{b * s}, ...]")
                    x = x.reshape(b, s, *x.shape[1:])
                per = out.setdefault(tap, [None] * len(lengths))
                for k, r in enumerate(reqs):
                    per[r] = x[k, : lengths[r]]  # [L_r, *D]: padded rows are dropped here
    return trace


def from_steps(steps: list[dict], order: list[str], tokens: list[list[int]]) -> Trace:
    """Zoo steps -> Trace. Each step: {"requests": [r per segment], "query_start_loc": [B+1],
    "positions": [T] tensor, "taps": {tap: [T, *D]}, "experts": {tap: [T, K]}}."""
    lengths = [len(t) for t in tokens]
    trace = Trace(order=list(order), lengths=lengths, tokens=[list(t) for t in tokens])
    trace.have = [torch.zeros(n, dtype=torch.bool) for n in lengths]
    for step in steps:
        qsl, positions = step["query_start_loc"], step["positions"].long()
        for i, r in enumerate(step["requests"]):
            if r is None:
                continue
            a, b = qsl[i], qsl[i + 1]
            pos = positions[a:b]  # [n] positions of this request's rows
            if int(pos.max()) >= lengths[r]:
                raise ValueError(f"request {r}: step computed position {int(pos.max())}, beyond its {lengths[r]} tokens")
            trace.have[r][pos] = True
            for field_name, values in (("rows", step["taps"]), ("experts", step.get("experts", {}))):
                out: dict[str, list] = getattr(trace, field_name)
                for tap, x in values.items():
                    if x.shape[0] != positions.shape[0]:
                        raise ValueError(f"{tap}: {x.shape[0]} rows for a step of {positions.shape[0]} tokens")
                    per = out.setdefault(tap, [None] * len(lengths))
                    if per[r] is None:
                        fill = float("nan") if x.is_floating_point() else -1
                        per[r] = torch.full((lengths[r], *x.shape[1:]), fill, dtype=x.dtype)
                    per[r][pos] = x[a:b]
    return trace
