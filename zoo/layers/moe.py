"""Mixture-of-experts: a top-k router, experts stored stacked, grouped dispatch, an optional shared expert.

Shape legend:
    T = tokens (flattened, no batch axis)   H = hidden size       E = routed experts
    K = experts per token (top-k)           I = expert intermediate size
    A = T * K token->expert assignments     n = assignments of one expert

Names follow transformers' modules so that checkpoint keys and parity taps join by name:

    mlp.gate                    TopKRouter; weight [E, H] = checkpoint `mlp.gate.weight`
    mlp.experts                 StackedExperts
    mlp.experts.gate_up_proj    weight [E, 2I, H]: row e = cat(experts.{e}.gate_proj, experts.{e}.up_proj)
    mlp.experts.down_proj       weight [E, H, I]:  row e = experts.{e}.down_proj
    mlp.shared_expert           a dense gated MLP (Qwen2-MoE), built by the caller
    mlp.shared_expert_gate      weight [1, H]

Loader rules for the per-expert hub layout: Stack("experts") + Fuse(("gate_proj", "up_proj"),
"gate_up_proj"); the gate_up weight carries `shard_sizes = (I, I)`, the fused dim being dim 0 of each
expert's row (dim 1 of the stacked parameter).

CPU fast path (float32 activations, float32 or bfloat16 experts, kernels on): the whole dispatch of StackedExperts
is one native call,
`kernels.moe_experts` (sort by expert, each expert's two GEMMs and act-and-mul, the experts with <= 4 rows as one
grouped GEMV, the combine in expert order as combine_in_expert_order); the fused native step runs the same code.

Router taps: `gate` returns what transformers' TopKRouter returns, `(router_logits [T, E], topk_weights
[T, K], topk_ids [T, K])`, so a forward hook on `mlp.gate` captures the router logits (output[0]) and the
chosen experts (output[2]) on both sides. `experts(hidden, topk_ids, topk_weights)` also has transformers'
signature and returns the weighted sum of the routed experts [T, H].
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from zoo import kernels
from zoo.kernels import triton as triton_kernels
from zoo.layers.linear import Linear, linear
from zoo.layers.mlp import FUSED_ACTS, act_and_mul, activation


def on_device_path(x: torch.Tensor) -> bool:
    """Whether experts take the device path for x (an accelerator, or forced: zoo.kernels.set_device_path)."""
    return kernels.device_path(x)


@contextmanager
def serial_ops(x: torch.Tensor):
    """Torch's small ops of a MoE block (router, sort by expert, combine) on one thread while the native kernels
    are on: each is microseconds of work, but an OpenMP region of 2 threads waits for both to be scheduled, and on
    a loaded machine (bench/generate_moe.py ran at load ~7 on 2 cores) that wait was ~100 ms per op, most of a
    decode step. Native kernels called inside keep their threads (kernels.serial_torch)."""
    if not kernels.fast(x):
        yield
        return
    with kernels.serial_torch():  # (kernels.threads() keeps the native kernels' count meanwhile)
        yield


def combine_in_expert_order(weighted: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
    """zeros [T, H].index_add_(0, order // k, weighted) for weighted [A, H] sorted by expert (token order kept
    within an expert), with the same additions in the same order: each token's k rows in ascending expert id.
    On the CPU torch's index_add_ (a scatter_add_) took ~27 ms for a 2 x 1024 decode step on the loaded bench
    machine; this is k - 1 adds of [T, H]."""
    rows = torch.argsort(order).view(-1, k).sort(dim=1).values  # [T, k] each token's sorted rows, expert order
    out = weighted[rows[:, 0]]  # [T, H] (0 + a = a)
    for j in range(1, k):
        out = out + weighted[rows[:, j]]
    return out


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int):
    """The assignments of topk_ids [T, K] grouped by expert, token order kept, without a host read:
    (order [A] into the flattened assignments, token_of [A], offsets [E+1] of each expert's rows, expert_of [A])."""
    flat_ids = topk_ids.reshape(-1)  # [A]
    order = torch.argsort(flat_ids, stable=True)  # [A]
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat_ids.device).scatter_add_(
        0, flat_ids, torch.ones_like(flat_ids))  # [E] (bincount sizes its output on the host)
    offsets = torch.cat((counts.new_zeros(1), counts.cumsum(0)))  # [E+1]
    return order, order // topk_ids.shape[1], offsets, flat_ids[order]


def grouped_linear(x_sorted: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, bias: torch.Tensor | None = None,
                   expert_of: torch.Tensor | None = None) -> torch.Tensor:
    """Rows x_sorted [A, K] of expert e (offsets[e]:offsets[e+1]) times weight[e] ([E, N, K]; a transposed view
    of [E, K, N] is fine), plus bias[e] ([E, N], with expert_of [A]) -> [A, N]: one grouped GEMM
    (zoo.kernels.triton.grouped_gemm: Triton on CUDA, its torch reference elsewhere)."""
    y = triton_kernels.grouped_gemm(x_sorted, weight, offsets)  # [A, N]
    return y if bias is None else y + bias[expert_of]


class TopKRouter(nn.Module):
    """Scores every expert for every token and keeps the top k.

    scoring: "softmax" or "sigmoid", computed in float32 (as transformers does).
    renormalize: divide the kept k weights by their sum (Mixtral always; Qwen/OLMoE when norm_topk_prob).
    weights_in_input_dtype: cast the kept weights back to the input dtype (Qwen2-MoE, Qwen3-MoE, OLMoE);
        Mixtral keeps them in float32 and the combine multiplies in float32.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, scoring: str = "softmax",
                 renormalize: bool = True, weights_in_input_dtype: bool = True, prefix: str = ""):
        super().__init__()
        if scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"{prefix}: router scoring {scoring!r} is not 'softmax' or 'sigmoid'")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"{prefix}: num_experts_per_tok={top_k} must be in 1..num_experts={num_experts}")
        self.prefix = prefix
        self.top_k, self.num_experts = top_k, num_experts
        self.scoring, self.renormalize, self.weights_in_input_dtype = scoring, renormalize, weights_in_input_dtype
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))  # [E, H]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)  # [T, E]
        scores = logits.float().softmax(-1) if self.scoring == "softmax" else logits.float().sigmoid()  # [T, E]
        weights, ids = torch.topk(scores, self.top_k, dim=-1)  # [T, K], [T, K]
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        if self.weights_in_input_dtype:
            weights = weights.to(x.dtype)
        return logits, weights, ids

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, top_k={self.top_k}, scoring={self.scoring}, renormalize={self.renormalize}"


class StackedWeight(nn.Module):
    """One weight per expert, stacked: `weight [E, out, in]`, so the key reads `<name>.weight`."""

    def __init__(self, num_experts: int, out_features: int, in_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))  # [E, out, in]
        self.weight.compact = True  # (bfloat16 under float32 activations: the experts' kernels widen it)


class StackedExperts(nn.Module):
    """E gated MLPs held as two stacked weights; each expert runs once on its contiguous slice of tokens."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, hidden_act: str = "silu",
                 prefix: str = ""):
        super().__init__()
        self.prefix = prefix
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.act = activation(hidden_act, field=f"{prefix}: hidden_act")
        self.kind = FUSED_ACTS.get(hidden_act)
        self.gate_up_proj = StackedWeight(num_experts, 2 * intermediate_size, hidden_size)  # [E, 2I, H]
        self.gate_up_proj.weight.shard_sizes = (intermediate_size, intermediate_size)  # gate rows, then up rows
        self.down_proj = StackedWeight(num_experts, hidden_size, intermediate_size)  # [E, H, I]

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if kernels.device_path(x):
            return self.grouped(x, topk_ids, topk_weights)
        w13, w2 = self.gate_up_proj.weight, self.down_proj.weight
        if self.kind and kernels.fast(x, topk_weights) and kernels.stored(w13, w2):  # float32 or bfloat16 experts
            return kernels.moe_experts(x, topk_ids, topk_weights, w13, w2, self.kind)  # [T, H], one native call
        k = topk_ids.shape[1]
        with serial_ops(x):
            flat_ids = topk_ids.reshape(-1)  # [A]
            order = torch.argsort(flat_ids, stable=True)  # [A] assignments grouped by expert, token order kept
            token_of = order // k  # [A] the token each sorted assignment belongs to
            counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()  # [E], one host sync
            x_sorted = x[token_of]  # [A, H]
            y_sorted = torch.empty_like(x_sorted)  # [A, H]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            gate_up = linear(x_sorted[start:start + n], w13[e])  # [n, 2I]
            y_sorted[start:start + n] = linear(act_and_mul(gate_up, self.act, self.kind), w2[e])  # [n, H]
            start += n
        with serial_ops(x):
            weighted = (y_sorted * topk_weights.reshape(-1)[order, None]).to(x.dtype)  # [A, H]
            if not kernels.fast(x):
                return torch.zeros_like(x).index_add_(0, token_of, weighted)  # [T, H]; summed in expert-id order
            return combine_in_expert_order(weighted, order, k)  # [T, H]: the same sums, without index_add_

    def grouped(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """The device path: the same computation with no host read (the experts' loads stay on the device),
        each GEMM one grouped GEMM over the sorted rows (Triton on CUDA)."""
        order, token_of, offsets, _ = sort_by_expert(topk_ids, self.num_experts)  # [A], [A], [E+1]
        gate_up = grouped_linear(x[token_of], self.gate_up_proj.weight, offsets)  # [A, 2I]
        y_sorted = grouped_linear(act_and_mul(gate_up, self.act, self.kind), self.down_proj.weight, offsets)  # [A, H]
        weighted = (y_sorted * topk_weights.reshape(-1)[order, None]).to(x.dtype)  # [A, H]
        return torch.zeros_like(x).index_add_(0, token_of, weighted)  # [T, H]

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, intermediate={self.intermediate_size}"


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ an optional shared expert with a sigmoid gate, Qwen2-MoE).

    `shared_expert` is any module mapping [T, H] -> [T, H] (the dense MLP of the model family);
    when given, the block also owns `shared_expert_gate` (weight [1, H]).
    """

    # tensor parallelism: the experts (and the shared expert) split by intermediate size, so the output is a
    # partial sum over the ranks; zoo.layers.parallel sums it once (the gate scales the shared part linearly)
    tensor_parallel_sum = True

    def __init__(self, *, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 hidden_act: str = "silu", scoring: str = "softmax", renormalize: bool = True,
                 weights_in_input_dtype: bool = True, shared_expert: nn.Module | None = None, prefix: str = ""):
        super().__init__()
        self.prefix = prefix
        self.gate = TopKRouter(hidden_size, num_experts, top_k, scoring=scoring, renormalize=renormalize,
                               weights_in_input_dtype=weights_in_input_dtype, prefix=f"{prefix}.gate")
        self.experts = StackedExperts(num_experts, hidden_size, intermediate_size, hidden_act=hidden_act,
                                      prefix=f"{prefix}.experts")
        if shared_expert is not None:
            self.shared_expert = shared_expert
            self.shared_expert_gate = Linear(hidden_size, 1)  # [H] -> [1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with serial_ops(x):
            _, topk_weights, topk_ids = self.gate(x)  # [T, K], [T, K]
        out = self.experts(x, topk_ids, topk_weights)  # [T, H]
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)  # [T, 1] * [T, H]
        return out
