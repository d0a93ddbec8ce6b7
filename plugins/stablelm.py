"""StableLM: Llama with biased LayerNorms, q/k/v bias, partial rotary (from the rope table), optional per-head
q/k LayerNorms (one per head) and an optional parallel residual (attention and MLP on one normed input).

Shape legend: as plugins/llama.py (T tokens, H hidden, Hq / KV heads, D head dim).
"""
from __future__ import annotations

import torch

from loader.rules import Shard, Stack
from plugins.llama import (LLAMA_RULES, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel,
                           ParallelDecoderLayer, num_kv_heads_of, tensor_parallel as dense_tensor_parallel, validate)
from registry import ArchSpec, hookimpl
from zoo.layers.norm import LayerNorm, PerHeadNorm
from zoo.runtime.batch import ForwardBatch

# diff with Llama's rules: q_layernorm.norms.{h}.weight is row h of q_layernorm.norms.weight
STABLELM_RULES = LLAMA_RULES + type(LLAMA_RULES)(stacks=(Stack("norms"),))


class StableLmNorms:
    norm_class = LayerNorm  # diff with Llama: LayerNorm with a bias

    def norm_eps(self, config) -> float:
        return config.layer_norm_eps


class StableLmAttention(LlamaAttention):
    qk_norm_names = ("q_layernorm", "k_layernorm")

    def make_qk_norms(self, eps: float) -> None:
        # diff with Llama: a norm per head, not one shared by the heads
        self.q_layernorm = PerHeadNorm(self.num_heads, self.head_dim, eps)
        self.k_layernorm = PerHeadNorm(self.num_kv_heads, self.head_dim, eps)


class StableLmDecoderLayer(StableLmNorms, LlamaDecoderLayer):
    attention_class = StableLmAttention

    def attention_kwargs(self, config, layer_idx: int) -> dict:
        kwargs = {**super().attention_kwargs(config, layer_idx), "qkv_bias": config.use_qkv_bias, "o_bias": False}
        return {**kwargs, "qk_norm_eps": config.layer_norm_eps} if config.qk_layernorm else kwargs

    def make_norms(self, config) -> None:
        self.parallel = config.use_parallel_residual  # diff with Llama: one norm when parallel
        (ParallelDecoderLayer if self.parallel else LlamaDecoderLayer).make_norms(self, config)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return (ParallelDecoderLayer if self.parallel else LlamaDecoderLayer).forward(self, positions, hidden_states,
                                                                                      batch)


class StableLmModel(StableLmNorms, LlamaModel):
    layer_class = StableLmDecoderLayer


class StableLmForCausalLM(LlamaForCausalLM):
    model_class = StableLmModel


def tensor_parallel(config, size: int):
    """Llama's split; the per-head q/k norms go with their heads: rank r reads the keys `q_layernorm.norms.{h}` of
    its query heads and `k_layernorm.norms.{h}` of its KV heads (a stack split: which keys, not which slice)."""
    return dense_tensor_parallel(config, size, shards=(
        Shard(r"\.q_layernorm\.norms\.\d+\.weight$", "column", stack=True),
        Shard(r"\.k_layernorm\.norms\.\d+\.weight$", "kv", heads=num_kv_heads_of(config), stack=True)))


@hookimpl
def register_architectures(register):
    register(ArchSpec(("StableLmForCausalLM",), "plugins.stablelm:StableLmForCausalLM", "dense",
                      rules=STABLELM_RULES, validate=validate, tensor_parallel=tensor_parallel))
