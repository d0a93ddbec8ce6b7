"""Bamba, and the base classes of the hybrid attention / SSM family: each layer is a Mamba2 mixer or a
Llama attention (on the layers `attn_layer_indices` names), then a gated MLP, each pre-normed with a residual.

Shape legend: as plugins/llama.py (T tokens, H hidden, V vocab) and zoo/layers/mamba.py (the mixer).

Attention rotates only the first half of each head (transformers forces partial_rotary_factor = 0.5 into
rope_parameters, and zoo.layers.rotary rotates rotary_dim of the head). Checkpoint layout:
`model.layers.{i}.mamba.*` (the mixer) or `model.layers.{i}.self_attn.{q,k,v,o}_proj`,
`model.layers.{i}.feed_forward.{gate,up,down}_proj`, `input_layernorm`, `pre_ff_layernorm`,
`model.final_layernorm`. Module names are the checkpoint's.

Subclassing (Jamba): HybridDecoderLayer.make_mixer(config, layer_idx, prefix), make_mlp (the feed-forward),
attention_kwargs (LlamaDecoderLayer's); HybridModel.layer_class; HybridForCausalLM.model_class.
"""
from __future__ import annotations

import torch
from torch import nn

from loader.rules import Rules
from plugins.llama import LLAMA_RULES, LlamaDecoderLayer
from plugins.llama import tensor_parallel as dense_tensor_parallel, validate as validate_llama
from plugins.mamba2 import mamba2_mixer, ssd_tensor_parallel, validate_ssd
from registry import ArchSpec, hookimpl
from zoo.layers.embedding import LMHead, VocabEmbedding
from zoo.layers.norm import RMSNorm
from zoo.runtime.batch import ForwardBatch

BAMBA_RULES = LLAMA_RULES


class HybridDecoderLayer(LlamaDecoderLayer):
    """norm -> (mixer | attention) -> residual -> norm -> feed-forward -> residual."""

    # diff with Llama: the token mixer is a recurrent mixer on linear_attention layers; the norms and the
    # feed-forward carry Bamba's names (pre_ff_layernorm, feed_forward)
    def __init__(self, config, layer_idx: int, *, prefix: str):
        nn.Module.__init__(self)
        self.prefix, self.layer_idx = prefix, layer_idx
        self.kind = self.layer_type(config, layer_idx)
        if self.kind == "full_attention":
            self.self_attn = self.attention_class(**self.attention_kwargs(config, layer_idx),
                                                  prefix=f"{prefix}.self_attn")
        elif self.kind == "linear_attention":
            self.mamba = self.make_mixer(config, layer_idx, prefix=f"{prefix}.mamba")
        else:
            raise ValueError(f"{prefix}: layer type {self.kind!r} is neither 'full_attention' nor 'linear_attention'")
        self.feed_forward = self.make_mlp(config, layer_idx, prefix=f"{prefix}.feed_forward")
        self.input_layernorm = self.make_norm(config, config.hidden_size)
        self.pre_ff_layernorm = self.make_norm(config, config.hidden_size)

    def make_mixer(self, config, layer_idx: int, prefix: str) -> nn.Module:
        return mamba2_mixer(config, prefix=prefix, heads="mamba_n_heads", head_dim="mamba_d_head",
                            state="mamba_d_state", groups="mamba_n_groups", conv="mamba_d_conv",
                            chunk="mamba_chunk_size", eps="rms_norm_eps", bias="mamba_proj_bias",
                            conv_bias="mamba_conv_bias")

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        h = self.input_layernorm(hidden_states)  # [T, H]
        h = self.self_attn(positions, h, batch) if self.kind == "full_attention" else self.mamba(h, batch)
        hidden_states = hidden_states + h
        return hidden_states + self.feed_forward(self.pre_ff_layernorm(hidden_states))  # [T, H]


class HybridModel(nn.Module):
    layer_class = HybridDecoderLayer

    def __init__(self, config, *, prefix: str = "model"):
        super().__init__()
        self.prefix = prefix
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(config, i, prefix=f"{prefix}.layers.{i}")
                                    for i in range(config.num_hidden_layers))
        self.final_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # [T, H]
        for layer in self.layers:
            hidden_states = layer(positions, hidden_states, batch)  # [T, H]
        return self.final_layernorm(hidden_states)  # [T, H]


class HybridForCausalLM(nn.Module):
    model_class = HybridModel

    def __init__(self, config, *, prefix: str = ""):
        super().__init__()
        self.config = config
        self.model = self.model_class(config, prefix=f"{prefix}.model" if prefix else "model")
        self.lm_head = LMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight  # one Parameter under two names

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.model(input_ids, positions, batch)  # [T] -> [T, H]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)  # [N, H] -> [N, V]


class BambaForCausalLM(HybridForCausalLM):
    pass


def validate(config) -> None:
    validate_llama(config)
    validate_ssd(config, heads="mamba_n_heads", head_dim="mamba_d_head", groups="mamba_n_groups",
                 expand="mamba_expand")


def tensor_parallel(config, size: int):
    """Llama's split for the attention layers and the MLPs, Mamba2's for the mixers (by heads, B / C by groups)."""
    local, rules = dense_tensor_parallel(config, size)
    mixers = ssd_tensor_parallel(config, local, size, heads="mamba_n_heads", groups="mamba_n_groups", module="mamba")
    return local, Rules(shards=mixers) + rules


@hookimpl
def register_architectures(register):
    register(ArchSpec(("BambaForCausalLM",), "plugins.bamba:BambaForCausalLM", "hybrid-ssm", rules=BAMBA_RULES,
                      validate=validate, tensor_parallel=tensor_parallel))
