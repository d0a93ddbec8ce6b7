"""Gemma: Llama with (1 + w) RMS norms, an embedding scaled by sqrt(H), a GELU-tanh gated MLP and a tied head.

Shape legend: as plugins/llama.py (T tokens, H hidden).
"""
from __future__ import annotations

from plugins.llama import (LLAMA_RULES, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, tensor_parallel,
                           validate)
from registry import ArchSpec, hookimpl
from zoo.layers.mlp import GatedMLP
from zoo.layers.norm import GemmaRMSNorm


class GemmaDecoderLayer(LlamaDecoderLayer):
    norm_class = GemmaRMSNorm  # diff with Llama: (1 + w) norms

    def make_mlp(self, config, layer_idx: int, prefix: str):
        # diff with Llama: config.hidden_act is gelu_pytorch_tanh
        return GatedMLP(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                        hidden_act=config.hidden_act, prefix=prefix)


class GemmaModel(LlamaModel):
    layer_class = GemmaDecoderLayer
    norm_class = GemmaRMSNorm  # diff with Llama: (1 + w) final norm

    def embed_scale(self, config) -> float:
        return config.hidden_size ** 0.5  # diff with Llama: embeddings scaled by sqrt(H)


class GemmaForCausalLM(LlamaForCausalLM):
    model_class = GemmaModel


@hookimpl
def register_architectures(register):
    register(ArchSpec(("GemmaForCausalLM",), "plugins.gemma:GemmaForCausalLM", "dense", rules=LLAMA_RULES,
                      validate=validate, tensor_parallel=tensor_parallel))
