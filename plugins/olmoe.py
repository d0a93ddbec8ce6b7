"""OLMoE: Llama with q/k RMS norms over the whole projection width, optional q/k/v clipping, and a
sparse MoE block (no shared expert) in every layer.

Shape legend: as plugins/llama.py (T tokens, H hidden, Hq/KV heads, D head dim) and zoo/layers/moe.py.
"""
from __future__ import annotations

import torch

from loader.rules import Shard
from plugins.llama import (LLAMA_RULES, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel,
                           num_kv_heads_of, tensor_parallel as dense_tensor_parallel)
from plugins.mixtral import MOE_RULES, validate_moe
from registry import ArchSpec, hookimpl
from zoo.layers.moe import SparseMoeBlock
from zoo.runtime.batch import ForwardBatch


class OlmoeAttention(LlamaAttention):
    # diff with Llama: q_norm [Hq*D] and k_norm [KV*D] span all heads; q, k, v clamped to +-clip_qkv after
    def __init__(self, *, qk_norm_eps: float, clip_qkv: float | None = None, **kwargs):
        super().__init__(**kwargs)
        self.q_norm = self.norm_class(self.num_heads * self.head_dim, eps=qk_norm_eps)
        self.k_norm = self.norm_class(self.num_kv_heads * self.head_dim, eps=qk_norm_eps)
        self.clip_qkv = clip_qkv

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden_states))  # [T, Hq*D], [T, KV*D], [T, KV*D]
        q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, KV, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)  # [T, KV, D]
        q, k = self.rotary_emb(positions, q, k, batch)
        o = self.attn(q, k, v, batch.cache_for(self.prefix), batch)  # [T, Hq*D]
        return self.o_proj(o)  # [T, H]


class OlmoeDecoderLayer(LlamaDecoderLayer):
    attention_class = OlmoeAttention

    def attention_kwargs(self, config, layer_idx: int) -> dict:
        # diff with Llama: whole-width q/k norms and clipping (see OlmoeAttention)
        return {**super().attention_kwargs(config, layer_idx), "qk_norm_eps": self.norm_eps(config),
                "clip_qkv": config.clip_qkv}

    def make_mlp(self, config, layer_idx: int, prefix: str):
        # diff with Llama: a sparse MoE block in every layer
        return SparseMoeBlock(hidden_size=config.hidden_size, num_experts=config.num_experts,
                              top_k=config.num_experts_per_tok, intermediate_size=config.intermediate_size,
                              hidden_act=config.hidden_act, renormalize=config.norm_topk_prob, prefix=prefix)


class OlmoeModel(LlamaModel):
    layer_class = OlmoeDecoderLayer


class OlmoeForCausalLM(LlamaForCausalLM):
    model_class = OlmoeModel


def tensor_parallel(config, size: int):
    """Llama's split (each expert by its intermediate size, the router replicated); the whole-width q / k norms'
    weights split with the heads (k_norm's with KV replication): each rank normalises its part of q and k by the
    rms over the whole width, its sum of squares summed over the ranks (zoo/layers/parallel.py WholeWidthRMS)."""
    return dense_tensor_parallel(config, size, shards=(
        Shard(r"\.q_norm\.weight$", "column"), Shard(r"\.k_norm\.weight$", "kv", heads=num_kv_heads_of(config))))


@hookimpl
def register_architectures(register):
    register(ArchSpec(("OlmoeForCausalLM",), "plugins.olmoe:OlmoeForCausalLM", "moe", rules=LLAMA_RULES + MOE_RULES,
                      validate=validate_moe, tensor_parallel=tensor_parallel))
