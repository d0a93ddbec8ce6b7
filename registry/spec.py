"""ArchSpec: what a plugin registers for one or more Hugging Face architecture strings."""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

from loader.rules import Rules

FAMILIES = ("dense", "moe", "mla", "multimodal", "hybrid-ssm")


@dataclass(frozen=True)
class ArchSpec:
    architectures: tuple[str, ...]  # e.g. ("LlamaForCausalLM",)
    model: str  # "module:Class", imported only when the architecture is used
    family: str  # one of FAMILIES
    rules: Rules = field(default_factory=Rules)
    validate: Callable[[Any], None] | None = None  # raises ValueError naming the config field at fault
    override: bool = False  # replace another plugin's claim on the same architecture
    plugin: str = ""  # filled in by the registry: the plugin that registered it

    def __post_init__(self):
        if isinstance(self.architectures, str):
            object.__setattr__(self, "architectures", (self.architectures,))
        if self.family not in FAMILIES:
            raise ValueError(f"ArchSpec {self.architectures}: family {self.family!r} is not one of {FAMILIES}")
        if ":" not in self.model:
            raise ValueError(f"ArchSpec {self.architectures}: model {self.model!r} must be 'module:Class'")

    def model_class(self) -> type:
        module, _, name = self.model.partition(":")
        return getattr(importlib.import_module(module), name)
