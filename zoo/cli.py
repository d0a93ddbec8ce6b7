"""`zoo`: the command line. Each subcommand is a module with `add_arguments(parser)` and `run(args) -> int`.

Built-in: run, list, inspect. Other packages add subcommands through the entry-point group
"zoo.commands" (that is how `zoo parity` arrives without `zoo` importing `parity`).
Exit status: 0 success, 1 a finding (divergence, strictness failure), 2 usage or environment error.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys

BUILTIN = {
    "run": ("zoo.commands.run", "generate text from a model (no MODEL: the embedded default)"),
    "list": ("zoo.commands.list", "list the supported architectures"),
    "inspect": ("zoo.commands.inspect", "show the loader's plan for a checkpoint, from headers only"),
}


def _commands() -> dict[str, tuple[str, str]]:
    commands = dict(BUILTIN)
    for ep in importlib.metadata.entry_points(group="zoo.commands"):
        commands.setdefault(ep.name, (ep.value, f"(from {ep.value})"))
    return commands


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zoo", description="A plugin-based LLM model zoo.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules = {}
    for name, (module, help_) in _commands().items():
        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=(mod.__doc__ or help_).strip().splitlines()[0])
        mod.add_arguments(p)
        modules[name] = mod
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(modules[args.command].run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
