"""One layout for both sides: tap rows per request and token position.

Shape legend:
    R = requests (prompts)      L_r = tokens of request r (prompt + any decoded tokens)
    T = tokens of one zoo step (flattened, all requests)      D = features of a tap row

The reference runs [B, S] batches (one prompt unpadded, or several right-padded with an attention
mask); `from_padded` keeps row (b, s) for s < length[b] only, so padded positions never reach a
metric. The zoo runs flattened steps [T]; `from_steps` puts row j of a step at (request, token_index[j]),
request i of the step owning rows query_start_loc[i]:query_start_loc[i+1], where token_index is the
scheduler's own accounting (num_computed_tokens + j within the request), never the positions the runtime
gave the model: a runtime computing wrong positions cannot move or overwrite rows here, it is a finding
(zoo_side.runtime_findings) and its rows are compared where they belong. A position the zoo did not
compute in the scenario (a prefix-cache hit) stays absent (`have` False) and is never compared.

Absence is always an explicit mask, never a value: `present[tap]` says, per request and position,
where a tap's row was produced (a step may hand a [T] bool mask with a tap, e.g. SAMPLED holds only the
rows the runtime sampled). The storage of an absent row is NaN-filled, but nothing reads it: a NaN or
Inf at a present position is a value the model computed, and the metrics treat it as a failure.
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
    present: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # tap -> per request [L_r] bool

    def mask(self, tap: str) -> list[torch.Tensor]:
        """Per request [L_r] bool: positions where `tap` has a row (all of `have` unless the tap says less)."""
        return self.present.get(tap, self.have)


def from_padded(batches: list[tuple[list[int], int, dict[str, torch.Tensor], dict[str, torch.Tensor]]],
                order: list[str], tokens: list[list[int]]) -> Trace:
    """Reference batches -> Trace. Each batch is (request indices, S, taps {tap: [B, S, *D] or [B*S, *D]},
    experts {tap: [B*S, K]}); request r of the batch holds len(tokens[r]) real rows from s = 0."""
    lengths = [len(t) for t in tokens]
    trace = Trace(order=list(order), lengths=lengths, tokens=[list(t) for t in tokens])
    trace.have = [torch.ones(n, dtype=torch.bool) for n in lengths]  # every tap: present everywhere
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
    "positions": [T] tensor (used as the token index when the step has no "token_index" [T]),
    "taps": {tap: [T, *D]}, "experts": {tap: [T, K]}, and optionally
    "present": {tap: [T] bool} for a tap that holds only some rows of the step (the others are absent)}."""
    lengths = [len(t) for t in tokens]
    trace = Trace(order=list(order), lengths=lengths, tokens=[list(t) for t in tokens])
    trace.have = [torch.zeros(n, dtype=torch.bool) for n in lengths]
    for step in steps:
        qsl, positions = step["query_start_loc"], step.get("token_index", step["positions"]).long()
        partial = step.get("present", {})
        for tap, x in list(step["taps"].items()) + list(step.get("experts", {}).items()):
            if x.shape[0] != positions.shape[0]:
                raise ValueError(f"{tap}: {x.shape[0]} rows for a step of {positions.shape[0]} tokens")
        for i, r in enumerate(step["requests"]):
            if r is None:
                continue
            a, b = qsl[i], qsl[i + 1]
            pos = positions[a:b]  # [n] positions of this request's rows
            if b == a:
                continue
            if int(pos.max()) >= lengths[r] or int(pos.min()) < 0:
                raise ValueError(f"request {r}: step computed token {int(pos.max())}, beyond its {lengths[r]} tokens")
            trace.have[r][pos] = True
            for out, values in ((trace.rows, step["taps"]), (trace.experts, step.get("experts", {}))):
                for tap, x in values.items():
                    rows = partial[tap][a:b] if tap in partial else torch.ones(b - a, dtype=torch.bool)  # [n]
                    _put(out, tap, x[a:b][rows], pos[rows], r, lengths)
                    if out is trace.rows:
                        mask = trace.present.setdefault(tap, [torch.zeros(n, dtype=torch.bool) for n in lengths])
                        mask[r][pos[rows]] = True
    return trace


def _put(out: dict[str, list], tap: str, x: torch.Tensor, pos: torch.Tensor, r: int, lengths: list[int]) -> None:
    """Rows x [n, *D] of request r at positions pos [n]; storage of never-written rows is NaN (or -1)."""
    per = out.setdefault(tap, [None] * len(lengths))
    if per[r] is None:
        fill = float("nan") if x.is_floating_point() else -1
        per[r] = torch.full((lengths[r], *x.shape[1:]), fill, dtype=x.dtype)
    per[r][pos] = x
