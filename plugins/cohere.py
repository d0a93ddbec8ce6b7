"""Cohere (Command-R): a parallel block (attention and MLP on one normed input), bias-free LayerNorms, the
interleaved rotary layout, optional per-head q/k LayerNorms (a weight row per head) and scaled logits.

Shape legend: as plugins/llama.py (T tokens, H hidden, Hq / KV heads, D head dim).
"""
from __future__ import annotations

from loader.rules import Shard
from plugins.llama import (LLAMA_RULES, LlamaAttention, LlamaForCausalLM, LlamaModel, ParallelDecoderLayer,
                           num_kv_heads_of, tensor_parallel as dense_tensor_parallel, validate)
from registry import ArchSpec, hookimpl
from zoo.layers.embedding import LMHead
from zoo.layers.norm import LayerNorm
from zoo.layers.rotary import get_rope, rope_parameters


class CohereNorms:
    def norm_eps(self, config) -> float:
        return config.layer_norm_eps

    def make_norm(self, config, dim: int) -> LayerNorm:
        return LayerNorm(dim, self.norm_eps(config), bias=False)  # diff with Llama: LayerNorm, no bias


class CohereAttention(LlamaAttention):
    def make_qk_norms(self, eps: float) -> None:
        # diff with Llama: one weight row per head
        self.q_norm = LayerNorm((self.num_heads, self.head_dim), eps, bias=False)
        self.k_norm = LayerNorm((self.num_kv_heads, self.head_dim), eps, bias=False)


class CohereDecoderLayer(CohereNorms, ParallelDecoderLayer):
    attention_class = CohereAttention

    def attention_kwargs(self, config, layer_idx: int) -> dict:
        kwargs = super().attention_kwargs(config, layer_idx)
        # diff with Llama: dims 2f and 2f + 1 rotate together
        kwargs["rope"] = get_rope(head_dim=kwargs["head_dim"], rope_parameters=rope_parameters(config),
                                  max_position_embeddings=config.max_position_embeddings, layout="interleaved")
        return {**kwargs, "qk_norm_eps": config.layer_norm_eps} if config.use_qk_norm else kwargs


class CohereModel(CohereNorms, LlamaModel):
    layer_class = CohereDecoderLayer


class CohereForCausalLM(LlamaForCausalLM):
    model_class = CohereModel

    def make_head(self, config) -> LMHead:
        return LMHead(config.vocab_size, config.hidden_size, scale=config.logit_scale)  # diff with Llama


def tensor_parallel(config, size: int):
    """Llama's split; the per-head q/k norm rows [Hq, D] / [KV, D] go with their heads (k_norm's KV-replicated)."""
    return dense_tensor_parallel(config, size, shards=(
        Shard(r"\.q_norm\.weight$", "column"), Shard(r"\.k_norm\.weight$", "kv", heads=num_kv_heads_of(config))))


@hookimpl
def register_architectures(register):
    register(ArchSpec(("CohereForCausalLM",), "plugins.cohere:CohereForCausalLM", "dense", rules=LLAMA_RULES,
                      validate=validate, tensor_parallel=tensor_parallel))
