"""Mixtral: Mistral with a sparse MoE block (top-k of E experts) in place of every MLP.

Shape legend: as plugins/llama.py (T tokens, H hidden) and zoo/layers/moe.py (E experts, K top-k).

Checkpoint layouts served (both load into `mlp.experts.gate_up_proj.weight [E, 2I, H]` and
`mlp.experts.down_proj.weight [E, H, I]`):
    hub (per expert)        model.layers.{i}.block_sparse_moe.experts.{e}.w1/w3/w2.weight (w1 gate, w3 up, w2 down)
                            model.layers.{i}.block_sparse_moe.gate.weight
    transformers v5 fused   model.layers.{i}.mlp.experts.gate_up_proj / down_proj (save_original_format=False)
Module names are transformers' in-memory names (`mlp`, `mlp.gate`, `mlp.experts`), so parity taps join.
"""
from __future__ import annotations

from loader.rules import Rename, Rules, Shard, Stack
from plugins.llama import LLAMA_RULES, tensor_parallel as dense_tensor_parallel, validate
from plugins.mistral import MistralDecoderLayer, MistralForCausalLM, MistralModel
from registry import ArchSpec, hookimpl
from zoo.layers.moe import SparseMoeBlock

# Per-expert keys are stacked into row e, gate/up fused along each row's dim 0 (llama's Fuse rule);
# the fused layout transformers v5 writes only lacks the `.weight` suffix.
MOE_RULES = Rules(
    renames=(Rename(".experts.gate_up_proj", ".experts.gate_up_proj.weight"),
             Rename(".experts.down_proj", ".experts.down_proj.weight")),
    stacks=(Stack("experts"),),
)
MIXTRAL_RULES = LLAMA_RULES + Rules(renames=(
    Rename(".block_sparse_moe.", ".mlp."),
    Rename(".w1.", ".gate_proj."),
    Rename(".w3.", ".up_proj."),
    Rename(".w2.", ".down_proj."),
)) + MOE_RULES


class MixtralDecoderLayer(MistralDecoderLayer):
    def make_mlp(self, config, layer_idx: int, prefix: str):
        # diff with Mistral: a sparse MoE block; top-k weights always renormalised, kept in float32
        return SparseMoeBlock(hidden_size=config.hidden_size, num_experts=config.num_local_experts,
                              top_k=config.num_experts_per_tok, intermediate_size=config.intermediate_size,
                              hidden_act=config.hidden_act, renormalize=True, weights_in_input_dtype=False,
                              prefix=prefix)


class MixtralModel(MistralModel):
    layer_class = MixtralDecoderLayer


class MixtralForCausalLM(MistralForCausalLM):
    model_class = MixtralModel


def tensor_parallel(config, size: int):
    """Llama's split, each expert split by its intermediate size: w1 / w3 column-parallel, w2 row-parallel (the
    MoE block's output summed over the ranks once); the router is replicated."""
    return dense_tensor_parallel(config, size, shards=(Shard(r"\.experts\.\d+\.(w1|w3)\.weight$", "column"),
                                                       Shard(r"\.experts\.\d+\.w2\.weight$", "row")))


def validate_moe(config, experts_field: str = "num_experts") -> None:
    """The dense checks, plus the routing fields (raise ValueError naming the field)."""
    validate(config)
    experts, top_k = getattr(config, experts_field), config.num_experts_per_tok
    if not 0 < top_k <= experts:
        raise ValueError(f"config.num_experts_per_tok={top_k} must be in 1..{experts_field}={experts}")


@hookimpl
def register_architectures(register):
    register(ArchSpec(("MixtralForCausalLM",), "plugins.mixtral:MixtralForCausalLM", "moe", rules=MIXTRAL_RULES,
                      validate=validate_moe, tensor_parallel=tensor_parallel))
