"""GPT-NeoX (Pythia): biased LayerNorms, a fused query_key_value whose heads are interleaved in the checkpoint
(rearranged by a Transform rule as it loads), partial rotary, a plain GELU MLP, and by default the parallel
residual x + attn(ln1(x)) + mlp(ln2(x)).

Shape legend: as plugins/llama.py (T tokens, H hidden).
Checkpoint names (gpt_neox.layers.{i}.attention.query_key_value, embed_out, ...) are renamed onto Llama's.
"""
from __future__ import annotations

from functools import partial

import torch

from loader.rules import Ignore, Rename, Rules, Shard, Transform
from plugins.llama import (LLAMA_RULES, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, head_dim_of, tensor_parallel,
                           validate)
from registry import ArchSpec, hookimpl
from zoo.layers.mlp import MLP
from zoo.layers.norm import LayerNorm
from zoo.runtime.batch import ForwardBatch

NEOX_RULES = Rules(
    renames=tuple(Rename(a, b) for a, b in (
        ("gpt_neox.embed_in.", "model.embed_tokens."), ("gpt_neox.layers.", "model.layers."),
        ("gpt_neox.final_layer_norm.", "model.norm."), ("embed_out.", "lm_head."),
        (".attention.query_key_value.", ".self_attn.qkv_proj."), (".attention.dense.", ".self_attn.o_proj."))),
    ignores=LLAMA_RULES.ignores + (Ignore(r"\.attention\.(bias|masked_bias)$", "causal-mask buffers of old "
                                                                              "checkpoints; the runtime masks"),))


class GPTNeoXNorms:
    norm_class = LayerNorm  # diff with Llama: LayerNorm with a bias

    def norm_eps(self, config) -> float:
        return config.layer_norm_eps


class GPTNeoXDecoderLayer(GPTNeoXNorms, LlamaDecoderLayer):
    def __init__(self, config, layer_idx: int, *, prefix: str):
        super().__init__(config, layer_idx, prefix=prefix)
        self.parallel = config.use_parallel_residual

    def attention_kwargs(self, config, layer_idx: int) -> dict:
        bias = config.attention_bias  # diff with Llama: no GQA (num_key_value_heads is not read)
        return {**super().attention_kwargs(config, layer_idx), "qkv_bias": bias, "o_bias": bias,
                "num_kv_heads": config.num_attention_heads}

    def make_mlp(self, config, layer_idx: int, prefix: str):
        return MLP(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                   hidden_act=config.hidden_act, names=("dense_h_to_4h", "dense_4h_to_h"), prefix=prefix)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if not self.parallel:
            return super().forward(positions, hidden_states, batch)
        # diff with Llama: attention and MLP read the same x, each through its own norm
        h = self.self_attn(positions, self.input_layernorm(hidden_states), batch)  # [T, H]
        return self.mlp(self.post_attention_layernorm(hidden_states)) + h + hidden_states  # [T, H]


class GPTNeoXModel(GPTNeoXNorms, LlamaModel):
    layer_class = GPTNeoXDecoderLayer


class GPTNeoXForCausalLM(LlamaForCausalLM):
    model_class = GPTNeoXModel
    # the reference's module names, for parity (the zoo's are Llama's)
    parity_taps = {"model.embed_tokens": "gpt_neox.embed_in", "model.norm": "gpt_neox.final_layer_norm",
                   "model.layers.{i}.self_attn": "gpt_neox.layers.{i}.attention",
                   **{f"model.layers.{{i}}{s}": f"gpt_neox.layers.{{i}}{s}"
                      for s in ("", ".input_layernorm", ".post_attention_layernorm", ".mlp")}}

    def __init__(self, config, *, prefix: str = ""):
        super().__init__(config, prefix=prefix)
        # heads interleaved in query_key_value: [heads, (q, k, v), D] rows
        self.load_rules = Rules(transforms=(Transform(r"\.attention\.query_key_value\.(weight|bias)$",
                                                      "interleave", parts=3, head_dim=head_dim_of(config)),))


# tensor parallelism: Llama's under the checkpoint's names. query_key_value (and its bias) column-parallel on its
# rows as they are: [heads, (q, k, v), D], so a rank's heads are one run of rows, rearranged after the read;
# dense_h_to_4h column, dense (o_proj) and dense_4h_to_h row (biases added once); embed_in / embed_out by vocab
SHARDS = (Shard(r"\.(query_key_value|dense_h_to_4h)\.(weight|bias)$", "column"),
          Shard(r"\.(dense|dense_4h_to_h)\.weight$", "row"))


@hookimpl
def register_architectures(register):
    register(ArchSpec(("GPTNeoXForCausalLM",), "plugins.gpt_neox:GPTNeoXForCausalLM", "dense", rules=NEOX_RULES,
                      validate=validate,
                      tensor_parallel=partial(tensor_parallel, shards=SHARDS, vocab_keys=("embed_in", "embed_out"))))
