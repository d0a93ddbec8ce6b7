"""GraniteMoE: Granite (the four multipliers) with a sparse MoE block in every layer, its experts already stacked
in the checkpoint (input_linear [E, 2I, H] = gate | up, output_linear [E, H, I]) and softmax over the top-k
router logits (equal to the renormalised top-k of the full softmax).

Shape legend: as plugins/llama.py and zoo/layers/moe.py (E experts, I expert intermediate size).
"""
from __future__ import annotations

from functools import partial

from loader.rules import Rename, Rules, Shard
from plugins.granite import GraniteDecoderLayer, GraniteForCausalLM, GraniteModel
from plugins.llama import LLAMA_RULES, tensor_parallel
from plugins.mixtral import validate_moe
from registry import ArchSpec, hookimpl
from zoo.layers.moe import SparseMoeBlock

# diff with Llama's rules: no gate/up Fuse (the checkpoint stacks and fuses the experts itself)
GRANITEMOE_RULES = Rules(fuses=LLAMA_RULES.fuses[:1], ignores=LLAMA_RULES.ignores, renames=(
    Rename(".block_sparse_moe.input_linear.", ".mlp.experts.gate_up_proj."),
    Rename(".block_sparse_moe.output_linear.", ".mlp.experts.down_proj."),
    Rename(".block_sparse_moe.router.layer.", ".mlp.gate.")))


class GraniteMoeDecoderLayer(GraniteDecoderLayer):
    def make_mlp(self, config, layer_idx: int, prefix: str):
        return SparseMoeBlock(hidden_size=config.hidden_size, num_experts=config.num_local_experts,
                              top_k=config.num_experts_per_tok, intermediate_size=config.intermediate_size,
                              hidden_act=config.hidden_act, renormalize=True, prefix=prefix)


class GraniteMoeModel(GraniteModel):
    layer_class = GraniteMoeDecoderLayer


class GraniteMoeForCausalLM(GraniteForCausalLM):
    model_class = GraniteMoeModel
    parity_taps = {"model.layers.{i}.mlp": "model.layers.{i}.block_sparse_moe",  # the reference's names
                   "model.layers.{i}.mlp.gate": "model.layers.{i}.block_sparse_moe.router"}


# tensor parallelism: Llama's attention; each expert split by intermediate size inside the checkpoint's stacks:
# input_linear [E, 2I, H] read as its gate and up halves (a fused split on dim 1), output_linear [E, H, I] by cols
# (dim 2); the block's output summed once, the router replicated
SHARDS = (Shard(r"\.input_linear\.weight$", "fused", dim=1, parts=("column", "column")),
          Shard(r"\.output_linear\.weight$", "row", dim=2))


@hookimpl
def register_architectures(register):
    register(ArchSpec(("GraniteMoeForCausalLM",), "plugins.granitemoe:GraniteMoeForCausalLM", "moe",
                      rules=GRANITEMOE_RULES, validate=partial(validate_moe, experts_field="num_local_experts"),
                      tensor_parallel=partial(tensor_parallel, shards=SHARDS)))
