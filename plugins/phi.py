"""Phi (Phi-1, Phi-2): a parallel block (attention and MLP on one normed input) with biased LayerNorms, biases
everywhere (the head too), partial rotary, optional q/k LayerNorms shared by the heads and a plain GELU MLP.

Shape legend: as plugins/llama.py.
"""
from __future__ import annotations

from functools import partial

from loader.rules import Rename, Rules, Shard
from plugins.llama import (LLAMA_RULES, LlamaAttention, LlamaForCausalLM, LlamaModel, ParallelDecoderLayer,
                           tensor_parallel, validate)
from registry import ArchSpec, hookimpl
from zoo.layers.embedding import LMHead
from zoo.layers.mlp import MLP
from zoo.layers.norm import LayerNorm

# diff with Llama's rules: the output projection is `dense`, the final norm `final_layernorm`
PHI_RULES = LLAMA_RULES + Rules(renames=(Rename(".self_attn.dense.", ".self_attn.o_proj."),
                                         Rename("model.final_layernorm.", "model.norm.")))


class PhiNorms:
    norm_class = LayerNorm  # diff with Llama: LayerNorm with a bias

    def norm_eps(self, config) -> float:
        return config.layer_norm_eps


class PhiAttention(LlamaAttention):
    norm_class = LayerNorm  # of the q/k norms
    qk_norm_names = ("q_layernorm", "k_layernorm")


class PhiDecoderLayer(PhiNorms, ParallelDecoderLayer):
    attention_class = PhiAttention

    def attention_kwargs(self, config, layer_idx: int) -> dict:
        kwargs = {**super().attention_kwargs(config, layer_idx), "qkv_bias": True, "o_bias": True}
        return {**kwargs, "qk_norm_eps": config.layer_norm_eps} if config.qk_layernorm else kwargs

    def make_mlp(self, config, layer_idx: int, prefix: str):
        return MLP(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                   hidden_act=config.hidden_act, prefix=prefix)  # diff with Llama: fc1, fc2, not gated


class PhiModel(PhiNorms, LlamaModel):
    layer_class = PhiDecoderLayer


class PhiForCausalLM(LlamaForCausalLM):
    model_class = PhiModel
    parity_taps = {"model.norm": "model.final_layernorm"}  # the reference's name, for parity

    def make_head(self, config) -> LMHead:
        return LMHead(config.vocab_size, config.hidden_size, bias=True)  # diff with Llama: a biased head


# tensor parallelism: Llama's (the head's bias vocab-parallel with it); fc1 and its bias column-parallel, fc2 and
# `dense` (o_proj) row-parallel, their biases added once; the q/k LayerNorms, shared by the heads, replicated
SHARDS = (Shard(r"\.fc1\.(weight|bias)$", "column"), Shard(r"\.(fc2|dense)\.weight$", "row"))


@hookimpl
def register_architectures(register):
    register(ArchSpec(("PhiForCausalLM",), "plugins.phi:PhiForCausalLM", "dense", rules=PHI_RULES,
                      validate=validate, tensor_parallel=partial(tensor_parallel, shards=SHARDS)))
