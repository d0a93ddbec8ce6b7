"""Jamba: the hybrid layer of plugins/bamba.py with a Mamba1 selective-scan mixer, attention without any
position encoding, and a sparse MoE feed-forward on some layers.

Shape legend: as plugins/llama.py (T tokens, H hidden) and zoo/layers/moe.py (E experts, K top-k).

Layer pattern (transformers' layers_block_type / layers_num_experts): layer i is attention iff
i % attn_layer_period == attn_layer_offset (else Mamba), and MoE iff i % expert_layer_period ==
expert_layer_offset (else a dense gated MLP). The router keeps the top k softmax scores without
renormalising them. Checkpoint layout: `model.layers.{i}.mamba.{in_proj, conv1d, x_proj, dt_proj, A_log,
D, dt_layernorm, b_layernorm, c_layernorm, out_proj}`, `feed_forward.router.weight` and per-expert
`feed_forward.experts.{e}.{gate,up,down}_proj.weight` (stacked and fused into our experts), or a dense
`feed_forward.{gate,up,down}_proj`.
"""
from __future__ import annotations

from loader.rules import Rename, Rules, Shard
from plugins.bamba import HybridDecoderLayer, HybridForCausalLM, HybridModel
from plugins.llama import LLAMA_RULES, head_dim_of, num_kv_heads_of, tensor_parallel as dense_tensor_parallel
from plugins.mixtral import MOE_RULES
from registry import ArchSpec, hookimpl
from zoo.layers.mamba import MambaMixer
from zoo.layers.moe import SparseMoeBlock

JAMBA_RULES = LLAMA_RULES + Rules(renames=(Rename(".feed_forward.router.", ".feed_forward.gate."),)) + MOE_RULES


class JambaDecoderLayer(HybridDecoderLayer):
    def attention_kwargs(self, config, layer_idx: int) -> dict:
        # diff with Llama: no rotary, no biases, head_dim = hidden / heads (a rank-local config's is set)
        return dict(hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
                    num_kv_heads=num_kv_heads_of(config), head_dim=head_dim_of(config), rope=None)

    def make_mixer(self, config, layer_idx: int, prefix: str):
        # diff with Bamba: Mamba1's selective scan, with RMS norms on dt, B and C
        return MambaMixer(hidden_size=config.hidden_size, intermediate_size=mamba_channels(config),
                          state_size=config.mamba_d_state, conv_kernel=config.mamba_d_conv,
                          dt_rank=config.mamba_dt_rank, norm_eps=config.rms_norm_eps,
                          use_bias=config.mamba_proj_bias, use_conv_bias=config.mamba_conv_bias, prefix=prefix)

    def make_mlp(self, config, layer_idx: int, prefix: str):
        if config.layers_num_experts[layer_idx] == 1:
            return super().make_mlp(config, layer_idx, prefix)
        # diff with Bamba: a sparse MoE block; top-k softmax weights not renormalised, in the input's dtype
        return SparseMoeBlock(hidden_size=config.hidden_size, num_experts=config.num_experts,
                              top_k=config.num_experts_per_tok, intermediate_size=config.intermediate_size,
                              hidden_act=config.hidden_act, renormalize=False, weights_in_input_dtype=True,
                              prefix=prefix)


class JambaModel(HybridModel):
    layer_class = JambaDecoderLayer


class JambaForCausalLM(HybridForCausalLM):
    model_class = JambaModel
    parity_taps = {"model.layers.{i}.feed_forward.gate": "model.layers.{i}.feed_forward.router"}  # for parity


def validate(config) -> None:
    heads, kv = config.num_attention_heads, num_kv_heads_of(config)
    if heads % kv:
        raise ValueError(f"config.num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    if config.hidden_act != "silu":
        raise ValueError(f"config.hidden_act={config.hidden_act!r}: the mixer's conv activation must be 'silu'")
    if not 0 < config.num_experts_per_tok <= config.num_experts:
        raise ValueError(f"config.num_experts_per_tok={config.num_experts_per_tok} must be in "
                         f"1..num_experts={config.num_experts}")


def mamba_channels(config) -> int:
    """The mixer's inner channels I: mamba_expand x hidden_size (a rank-local config's share: mamba_channels)."""
    return getattr(config, "mamba_channels", None) or config.mamba_expand * config.hidden_size


# tensor parallelism: the Mamba1 mixers by inner channels, as vLLM splits them: in_proj's x and z halves, conv1d,
# dt_proj (weight and bias), A_log and D by channels; x_proj row-parallel (dt, B and C sum over every channel: its
# output all-reduced, so the dt / B / C norms, replicated, see them whole), out_proj row-parallel
MAMBA1_SHARDS = (Shard(r"\.mamba\.in_proj\.(weight|bias)$", "fused", parts=("column", "column")),
                 Shard(r"\.mamba\.(conv1d\.(weight|bias)|dt_proj\.(weight|bias)|A_log|D)$", "column"),
                 Shard(r"\.mamba\.(x_proj|out_proj)\.weight$", "row"))


def tensor_parallel(config, size: int):
    """Llama's split for the attention layers and the MLPs and experts (each expert by intermediate size, the router
    replicated), MAMBA1_SHARDS for the mixers; each rank's state slots hold its channels' conv and SSM states."""
    channels = mamba_channels(config)
    if channels % size:
        raise ValueError(f"config.mamba_expand x hidden_size = {channels} Mamba channels do not split over tensor "
                         f"parallel size {size}")
    local, rules = dense_tensor_parallel(config, size)
    local.mamba_channels = channels // size
    return local, Rules(shards=MAMBA1_SHARDS) + rules


@hookimpl
def register_architectures(register):
    register(ArchSpec(("JambaForCausalLM",), "plugins.jamba:JambaForCausalLM", "hybrid-ssm", rules=JAMBA_RULES,
                      validate=validate, tensor_parallel=tensor_parallel))
