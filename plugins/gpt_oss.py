"""gpt-oss: Llama with attention sinks (a learned logit per head in every softmax), biased projections,
sliding / full layers, yarn rope, and a MoE block whose router has a bias and whose experts keep the
checkpoint's layout: gate_up_proj [E, H, 2I] (gate and up interleaved column by column) and down_proj [E, I, H],
each with a bias, under a clamped SwiGLU: (clamp(up) + 1) * g * sigmoid(alpha g), g = min(gate, limit).

Shape legend: as plugins/llama.py and zoo/layers/moe.py (T tokens, H hidden, E experts, K top-k, I expert size).
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from loader.rules import Shard
from plugins.llama import (LLAMA_RULES, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel,
                           tensor_parallel)
from plugins.mixtral import validate_moe  # (GptOssConfig.num_experts is num_local_experts)
from registry import ArchSpec, hookimpl
from zoo.layers.moe import grouped_linear, on_device_path, sort_by_expert


class GptOssAttention(LlamaAttention):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.sinks = nn.Parameter(torch.empty(self.num_heads))  # [Hq] diff with Llama: LlamaAttention applies them


class GptOssRouter(nn.Module):
    """logits = x W^T + b [T, E]; the top k logits, softmaxed among themselves, weight the experts."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))  # [E, H]
        self.bias = nn.Parameter(torch.empty(num_experts))  # [E]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight, self.bias)  # [T, E]
        top, ids = logits.topk(self.top_k, dim=-1)  # [T, K], [T, K]
        return logits, top.softmax(-1), ids


class GptOssExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, alpha: float, limit: float):
        super().__init__()
        self.alpha, self.limit = alpha, limit
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden_size, 2 * intermediate_size))  # [E, H, 2I]
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size))  # [E, 2I]
        self.down_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))  # [E, I, H]
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size))  # [E, H]

    def act(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate = gate_up[:, ::2].clamp(max=self.limit)  # [n, I]
        up = gate_up[:, 1::2].clamp(-self.limit, self.limit)  # [n, I]
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))  # [n, I]

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if on_device_path(x):  # the same, as two grouped GEMMs over the rows sorted by expert (no host read)
            order, token_of, offsets, expert_of = sort_by_expert(ids, self.gate_up_proj.shape[0])  # [A], .., [E+1]
            gate_up = grouped_linear(x[token_of], self.gate_up_proj.transpose(1, 2), offsets, self.gate_up_proj_bias,
                                     expert_of)  # [A, 2I]
            y = grouped_linear(self.act(gate_up), self.down_proj.transpose(1, 2), offsets, self.down_proj_bias,
                               expert_of)  # [A, H]
            return torch.zeros_like(x).index_add_(0, token_of, y * weights.reshape(-1)[order, None].to(y.dtype))
        out = torch.zeros_like(x)  # [T, H]
        for e in ids.unique().tolist():
            rows, slot = (ids == e).nonzero(as_tuple=True)  # the n tokens routed to e, and at which of their k
            gate_up = x[rows] @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]  # [n, 2I]
            y = self.act(gate_up) @ self.down_proj[e] + self.down_proj_bias[e]  # [n, H]
            out.index_add_(0, rows, y * weights[rows, slot, None].to(y.dtype))
        return out


class GptOssMLP(nn.Module):
    # tensor parallelism: the experts split by intermediate size return a partial sum; summed once over the ranks
    # (zoo/layers/parallel.py), down_proj_bias held by rank 0 only (its Shard "once") so that it counts once
    tensor_parallel_sum = True

    def __init__(self, config, prefix: str):
        super().__init__()
        self.prefix = prefix
        self.router = GptOssRouter(config.hidden_size, config.num_local_experts, config.num_experts_per_tok)
        self.experts = GptOssExperts(config.num_local_experts, config.hidden_size, config.intermediate_size,
                                     config.swiglu_alpha, config.swiglu_limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, weights, ids = self.router(x)  # [T, K], [T, K]
        return self.experts(x, ids, weights)  # [T, H]


class GptOssDecoderLayer(LlamaDecoderLayer):
    attention_class = GptOssAttention

    def make_mlp(self, config, layer_idx: int, prefix: str):
        return GptOssMLP(config, prefix)  # diff with Llama: the MoE block


class GptOssModel(LlamaModel):
    layer_class = GptOssDecoderLayer


class GptOssForCausalLM(LlamaForCausalLM):
    model_class = GptOssModel


# tensor parallelism: Llama's attention (biases of q/k/v split with them, o_proj's added once), a sink per query
# head going with its head; the experts split by intermediate size in the checkpoint's [E, in, out] layout:
# gate_up_proj's columns (gate and up interleaved: a rank's I/N units are one run of 2I/N columns) and their bias,
# down_proj's rows; down_proj_bias on rank 0 only, zeros elsewhere (added once in the summed block); the biased
# router replicated
SHARDS = (Shard(r"\.self_attn\.sinks$", "column"),
          Shard(r"\.experts\.gate_up_proj$", "column", dim=2), Shard(r"\.experts\.gate_up_proj_bias$", "column", dim=1),
          Shard(r"\.experts\.down_proj$", "row", dim=1), Shard(r"\.experts\.down_proj_bias$", "once"))


@hookimpl
def register_architectures(register):
    register(ArchSpec(("GptOssForCausalLM",), "plugins.gpt_oss:GptOssForCausalLM", "moe", rules=LLAMA_RULES,
                      validate=validate_moe, tensor_parallel=partial(tensor_parallel, shards=SHARDS)))
