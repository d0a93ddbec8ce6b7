"""Gemma2: Gemma3's layer (norms around both blocks' outputs, sliding / full layers) without q/k norms, with
tanh-softcapped attention scores and one rope for every layer.

Shape legend: as plugins/llama.py (T tokens, H hidden).
"""
from __future__ import annotations

from plugins.gemma3 import Gemma3DecoderLayer, Gemma3ForCausalLM, Gemma3Model, validate_gemma3
from plugins.llama import LLAMA_RULES, LlamaDecoderLayer, tensor_parallel
from registry import ArchSpec, hookimpl


class Gemma2DecoderLayer(Gemma3DecoderLayer):
    def attention_kwargs(self, config, layer_idx: int) -> dict:
        # diff with Gemma3: no q/k norms; attn_logit_softcapping caps the scores
        return {**LlamaDecoderLayer.attention_kwargs(self, config, layer_idx),
                "scale": config.query_pre_attn_scalar ** -0.5, "softcap": config.attn_logit_softcapping}


class Gemma2Model(Gemma3Model):
    layer_class = Gemma2DecoderLayer


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    model_class = Gemma2Model


@hookimpl
def register_architectures(register):
    register(ArchSpec(("Gemma2ForCausalLM",), "plugins.gemma2:Gemma2ForCausalLM", "dense", rules=LLAMA_RULES,
                      validate=validate_gemma3, tensor_parallel=tensor_parallel))
