"""The hooks a zoo plugin can implement. Every hook here is documented in README.md's plugin section,
and a test fails if the two disagree."""
from __future__ import annotations

from typing import Callable

import pluggy

from registry.spec import ArchSpec

hookspec = pluggy.HookspecMarker("zoo")
hookimpl = pluggy.HookimplMarker("zoo")


@hookspec
def register_architectures(register: Callable[[ArchSpec], None]) -> None:
    """Call ``register(ArchSpec(...))`` once for each architecture this plugin provides."""
