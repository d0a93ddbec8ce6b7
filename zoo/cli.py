"""`zoo`: the command line. Each subcommand is a module with `add_arguments(parser)` and `run(args) -> int`.

Built-in: run, list, inspect. Other packages add subcommands through the entry-point group
"zoo.commands" (that is how `zoo parity` arrives without `zoo` importing `parity`). Only the chosen
subcommand's module is imported, so `zoo run` does not pay for the others.
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
        commands.setdefault(ep.name, (ep.value, None))  # help: the module docstring's first line
    return commands


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    commands = _commands()
    parser = argparse.ArgumentParser(prog="zoo", description="A plugin-based LLM model zoo.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    module = None
    for name, (path, help_) in commands.items():
        if help_ is None and chosen in (None, "-h", "--help"):
            help_ = (importlib.import_module(path).__doc__ or path).strip().splitlines()[0]
        p = sub.add_parser(name, help=help_)
        if name == chosen:
            module = importlib.import_module(path)
            module.add_arguments(p)
    args = parser.parse_args(argv)
    if module is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
