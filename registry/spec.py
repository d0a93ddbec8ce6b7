"""ArchSpec: what a plugin registers for one or more Hugging Face architecture strings."""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

from loader.rules import Rules
from registry.errors import PluginError, describe

FAMILIES = ("dense", "moe", "mla", "multimodal", "hybrid-ssm")


@dataclass(frozen=True)
class ArchSpec:
    architectures: tuple[str, ...]  # e.g. ("LlamaForCausalLM",)
    model: str  # "module:Class", imported only when the architecture is used
    family: str  # one of FAMILIES
    rules: Rules = field(default_factory=Rules)
    validate: Callable[[Any], None] | None = None  # raises ValueError naming the config field at fault
    # tensor parallelism: (config, size) -> (the rank-local config the model is built from, the Shard rules);
    # raises ValueError naming the config field that does not split. None: the architecture has no TP yet.
    tensor_parallel: Callable[[Any, int], tuple[Any, Rules]] | None = None
    no_tensor_parallel: str = ""  # without a layout: why not (said when one is asked for)
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
        """The model class, imported now; PluginError naming the plugin, the architecture and the error."""
        module, _, name = self.model.partition(":")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (Exception, SystemExit) as e:  # noqa: BLE001 - whatever a plugin's import does, it is reported
            raise PluginError(f"{self._who()}: model {self.model!r} does not import: {describe(e)}") from e
        if not isinstance(cls, type):
            raise PluginError(f"{self._who()}: model {self.model!r} is a {type(cls).__name__}, not a class")
        return cls

    def build(self, config):
        """The model class constructed for `config` (on the current default device: callers use meta);
        an exception in the constructor becomes a PluginError naming the file:line of the raise."""
        cls = self.model_class()
        try:
            return cls(config)
        except (Exception, SystemExit) as e:  # noqa: BLE001
            raise PluginError(f"{self._who()}: the model constructor {cls.__name__}(config) raised {describe(e)}"
                              ) from e

    def check(self, config) -> None:
        """The plugin's `validate(config)`, if any. Its ValueError (a config field it cannot serve) goes up as it is;
        any other exception is a bug in the plugin: a PluginError naming the file:line of the raise, as `build`."""
        if self.validate is None:
            return
        try:
            self.validate(config)
        except ValueError:
            raise
        except (Exception, SystemExit) as e:  # noqa: BLE001
            raise PluginError(f"{self._who()}: validate(config) raised {describe(e)}") from e

    def _who(self) -> str:
        return f"plugin {self.plugin or '?'!r}, architecture {self.architectures[0]!r}"
