"""Architecture registry: HF architecture strings -> ArchSpec, filled by pluggy plugins."""
from registry.hookspecs import hookimpl, hookspec
from registry.errors import PluginError, RegistryError
from registry.manager import Registry, UnsupportedArchitecture, get_registry
from registry.spec import FAMILIES, ArchSpec

__all__ = ["ArchSpec", "FAMILIES", "PluginError", "Registry", "RegistryError", "UnsupportedArchitecture",
           "get_registry", "hookimpl", "hookspec"]
