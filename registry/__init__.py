"""Architecture registry: HF architecture strings -> ArchSpec, filled by pluggy plugins."""
from registry.hookspecs import hookimpl, hookspec
from registry.manager import Registry, RegistryError, UnsupportedArchitecture, get_registry
from registry.spec import FAMILIES, ArchSpec

__all__ = ["ArchSpec", "FAMILIES", "Registry", "RegistryError", "UnsupportedArchitecture",
           "get_registry", "hookimpl", "hookspec"]
