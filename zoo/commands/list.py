"""List the supported architectures: family, providing plugin, model class, and whether it can be used."""
from __future__ import annotations

from registry import get_registry
from registry.errors import describe
from zoo.table import print_table


def add_arguments(parser) -> None:
    pass


def run(args) -> int:
    """Status 'ok', 'import error' (the model class does not import) or 'conflict' (two plugins claim it, neither
    serves it), with one line each below the table; then the plugins that failed to load at all."""
    reg = get_registry()
    rows, notes = [], []
    for arch, family, plugin, model in reg.table():
        status, detail = reg.status(arch)
        rows.append((arch, family, plugin, model, status))
        if detail:
            notes.append(f"{status}: {detail}")
    for arch in sorted(set(reg.conflicts) - set(reg.specs)):  # claimed only by plugins that both failed
        rows.append((arch, "-", "-", "-", "conflict"))
        notes.append(f"conflict: {reg.conflicts[arch]}")
    print_table(["architecture", "family", "plugin", "model class", "status"], rows)
    for note in notes:
        print(note)
    for name, exc in reg.failures.items():
        print(f"plugin {name!r} failed to load: {describe(exc)}")
    return 0
