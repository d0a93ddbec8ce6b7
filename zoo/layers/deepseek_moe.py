"""DeepSeek's MoE: group-limited routing over stacked experts, plus always-on shared experts.

Shape legend:
    T = tokens (flattened)    H = hidden size    E = routed experts    K = experts per token
    G = expert groups (n_group)    EG = E / G experts per group    KG = groups kept (topk_group)

Routing, as transformers 5.24 computes it (router logits and scores in float32):
    V2 (scoring softmax): topk_method "greedy" = top-K of the scores; "group_limited_greedy" = keep the
        KG groups with the highest max score, zero the rest, then top-K. Weights = the kept scores times
        routed_scaling_factor; never renormalised (transformers' V2 ignores norm_topk_prob).
    V3 (scoring sigmoid, "noaux_tc"): choice = scores + e_score_correction_bias (the bias steers the
        choice only); keep the KG groups with the highest sum of their top-2 choices, mask the rest to
        -inf, top-K of the choices. Weights = the unbiased scores of the chosen experts, divided by
        their sum (+1e-20) when norm_topk_prob, times routed_scaling_factor.
The expert weights stay float32; moe.StackedExperts multiplies in float32 and casts the sum back.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zoo.layers.moe import StackedExperts, serial_ops

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


class GroupLimitedRouter(nn.Module):
    """Returns `(router_logits [T, E], topk_weights [T, K] float32, topk_ids [T, K])`, as moe.TopKRouter."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, topk_method: str, n_group: int | None,
                 topk_group: int | None, norm_topk_prob: bool, routed_scaling_factor: float, prefix: str = ""):
        super().__init__()
        if topk_method not in TOPK_METHODS:
            raise ValueError(f"{prefix}: topk_method={topk_method!r} is not one of {TOPK_METHODS}")
        grouped = topk_method != "greedy"
        if grouped and not (n_group and topk_group and num_experts % n_group == 0 and topk_group <= n_group):
            raise ValueError(f"{prefix}: topk_method={topk_method!r} needs n_group dividing n_routed_experts="
                             f"{num_experts} and 0 < topk_group <= n_group (got n_group={n_group}, "
                             f"topk_group={topk_group})")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"{prefix}: num_experts_per_tok={top_k} must be in 1..n_routed_experts={num_experts}")
        self.prefix = prefix
        self.num_experts, self.top_k, self.topk_method = num_experts, top_k, topk_method
        self.n_group, self.topk_group = n_group, topk_group
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))  # [E, H]
        if topk_method == "noaux_tc":
            # [E]; a parameter, not a buffer, so that a checkpoint without it fails the loader's coverage check
            self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts), requires_grad=False)

    def _keep_groups(self, choice: torch.Tensor, group_score: torch.Tensor, fill: float) -> torch.Tensor:
        """choice [T, E] with the experts outside the KG best groups (by group_score [T, G]) set to `fill`."""
        groups = torch.topk(group_score, self.topk_group, dim=-1, sorted=False).indices  # [T, KG]
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, groups, True)  # [T, G]
        keep = keep.repeat_interleave(self.num_experts // self.n_group, dim=1)  # [T, E]
        return choice.masked_fill(~keep, fill)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())  # [T, E] float32
        if self.topk_method == "noaux_tc":  # V3
            scores = logits.sigmoid()  # [T, E]
            choice = scores + self.e_score_correction_bias.float()  # [T, E], biased for the choice only
            by_group = choice.view(-1, self.n_group, self.num_experts // self.n_group)  # [T, G, EG]
            choice = self._keep_groups(choice, by_group.topk(2, dim=-1).values.sum(-1), float("-inf"))
            ids = torch.topk(choice, self.top_k, dim=-1, sorted=False).indices  # [T, K]
            weights = scores.gather(1, ids)  # [T, K]
            if self.norm_topk_prob:
                weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        else:  # V2
            scores = logits.softmax(-1)  # [T, E]
            if self.topk_method == "group_limited_greedy":
                by_group = scores.view(-1, self.n_group, self.num_experts // self.n_group)  # [T, G, EG]
                scores = self._keep_groups(scores, by_group.max(-1).values, 0.0)
            weights, ids = torch.topk(scores, self.top_k, dim=-1, sorted=False)  # [T, K], [T, K]
        return logits, weights * self.routed_scaling_factor, ids

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, method={self.topk_method}, "
                f"groups={self.topk_group}/{self.n_group}, norm={self.norm_topk_prob}, "
                f"scale={self.routed_scaling_factor}")


class DeepseekMoE(nn.Module):
    """`gate` (GroupLimitedRouter) + `experts` (moe.StackedExperts) + `shared_experts` (a dense MLP or None)."""

    tensor_parallel_sum = True  # as moe.SparseMoeBlock: routed and shared experts' partial sums, summed once

    def __init__(self, *, gate: GroupLimitedRouter, experts: StackedExperts, shared_experts: nn.Module | None,
                 prefix: str = ""):
        super().__init__()
        self.prefix = prefix
        self.gate, self.experts = gate, experts
        if shared_experts is not None:
            self.shared_experts = shared_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with serial_ops(x):  # the router's small torch ops on one thread (see moe.serial_ops)
            _, topk_weights, topk_ids = self.gate(x)  # [T, K], [T, K]
        out = self.experts(x, topk_ids, topk_weights)  # [T, H]
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(x)  # [T, H]
        return out
