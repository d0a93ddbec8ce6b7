"""Mistral: Llama with a sliding window on every layer (when config.sliding_window is set).

Shape legend: as plugins/llama.py (T tokens, H hidden).
"""
from __future__ import annotations

from plugins.llama import LLAMA_RULES, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, tensor_parallel, validate
from registry import ArchSpec, hookimpl


class MistralDecoderLayer(LlamaDecoderLayer):
    def attention_kwargs(self, config, layer_idx: int) -> dict:
        # diff with Llama: one window for all layers (Mistral's config has no layer_types)
        return {**super().attention_kwargs(config, layer_idx), "sliding_window": config.sliding_window}


class MistralModel(LlamaModel):
    layer_class = MistralDecoderLayer


class MistralForCausalLM(LlamaForCausalLM):
    model_class = MistralModel


@hookimpl
def register_architectures(register):
    register(ArchSpec(("MistralForCausalLM",), "plugins.mistral:MistralForCausalLM", "dense", rules=LLAMA_RULES,
                      validate=validate, tensor_parallel=tensor_parallel))
