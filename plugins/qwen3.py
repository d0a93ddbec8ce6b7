"""Qwen3: Llama with RMS norms on each query and key head (before the rotation).

Shape legend: as plugins/llama.py (T tokens, H hidden).
"""
from __future__ import annotations

from plugins.llama import LLAMA_RULES, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, tensor_parallel, validate
from registry import ArchSpec, hookimpl


class Qwen3DecoderLayer(LlamaDecoderLayer):
    def attention_kwargs(self, config, layer_idx: int) -> dict:
        # diff with Llama: q_norm / k_norm on the head dim
        return {**super().attention_kwargs(config, layer_idx), "qk_norm_eps": self.norm_eps(config)}


class Qwen3Model(LlamaModel):
    layer_class = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_class = Qwen3Model


@hookimpl
def register_architectures(register):
    register(ArchSpec(("Qwen3ForCausalLM",), "plugins.qwen3:Qwen3ForCausalLM", "dense", rules=LLAMA_RULES,
                      validate=validate, tensor_parallel=tensor_parallel))
