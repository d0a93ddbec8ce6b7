"""OLMo-2: Llama with norms after each block instead of before (post_attention / post_feedforward), q/k norms
over the whole projection width (OLMoE's), and RMS norms that apply the weight in float32.

Shape legend: as plugins/llama.py (T tokens, H hidden).
"""
from __future__ import annotations

import torch

from plugins.llama import LLAMA_RULES, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, validate
from plugins.olmoe import OlmoeAttention, tensor_parallel
from registry import ArchSpec, hookimpl
from zoo.layers.norm import RMSNormF32Weight
from zoo.runtime.batch import ForwardBatch


class Olmo2Attention(OlmoeAttention):
    norm_class = RMSNormF32Weight  # diff with OLMoE: the q/k norms apply their weight in float32


class Olmo2DecoderLayer(LlamaDecoderLayer):
    attention_class = Olmo2Attention
    norm_class = RMSNormF32Weight  # diff with Llama: weight applied in float32

    def attention_kwargs(self, config, layer_idx: int) -> dict:
        return {**super().attention_kwargs(config, layer_idx), "qk_norm_eps": self.norm_eps(config)}

    def make_norms(self, config) -> None:
        # diff with Llama: each block's output is normed; nothing normed on the way in
        self.post_attention_layernorm = self.make_norm(config, config.hidden_size)
        self.post_feedforward_layernorm = self.make_norm(config, config.hidden_size)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        hidden_states = hidden_states + self.post_attention_layernorm(self.self_attn(positions, hidden_states, batch))
        return hidden_states + self.post_feedforward_layernorm(self.mlp(hidden_states))  # [T, H]


class Olmo2Model(LlamaModel):
    layer_class = Olmo2DecoderLayer
    norm_class = RMSNormF32Weight


class Olmo2ForCausalLM(LlamaForCausalLM):
    model_class = Olmo2Model


@hookimpl
def register_architectures(register):
    register(ArchSpec(("Olmo2ForCausalLM",), "plugins.olmo2:Olmo2ForCausalLM", "dense", rules=LLAMA_RULES,
                      validate=validate, tensor_parallel=tensor_parallel))  # OLMoE's (the whole-width q/k norms)
