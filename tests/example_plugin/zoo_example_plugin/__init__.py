"""An example third-party zoo plugin: one module, one entry point (see its .dist-info).

It serves "ExampleLlamaForCausalLM" with the built-in Llama layers and rules.
"""
from plugins.llama import LLAMA_RULES, LlamaForCausalLM
from registry import ArchSpec, hookimpl


class ExampleLlamaForCausalLM(LlamaForCausalLM):
    pass


@hookimpl
def register_architectures(register):
    register(ArchSpec(
        architectures=("ExampleLlamaForCausalLM",),
        model="zoo_example_plugin:ExampleLlamaForCausalLM",
        family="dense",
        rules=LLAMA_RULES,
    ))
