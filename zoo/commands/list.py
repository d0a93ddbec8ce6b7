"""List the supported architectures: family, providing plugin, model class."""
from __future__ import annotations

from registry import get_registry
from zoo.table import print_table


def add_arguments(parser) -> None:
    pass


def run(args) -> int:
    reg = get_registry()
    print_table(["architecture", "family", "plugin", "model class"], reg.table())
    for name, exc in reg.failures.items():
        print(f"plugin {name!r} failed to load: {type(exc).__name__}: {exc}")
    return 0
