"""Granite: Llama with four multipliers, each where transformers applies it (so each parity tap sees it):
the embedding (after embed_tokens), the residual branches (in the layer), the attention scores (the softmax
scale) and the logits (divided by logits_scaling, in the head).

Shape legend: as plugins/llama.py (T tokens, H hidden).
"""
from __future__ import annotations

import torch

from plugins.llama import (LLAMA_RULES, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, tensor_parallel,
                           validate)
from registry import ArchSpec, hookimpl
from zoo.layers.embedding import LMHead
from zoo.runtime.batch import ForwardBatch


class GraniteDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config, layer_idx: int, *, prefix: str):
        super().__init__(config, layer_idx, prefix=prefix)
        self.residual_multiplier = config.residual_multiplier

    def attention_kwargs(self, config, layer_idx: int) -> dict:
        # diff with Llama: scores scaled by attention_multiplier instead of D^-0.5
        return {**super().attention_kwargs(config, layer_idx), "scale": config.attention_multiplier}

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # diff with Llama: each block's output scaled by residual_multiplier before the add
        h = self.self_attn(positions, self.input_layernorm(hidden_states), batch)  # [T, H]
        hidden_states = hidden_states + h * self.residual_multiplier
        h = self.mlp(self.post_attention_layernorm(hidden_states))  # [T, H]
        return hidden_states + h * self.residual_multiplier


class GraniteModel(LlamaModel):
    layer_class = GraniteDecoderLayer

    def __init__(self, config, *, prefix: str = "model"):
        super().__init__(config, prefix=prefix)
        self.embedding_multiplier = config.embedding_multiplier

    def embed(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier  # diff with Llama: [T, H] scaled


class GraniteForCausalLM(LlamaForCausalLM):
    model_class = GraniteModel

    def make_head(self, config) -> LMHead:
        return LMHead(config.vocab_size, config.hidden_size, divisor=config.logits_scaling)  # diff with Llama


@hookimpl
def register_architectures(register):
    register(ArchSpec(("GraniteForCausalLM",), "plugins.granite:GraniteForCausalLM", "dense", rules=LLAMA_RULES,
                      validate=validate, tensor_parallel=tensor_parallel))
