"""Qwen3-MoE: Qwen3 attention (per-head q/k norm) + a sparse MoE block (no shared expert).

Shape legend: as plugins/llama.py (T tokens, H hidden) and zoo/layers/moe.py (E experts, K top-k).

Sparse layers follow Qwen2-MoE's rule (mlp_only_layers, decoder_sparse_step). A sliding window, when
config.use_sliding_window sets one, applies to every layer (transformers builds one mask for all).
"""
from __future__ import annotations

from functools import partial

from plugins.llama import LLAMA_RULES, tensor_parallel
from plugins.mixtral import MOE_RULES, validate_moe
from plugins.qwen2_moe import MOE_FIELDS, is_sparse
from plugins.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM, Qwen3Model
from registry import ArchSpec, hookimpl
from zoo.layers.moe import SparseMoeBlock


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def attention_kwargs(self, config, layer_idx: int) -> dict:
        # diff with Qwen3: one window (or none) for all layers, as in Mixtral
        return {**super().attention_kwargs(config, layer_idx), "sliding_window": config.sliding_window}

    def make_mlp(self, config, layer_idx: int, prefix: str):
        # diff with Qwen3: sparse layers route to experts
        if not is_sparse(config, layer_idx):
            return super().make_mlp(config, layer_idx, prefix)
        return SparseMoeBlock(hidden_size=config.hidden_size, num_experts=config.num_experts,
                              top_k=config.num_experts_per_tok, intermediate_size=config.moe_intermediate_size,
                              hidden_act=config.hidden_act, renormalize=config.norm_topk_prob, prefix=prefix)


class Qwen3MoeModel(Qwen3Model):
    layer_class = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    model_class = Qwen3MoeModel


@hookimpl
def register_architectures(register):
    register(ArchSpec(("Qwen3MoeForCausalLM",), "plugins.qwen3_moe:Qwen3MoeForCausalLM", "moe",
                      rules=LLAMA_RULES + MOE_RULES, validate=validate_moe,
                      tensor_parallel=partial(tensor_parallel, fields=MOE_FIELDS)))
