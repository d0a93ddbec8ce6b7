"""Qwen2-MoE: Qwen2 attention (q/k/v bias from config.qkv_bias) + a sparse MoE block with a shared expert.

Shape legend: as plugins/llama.py (T tokens, H hidden) and zoo/layers/moe.py (E experts, K top-k).

Layer i is sparse when i is not in `mlp_only_layers` and (i + 1) % decoder_sparse_step == 0; the other
layers keep a dense MLP of `intermediate_size`. The MoE block adds `sigmoid(shared_expert_gate(x)) *
shared_expert(x)` (a dense MLP of `shared_expert_intermediate_size`) to the routed experts' sum.
"""
from __future__ import annotations

from functools import partial

from plugins.llama import LLAMA_RULES, tensor_parallel
from plugins.mixtral import MOE_RULES, validate_moe
from plugins.qwen2 import Qwen2DecoderLayer, Qwen2ForCausalLM, Qwen2Model
from registry import ArchSpec, hookimpl
from zoo.layers.mlp import GatedMLP
from zoo.layers.moe import SparseMoeBlock


def is_sparse(config, layer_idx: int) -> bool:
    """transformers' rule for which layers of Qwen2-MoE / Qwen3-MoE hold experts."""
    return (layer_idx not in (config.mlp_only_layers or []) and config.num_experts > 0
            and (layer_idx + 1) % config.decoder_sparse_step == 0)


class Qwen2MoeDecoderLayer(Qwen2DecoderLayer):
    def attention_kwargs(self, config, layer_idx: int) -> dict:
        # diff with Qwen2: the q/k/v bias is a config field
        return {**super().attention_kwargs(config, layer_idx), "qkv_bias": config.qkv_bias}

    def make_mlp(self, config, layer_idx: int, prefix: str):
        # diff with Qwen2: sparse layers route to experts and add a gated shared expert
        if not is_sparse(config, layer_idx):
            return super().make_mlp(config, layer_idx, prefix)
        shared = GatedMLP(hidden_size=config.hidden_size, intermediate_size=config.shared_expert_intermediate_size,
                          hidden_act=config.hidden_act, prefix=f"{prefix}.shared_expert")
        return SparseMoeBlock(hidden_size=config.hidden_size, num_experts=config.num_experts,
                              top_k=config.num_experts_per_tok, intermediate_size=config.moe_intermediate_size,
                              hidden_act=config.hidden_act, renormalize=config.norm_topk_prob,
                              shared_expert=shared, prefix=prefix)


class Qwen2MoeModel(Qwen2Model):
    layer_class = Qwen2MoeDecoderLayer


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    model_class = Qwen2MoeModel


# tensor parallelism: the dense layers', every expert's and the shared expert's intermediate sizes split (their
# gate_proj / up_proj / down_proj keys are Llama's); the router and shared_expert_gate replicated
MOE_FIELDS = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")


@hookimpl
def register_architectures(register):
    register(ArchSpec(("Qwen2MoeForCausalLM",), "plugins.qwen2_moe:Qwen2MoeForCausalLM", "moe",
                      rules=LLAMA_RULES + MOE_RULES, validate=validate_moe,
                      tensor_parallel=partial(tensor_parallel, fields=MOE_FIELDS)))
