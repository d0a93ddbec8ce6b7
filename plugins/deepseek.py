"""DeepSeek-V2 and DeepSeek-V3: Llama's skeleton with latent attention (MLA) and DeepSeek MoE.

Shape legend:
    T = tokens of the step (flattened)    H = hidden size    V = vocab    N = rows sampled

Layer i's feed-forward is DeepSeek MoE (group-limited routing, stacked experts, shared experts) when
i >= first_k_dense_replace and i % moe_layer_freq == 0 (the rule of DeepSeek's own code; transformers
has no moe_layer_freq and every released checkpoint sets it to 1), else a dense gated MLP.
V2 and V3 differ in routing and rotary layout only:
    V2: softmax scores, topk_method greedy | group_limited_greedy; rope always rotates adjacent pairs.
    V3: sigmoid scores + e_score_correction_bias (noaux_tc), norm_topk_prob; config.rope_interleave.
"""
from __future__ import annotations

from torch import nn

from loader.rules import Fuse, Ignore, Rules, Shard, Stack
from plugins.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, split_config
from registry import ArchSpec, hookimpl
from zoo.layers.deepseek_moe import DeepseekMoE, GroupLimitedRouter
from zoo.layers.mla import MLAttention, mla_softmax_scale
from zoo.layers.mlp import GatedMLP, activation
from zoo.layers.moe import StackedExperts
from zoo.layers.rotary import ROPE_TYPES, get_rope, rope_parameters


def is_moe_layer(config, layer_idx: int) -> bool:
    return (bool(getattr(config, "n_routed_experts", None)) and layer_idx >= (config.first_k_dense_replace or 0)
            and layer_idx % (getattr(config, "moe_layer_freq", None) or 1) == 0)


class DeepseekV2DecoderLayer(LlamaDecoderLayer):
    attention_class = MLAttention  # diff with Llama: latent attention with a latent cache

    def attention_kwargs(self, config, layer_idx: int) -> dict:
        rope = rope_parameters(config)
        return dict(
            hidden_size=config.hidden_size, num_heads=config.num_attention_heads, q_lora_rank=config.q_lora_rank,
            kv_lora_rank=config.kv_lora_rank, qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim,
            rope=get_rope(head_dim=config.qk_rope_head_dim, rope_parameters=rope,
                          max_position_embeddings=config.max_position_embeddings),
            scale=mla_softmax_scale(config.qk_nope_head_dim + config.qk_rope_head_dim, rope),
            rope_interleave=self.rope_interleave(config), attention_bias=config.attention_bias)

    def rope_interleave(self, config) -> bool:
        return True  # V2 rotates (x0, x1), (x2, x3), ... as complex numbers

    def make_mlp(self, config, layer_idx: int, prefix: str) -> nn.Module:
        # diff with Llama: DeepSeek MoE past the first dense layers
        bias = getattr(config, "mlp_bias", False)
        if not is_moe_layer(config, layer_idx):
            return GatedMLP(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                            hidden_act=config.hidden_act, bias=bias, prefix=prefix)
        shared = None
        if getattr(config, "n_shared_experts", None):
            shared = GatedMLP(hidden_size=config.hidden_size,
                              intermediate_size=config.moe_intermediate_size * config.n_shared_experts,
                              hidden_act=config.hidden_act, bias=bias, prefix=f"{prefix}.shared_experts")
        experts = StackedExperts(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size,
                                 hidden_act=config.hidden_act, prefix=f"{prefix}.experts")
        return DeepseekMoE(gate=self.router(config, f"{prefix}.gate"), experts=experts, shared_experts=shared,
                           prefix=prefix)

    def router(self, config, prefix: str) -> GroupLimitedRouter:
        # transformers' V2 router never renormalises the kept weights, whatever norm_topk_prob says
        return GroupLimitedRouter(
            config.hidden_size, config.n_routed_experts, config.num_experts_per_tok,
            topk_method=config.topk_method or "greedy", n_group=config.n_group, topk_group=config.topk_group,
            norm_topk_prob=False, routed_scaling_factor=config.routed_scaling_factor, prefix=prefix)


class DeepseekV3DecoderLayer(DeepseekV2DecoderLayer):
    def rope_interleave(self, config) -> bool:
        return bool(getattr(config, "rope_interleave", True))  # diff with V2: the config picks the layout

    def router(self, config, prefix: str) -> GroupLimitedRouter:
        # diff with V2: sigmoid scores, a bias that steers the choice only, optional renormalisation
        return GroupLimitedRouter(
            config.hidden_size, config.n_routed_experts, config.num_experts_per_tok, topk_method="noaux_tc",
            n_group=config.n_group, topk_group=config.topk_group, norm_topk_prob=bool(config.norm_topk_prob),
            routed_scaling_factor=config.routed_scaling_factor, prefix=prefix)


class DeepseekV2Model(LlamaModel):
    layer_class = DeepseekV2DecoderLayer


class DeepseekV3Model(LlamaModel):
    layer_class = DeepseekV3DecoderLayer


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    model_class = DeepseekV2Model


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    model_class = DeepseekV3Model


def validate(config) -> None:
    """Raise ValueError naming the config field this implementation cannot serve."""
    activation(config.hidden_act, field="config.hidden_act")
    rope_type = rope_parameters(config).get("rope_type")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"config.rope_parameters: rope_type {rope_type!r} is not supported; "
                         f"supported: {', '.join(ROPE_TYPES)}")
    experts, top_k = config.n_routed_experts, config.num_experts_per_tok
    if experts is not None and not (isinstance(top_k, int) and 0 < top_k <= experts):
        raise ValueError(f"config.num_experts_per_tok={top_k!r} must be an integer in 1..n_routed_experts={experts}")
    if config.model_type == "deepseek_v2" and (config.topk_method or "greedy") not in ("greedy",
                                                                                       "group_limited_greedy"):
        raise ValueError(f"config.topk_method={config.topk_method!r}: DeepSeek-V2 routes with 'greedy' or "
                         f"'group_limited_greedy' (the routers transformers 5.24 has for V2)")


def tensor_parallel(config, size: int):
    """MLA heads split: q_proj / q_b_proj and kv_b_proj column-parallel by heads, o_proj row-parallel; the latent
    (q_a_proj, q_a_layernorm, kv_a_proj_with_mqa, kv_a_layernorm) replicated, so each rank's latent cache holds
    the whole latent (R + DR per token: the latent is shared by every head) and its absorbed decode runs its own
    heads. DeepSeek MoE: every routed and shared expert split by intermediate size (the block summed once), the
    router replicated; the dense layers' MLP as Llama's; embedding and head vocab-parallel."""
    local = split_config(config, size, ("num_attention_heads", "intermediate_size", "moe_intermediate_size"))
    return local, Rules(shards=(
        Shard(r"\.(q_proj|q_b_proj|kv_b_proj|gate_proj|up_proj)\.weight$", "column"),
        Shard(r"\.(o_proj|down_proj)\.weight$", "row"),
        Shard(r"(^|\.)(embed_tokens|lm_head)\.weight$", "vocab", size=config.vocab_size),
    ))


RULES = Rules(
    fuses=(Fuse(("gate_proj", "up_proj"), "gate_up_proj"),),  # dense MLP, shared experts, each routed expert
    stacks=(Stack("experts"),),  # mlp.experts.{e}.gate_proj -> row e of mlp.experts.gate_up_proj
    ignores=(Ignore(r"(^|\.)rotary_emb\.(inv_freq|cos_cached|sin_cached)$",
                    "rotary tables that old checkpoints saved; recomputed from the config"),),
)
V3_RULES = RULES + Rules(ignores=(
    Ignore(r"^model\.layers\.61\.", "DeepSeek-V3's multi-token-prediction module (layer 61 of the 61-layer "
                                    "checkpoints, num_nextn_predict_layers); generation does not use it"),
))


@hookimpl
def register_architectures(register) -> None:
    register(ArchSpec(("DeepseekV2ForCausalLM",), "plugins.deepseek:DeepseekV2ForCausalLM", "mla", rules=RULES,
                      validate=validate, tensor_parallel=tensor_parallel))
    register(ArchSpec(("DeepseekV3ForCausalLM",), "plugins.deepseek:DeepseekV3ForCausalLM", "mla", rules=V3_RULES,
                      validate=validate, tensor_parallel=tensor_parallel))
