"""Qwen2: Llama with biased q/k/v projections (o_proj has none); sliding layers come from layer_types.

Shape legend: as plugins/llama.py (T tokens, H hidden).
"""
from __future__ import annotations

from plugins.llama import LLAMA_RULES, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, tensor_parallel, validate
from registry import ArchSpec, hookimpl


class Qwen2DecoderLayer(LlamaDecoderLayer):
    def attention_kwargs(self, config, layer_idx: int) -> dict:
        # diff with Llama: q/k/v always carry a bias, o_proj never (no attention_bias field)
        return {**super().attention_kwargs(config, layer_idx), "qkv_bias": True, "o_bias": False}


class Qwen2Model(LlamaModel):
    layer_class = Qwen2DecoderLayer


class Qwen2ForCausalLM(LlamaForCausalLM):
    model_class = Qwen2Model


@hookimpl
def register_architectures(register):
    register(ArchSpec(("Qwen2ForCausalLM",), "plugins.qwen2:Qwen2ForCausalLM", "dense", rules=LLAMA_RULES,
                      validate=validate, tensor_parallel=tensor_parallel))
