"""Phi-3: Mistral (one sliding window for every layer, when set) whose checkpoint already fuses qkv_proj and
gate_up_proj, with longrope (short / long factors) and partial rotary from the shared rope table.

Shape legend: as plugins/llama.py.
"""
from __future__ import annotations

from loader.rules import Rules, Shard
from plugins.llama import LLAMA_RULES, num_kv_heads_of, tensor_parallel as dense_tensor_parallel, validate
from plugins.mistral import MistralForCausalLM
from registry import ArchSpec, hookimpl

# diff with Llama's rules: no Fuse (the checkpoint holds qkv_proj and gate_up_proj as the model does)
PHI3_RULES = Rules(ignores=LLAMA_RULES.ignores)


class Phi3ForCausalLM(MistralForCausalLM):
    pass  # diff with Mistral: only the checkpoint's layout (PHI3_RULES)


def tensor_parallel(config, size: int):
    """Llama's split, the checkpoint's fused tensors read part by part: qkv_proj's q rows by heads and k / v rows by
    KV heads, gate_up_proj's gate and up halves, each rank its part of each."""
    return dense_tensor_parallel(config, size, shards=(
        Shard(r"\.qkv_proj\.weight$", "fused", parts=("column", "kv", "kv"), heads=num_kv_heads_of(config)),
        Shard(r"\.gate_up_proj\.weight$", "fused", parts=("column", "column"))))


@hookimpl
def register_architectures(register):
    register(ArchSpec(("Phi3ForCausalLM",), "plugins.phi3:Phi3ForCausalLM", "dense", rules=PHI3_RULES,
                      validate=validate, tensor_parallel=tensor_parallel))
