"""SmolLM3: Llama whose layers listed 0 in config.no_rope_layers have no positional encoding (NoPE), with
sliding windows only when use_sliding_window is set.

Shape legend: as plugins/llama.py.
"""
from __future__ import annotations

from plugins.llama import (LLAMA_RULES, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, tensor_parallel,
                           validate)
from registry import ArchSpec, hookimpl


class SmolLM3DecoderLayer(LlamaDecoderLayer):
    def attention_kwargs(self, config, layer_idx: int) -> dict:
        kwargs = super().attention_kwargs(config, layer_idx)
        if not config.no_rope_layers[layer_idx]:
            kwargs["rope"] = None  # diff with Llama: a NoPE layer
        if not config.use_sliding_window:
            kwargs["sliding_window"] = None  # diff with Llama: layer_types name windows that are off
        return kwargs


class SmolLM3Model(LlamaModel):
    layer_class = SmolLM3DecoderLayer


class SmolLM3ForCausalLM(LlamaForCausalLM):
    model_class = SmolLM3Model


@hookimpl
def register_architectures(register):
    register(ArchSpec(("SmolLM3ForCausalLM",), "plugins.smollm3:SmolLM3ForCausalLM", "dense", rules=LLAMA_RULES,
                      validate=validate, tensor_parallel=tensor_parallel))
