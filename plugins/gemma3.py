"""Gemma3 (text only, model_type gemma3_text): Llama with (1 + w) norms, norms around both sublayers,
q/k norms, query_pre_attn_scalar scaling, sliding/full layers with their own rope bases, a scaled
embedding, gelu-tanh MLP, and optional tanh softcapping of the logits.

Shape legend: as plugins/llama.py (T tokens, H hidden, D head dim).
"""
from __future__ import annotations

import torch

from plugins.gemma import GemmaModel
from plugins.llama import (LLAMA_RULES, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, tensor_parallel,
                           validate)
from registry import ArchSpec, hookimpl
from zoo.layers.mlp import GatedMLP
from zoo.layers.norm import GemmaRMSNorm
from zoo.runtime.batch import ForwardBatch


class Gemma3Attention(LlamaAttention):
    norm_class = GemmaRMSNorm  # diff with Llama: the q/k norms are (1 + w) norms


class Gemma3DecoderLayer(LlamaDecoderLayer):
    attention_class = Gemma3Attention
    norm_class = GemmaRMSNorm  # diff with Llama: (1 + w) norms

    def __init__(self, config, layer_idx: int, *, prefix: str):
        super().__init__(config, layer_idx, prefix=prefix)
        # diff with Llama: the MLP is normed on its way in and out, as attention is
        self.pre_feedforward_layernorm = self.make_norm(config, config.hidden_size)
        self.post_feedforward_layernorm = self.make_norm(config, config.hidden_size)

    def attention_kwargs(self, config, layer_idx: int) -> dict:
        # diff with Llama: q/k norms, scores scaled by query_pre_attn_scalar^-0.5. attn_logit_softcapping
        # is read but not applied by transformers' Gemma3 (Gemma2 applies it); released configs set it null.
        return {**super().attention_kwargs(config, layer_idx), "qk_norm_eps": self.norm_eps(config),
                "scale": config.query_pre_attn_scalar ** -0.5}

    def make_mlp(self, config, layer_idx: int, prefix: str):
        # diff with Llama: the activation is config.hidden_activation (gelu_pytorch_tanh)
        return GatedMLP(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                        hidden_act=config.hidden_activation, prefix=prefix)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # diff with Llama: each sublayer's output is normed before the residual add
        h = self.self_attn(positions, self.input_layernorm(hidden_states), batch)  # [T, H]
        hidden_states = hidden_states + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(hidden_states))  # [T, H]
        return hidden_states + self.post_feedforward_layernorm(h)


class Gemma3Model(GemmaModel):  # Gemma's (1 + w) final norm and sqrt(H)-scaled embedding
    layer_class = Gemma3DecoderLayer


class Gemma3ForCausalLM(LlamaForCausalLM):
    model_class = Gemma3Model

    def __init__(self, config, *, prefix: str = ""):
        super().__init__(config, prefix=prefix)
        self.lm_head.softcap = getattr(config, "final_logit_softcapping", None)  # diff with Llama: logit softcap


def validate_gemma3(config) -> None:
    validate(config)
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("config.use_bidirectional_attention=True is not supported (causal attention only)")


@hookimpl
def register_architectures(register):
    register(ArchSpec(("Gemma3ForCausalLM",), "plugins.gemma3:Gemma3ForCausalLM", "dense", rules=LLAMA_RULES,
                      validate=validate_gemma3, tensor_parallel=tensor_parallel))
