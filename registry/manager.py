"""The plugin manager: built-in plugins, entry points of group "zoo", and the architecture table."""
from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
from pathlib import Path
from types import ModuleType

import pluggy

from registry import hookspecs
from registry.errors import PluginError, RegistryError, describe
from registry.spec import ArchSpec

BUILTIN_PLUGINS = (
    "plugins.llama",
    "plugins.mistral",
    "plugins.qwen2",
    "plugins.qwen3",
    "plugins.gemma3",
    "plugins.mixtral",
    "plugins.qwen2_moe",
    "plugins.qwen3_moe",
    "plugins.olmoe",
    "plugins.llava",
    "plugins.qwen2_vl",
    "plugins.deepseek",
    "plugins.mamba2",
    "plugins.bamba",
    "plugins.jamba",
    # issue 16's architectures (docs/plugins.md: each through the hook a third party uses)
    "plugins.gemma",
    "plugins.gemma2",
    "plugins.phi3",
    "plugins.olmo2",
    "plugins.granite",
    "plugins.smollm3",
    "plugins.starcoder2",
    "plugins.stablelm",
    "plugins.cohere",
    "plugins.phi",
    "plugins.gpt_neox",
    "plugins.gpt2",
    "plugins.granitemoe",
    "plugins.gpt_oss",
)
ENTRY_POINT_GROUP = "zoo"


class UnsupportedArchitecture(LookupError):
    def __init__(self, message: str, failures: dict[str, BaseException]):
        super().__init__(message)
        self.failures = failures


class Registry:
    def __init__(self, *, builtins: bool = True, entry_points: bool = True):
        self.pm = pluggy.PluginManager("zoo")
        self.pm.add_hookspecs(hookspecs)
        self.specs: dict[str, ArchSpec] = {}  # architecture -> the spec that serves it
        self._by_plugin: dict[str, list[ArchSpec]] = {}  # in registration order
        self.failures: dict[str, BaseException] = {}  # plugin name -> the exception that stopped it
        self.conflicts: dict[str, str] = {}  # architecture -> why it is ambiguous (two plugins claim it)
        if builtins:
            for name in BUILTIN_PLUGINS:
                self._import_and_register(name)
        if entry_points:
            self._load_entry_points()

    # -- plugins ---------------------------------------------------------------------------------
    def register_plugin(self, plugin: ModuleType | object, name: str | None = None) -> None:
        """Register a plugin object (a module or any object with hookimpls) and collect its specs.

        Raises RegistryError (a misspelt hook, a bad spec, a conflicting claim, an exception inside the
        hook); the registry is then exactly as it was before the call.
        """
        name = name or getattr(plugin, "__name__", None) or type(plugin).__name__
        new: list[ArchSpec] = []

        def register(spec: ArchSpec) -> None:
            if not isinstance(spec, ArchSpec):
                raise RegistryError(f"plugin {name!r} registered {spec!r}, which is not an ArchSpec")
            new.append(ArchSpec(**{**spec.__dict__, "plugin": name}))

        try:
            self.pm.register(plugin, name=name)
            self.pm.check_pending()  # a misspelt hook name fails here, loudly
            impl = getattr(plugin, "register_architectures", None)
            if impl is not None:
                impl(register=register)
            self.specs = _table({**self._by_plugin, name: new})
        except (Exception, SystemExit) as e:  # noqa: BLE001 - a plugin calling sys.exit spoils nothing either
            if self.pm.get_plugin(name) is not None:
                self.pm.unregister(name=name)
            if isinstance(e, RegistryError):
                raise
            raise RegistryError(f"plugin {name!r}: {describe(e)}") from e
        self._by_plugin[name] = new

    def unregister_plugin(self, name: str) -> None:
        """Remove a plugin and its architectures (what an override had shadowed comes back)."""
        self.pm.unregister(name=name)
        self._by_plugin.pop(name, None)
        self.specs = _table(self._by_plugin)

    def _import_and_register(self, module: str, name: str | None = None) -> None:
        self._load(name or module, lambda: importlib.import_module(module))

    def _load_entry_points(self) -> None:
        allowed = allowed_plugins()
        eps = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        for ep in eps:
            if allowed is None or ep.name in allowed:
                self._load(ep.name, ep.load)
        for name in unknown_plugins(allowed, eps):
            self.failures[name] = LookupError(unknown_plugin_message(name, eps))

    def _load(self, name: str, importer) -> None:
        """Import and register one plugin; a failure is kept (and shown by `zoo list` and by the error
        for an architecture that is missing), never raised, so one broken plugin spoils nothing else.
        A plugin calling sys.exit while it imports is such a failure too."""
        try:
            self.register_plugin(importer(), name=name)
        except (Exception, SystemExit) as e:  # noqa: BLE001
            self.failures[name] = e.__cause__ if isinstance(e, RegistryError) and e.__cause__ else e
            for arch in getattr(e, "conflicts", ()):
                self.conflicts[arch] = str(e)

    # -- lookup ----------------------------------------------------------------------------------
    def get(self, architecture: str) -> ArchSpec:
        if architecture in self.conflicts:  # ambiguous: neither claim is served until one overrides
            raise UnsupportedArchitecture(self.conflicts[architecture], dict(self.failures))
        spec = self.specs.get(architecture)
        if spec is not None:
            return spec
        raise UnsupportedArchitecture(self._unsupported_message([architecture]), dict(self.failures))

    def resolve(self, config) -> ArchSpec:
        """The spec for a config (a dict, a path to config.json or a directory, or a transformers config).

        `architectures` is tried in order; without it, the model_type's `<Type>ForCausalLM` spelling
        and any spec whose architecture lower-cases to the model_type are tried.
        """
        cfg = _as_dict(config)
        archs = list(cfg.get("architectures") or [])
        for arch in archs:
            if arch in self.specs or arch in self.conflicts:
                return self.get(arch)
        model_type = str(cfg.get("model_type") or "")
        if not archs and model_type:
            # a text config of a multimodal family (Gemma3's GGUF: gemma3_text) names the family's text model
            wanted_type = model_type.removesuffix("_text").replace("_", "").lower()
            for arch, spec in self.specs.items():
                base = arch.removesuffix("ForCausalLM").removesuffix("ForConditionalGeneration").removesuffix(
                    "LMHeadModel")
                if base.lower() == wanted_type:
                    return spec
        wanted = archs or [f"model_type={model_type!r}" if model_type else "(config names no architecture)"]
        raise UnsupportedArchitecture(self._unsupported_message(wanted), dict(self.failures))

    def _unsupported_message(self, wanted: list[str]) -> str:
        """One line: what was asked, what is served, what is not because two plugins claim it, and every plugin that
        failed to load (it may have served it; a conflict's names both plugins)."""
        served = sorted(a for a in self.specs if a not in self.conflicts)
        parts = [f"unsupported architecture {', '.join(wanted)}; supported: {', '.join(served)}"]
        if self.conflicts:
            parts.append(f"in conflict, so not served: {', '.join(sorted(self.conflicts))}")
        parts += [f"plugin {name!r} failed to load: {describe(exc)}" for name, exc in self.failures.items()]
        return "; ".join(parts)

    def status(self, architecture: str) -> tuple[str, str | None]:
        """('ok' | 'conflict' | 'import error', the one-line detail or None) for a registered architecture; imports
        its model class (`zoo list` shows this)."""
        if architecture in self.conflicts:
            return "conflict", self.conflicts[architecture]
        try:
            self.specs[architecture].model_class()
        except PluginError as e:
            return "import error", str(e)
        return "ok", None

    def table(self) -> list[tuple[str, str, str, str]]:
        """(architecture, family, plugin, model class) rows, sorted by architecture."""
        return [(a, s.family, s.plugin, s.model) for a, s in sorted(self.specs.items())]


def allowed_plugins() -> set[str] | None:
    """The entry-point plugins ZOO_PLUGINS=a,b allows (None: all of them)."""
    allow = os.environ.get("ZOO_PLUGINS")
    return None if allow is None else {p.strip() for p in allow.split(",") if p.strip()}


def unknown_plugins(allowed: set[str] | None, eps=None) -> list[str]:
    """Names in ZOO_PLUGINS that no installed entry point of group "zoo" has."""
    eps = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP) if eps is None else eps
    return sorted((allowed or set()) - {ep.name for ep in eps})


def unknown_plugin_message(name: str, eps=None) -> str:
    eps = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP) if eps is None else eps
    installed = ", ".join(sorted({ep.name for ep in eps})) or "none"
    return (f"ZOO_PLUGINS names {name!r}, but no installed package has an entry point {name!r} in group "
            f"{ENTRY_POINT_GROUP!r} (installed: {installed})")


def _table(by_plugin: dict[str, list[ArchSpec]]) -> dict[str, ArchSpec]:
    """Architecture -> spec. Two claims on one architecture are an error unless one overrides."""
    table: dict[str, ArchSpec] = {}
    for specs in by_plugin.values():
        for spec in specs:
            for arch in spec.architectures:
                old = table.get(arch)
                if old is None or (spec.override and not old.override):
                    table[arch] = spec
                elif not old.override or spec.override:
                    raise RegistryError(
                        f"architecture {arch!r} is claimed by two plugins: {old.plugin!r} and {spec.plugin!r}, so "
                        f"neither serves it; to resolve, set override=True in the ArchSpec of the one that should "
                        f"serve it, or uninstall one (ZOO_PLUGINS=a,b loads only the entry-point plugins named)",
                        conflicts=(arch,),
                    )
    return table


def _as_dict(config) -> dict:
    if isinstance(config, dict):
        return config
    if isinstance(config, (str, Path)):
        p = Path(config)
        p = p / "config.json" if p.is_dir() else p
        with open(p) as f:
            return json.load(f)
    if hasattr(config, "to_dict"):
        return config.to_dict()
    return dict(vars(config))


_default: Registry | None = None


def get_registry() -> Registry:
    """The process-wide registry: built-ins plus allowed entry points, built on first use."""
    global _default
    if _default is None:
        _default = Registry()
    return _default
