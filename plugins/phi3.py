"""Phi-3: Mistral (one sliding window for every layer, when set) whose checkpoint already fuses qkv_proj and
gate_up_proj, with longrope (short / long factors) and partial rotary from the shared rope table.

Shape legend: as plugins/llama.py.
"""
from __future__ import annotations

from loader.rules import Rules
from plugins.llama import LLAMA_RULES, validate
from plugins.mistral import MistralForCausalLM
from registry import ArchSpec, hookimpl

# diff with Llama's rules: no Fuse (the checkpoint holds qkv_proj and gate_up_proj as the model does)
PHI3_RULES = Rules(ignores=LLAMA_RULES.ignores)


class Phi3ForCausalLM(MistralForCausalLM):
    pass  # diff with Mistral: only the checkpoint's layout (PHI3_RULES)


@hookimpl
def register_architectures(register):
    register(ArchSpec(("Phi3ForCausalLM",), "plugins.phi3:Phi3ForCausalLM", "dense", rules=PHI3_RULES,
                      validate=validate))
