"""GPT-2: learned absolute position embeddings (no rotary), biased LayerNorms, biases everywhere, a plain GELU
MLP, a tied head, and Conv1D weights stored transposed ([in, out]), rearranged by a Transform rule as they load.

Shape legend: as plugins/llama.py (T tokens, H hidden).
Checkpoint names (transformer.h.{i}.attn.c_attn, transformer.wpe, ...) are renamed onto Llama's; the hub's
GPT-2 checkpoints store them without `transformer.` (h.{i}..., wte), which transformers also loads: either
layout maps, and a checkpoint holding both writes each parameter twice (a duplicate-write LoadError).
"""
from __future__ import annotations

import copy

import torch

from loader.rules import Ignore, Rename, Rules, Shard, Transform
from plugins.llama import LLAMA_RULES, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, tensor_parallel as dense_tp
from registry import ArchSpec, hookimpl
from zoo.layers.embedding import VocabEmbedding
from zoo.layers.mlp import MLP, activation
from zoo.layers.norm import LayerNorm
from zoo.runtime.batch import ForwardBatch

GPT2_RULES = Rules(
    renames=tuple(Rename(a, b) for a, b in (
        ("^wte.", "model.embed_tokens."), ("^wpe.", "model.embed_positions."), ("^h.", "model.layers."),
        ("^ln_f.", "model.norm."),  # the hub's layout, without the `transformer.` prefix
        ("^transformer.wte.", "model.embed_tokens."), ("^transformer.wpe.", "model.embed_positions."),
        ("^transformer.h.", "model.layers."), ("^transformer.ln_f.", "model.norm."),
        (".ln_1.", ".input_layernorm."), (".ln_2.", ".post_attention_layernorm."),
        (".attn.c_attn.", ".self_attn.qkv_proj."), (".attn.c_proj.", ".self_attn.o_proj."))),
    ignores=LLAMA_RULES.ignores + (Ignore(r"\.attn\.(bias|masked_bias)$", "causal-mask buffers of old "
                                                                         "checkpoints; the runtime masks"),),
    transforms=(Transform(r"\.(c_attn|c_proj|c_fc)\.weight$", "transpose"),),  # Conv1D: [in, out]
)


class GPT2Norms:
    norm_class = LayerNorm  # diff with Llama: LayerNorm with a bias

    def norm_eps(self, config) -> float:
        return config.layer_norm_epsilon


class GPT2DecoderLayer(GPT2Norms, LlamaDecoderLayer):
    def attention_kwargs(self, config, layer_idx: int) -> dict:
        # diff with Llama: no rotary, no GQA, biases, scores scaled by D^-0.5 and optionally 1 / (layer + 1)
        kwargs = super().attention_kwargs(config, layer_idx)
        scale = kwargs["head_dim"] ** -0.5 if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            scale /= float(layer_idx + 1)
        return {**kwargs, "rope": None, "num_kv_heads": config.num_attention_heads, "qkv_bias": True,
                "o_bias": True, "scale": scale}

    def make_mlp(self, config, layer_idx: int, prefix: str):
        return MLP(hidden_size=config.hidden_size, intermediate_size=config.n_inner or 4 * config.hidden_size,
                   hidden_act=config.activation_function, names=("c_fc", "c_proj"), prefix=prefix)


class GPT2Model(GPT2Norms, LlamaModel):
    layer_class = GPT2DecoderLayer

    def __init__(self, config, *, prefix: str = "model"):
        super().__init__(config, prefix=prefix)
        # diff with Llama: a learned embedding per absolute position
        self.embed_positions = VocabEmbedding(config.max_position_embeddings, config.hidden_size)

    def embed(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.embed_tokens(input_ids) + self.embed_positions(batch.positions)  # [T, H]


class GPT2LMHeadModel(LlamaForCausalLM):
    model_class = GPT2Model
    parity_taps = {"model.embed_tokens": "transformer.wte", "model.embed_positions": "transformer.wpe",
                   "model.norm": "transformer.ln_f", "model.layers.{i}": "transformer.h.{i}",
                   "model.layers.{i}.input_layernorm": "transformer.h.{i}.ln_1",
                   "model.layers.{i}.self_attn": "transformer.h.{i}.attn",
                   "model.layers.{i}.post_attention_layernorm": "transformer.h.{i}.ln_2",
                   "model.layers.{i}.mlp": "transformer.h.{i}.mlp"}  # the reference's names, for parity
    learned_positions = True  # diff with Llama: no position past max_position_embeddings (a longer context: refused)


def validate_gpt2(config) -> None:
    activation(config.activation_function, field="config.activation_function")


def tensor_parallel(config, size: int):
    """Llama's split under the checkpoint's names, each in the parameter's layout (the Conv1D transpose applies to
    the rank's slice): c_attn's q, k and v parts by heads (a fused key; its bias the same), c_fc and its bias
    column-parallel, both c_proj row-parallel (biases added once), wte by vocab; wpe, the learned positions,
    replicated."""
    config = copy.deepcopy(config)
    config.n_inner = config.n_inner or 4 * config.hidden_size  # (the default, made explicit so that it splits)
    return dense_tp(config, size, fields=("n_inner",), vocab_keys=("wte",), shards=(
        Shard(r"\.c_attn\.(weight|bias)$", "fused", parts=("column", "column", "column")),
        Shard(r"\.c_fc\.(weight|bias)$", "column"), Shard(r"\.c_proj\.weight$", "row")))


@hookimpl
def register_architectures(register):
    register(ArchSpec(("GPT2LMHeadModel",), "plugins.gpt2:GPT2LMHeadModel", "dense", rules=GPT2_RULES,
                      validate=validate_gpt2, tensor_parallel=tensor_parallel))
