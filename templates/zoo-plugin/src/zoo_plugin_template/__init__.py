"""A template zoo plugin: `TemplateLlamaForCausalLM`, served by the zoo's Llama classes.

Replace the architecture string with yours and override the hooks that differ (docs/plugins.md, section 4),
each with a one-line "# diff with Llama: ..." comment; keep the ones you do not need out of the file.

Shape legend: as the zoo's plugins/llama.py (T tokens, H hidden).
"""
from __future__ import annotations

from plugins.llama import LLAMA_RULES, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, validate
from registry import ArchSpec, hookimpl

ARCHITECTURE = "TemplateLlamaForCausalLM"


class TemplateDecoderLayer(LlamaDecoderLayer):
    def attention_kwargs(self, config, layer_idx: int) -> dict:
        # diff with Llama: (none yet) e.g. {**super().attention_kwargs(config, layer_idx), "sliding_window": 4096}
        return super().attention_kwargs(config, layer_idx)


class TemplateModel(LlamaModel):
    layer_class = TemplateDecoderLayer


class TemplateLlamaForCausalLM(LlamaForCausalLM):
    model_class = TemplateModel


@hookimpl
def register_architectures(register):
    register(ArchSpec((ARCHITECTURE,), "zoo_plugin_template:TemplateLlamaForCausalLM", "dense", rules=LLAMA_RULES,
                      validate=validate))
