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
import os
import sys

BUILTIN = {
    "run": ("zoo.commands.run", "generate text from a model (no MODEL: the embedded default)"),
    "serve": ("zoo.commands.serve", "serve a model over an OpenAI-compatible HTTP API"),
    "list": ("zoo.commands.list", "list the supported architectures"),
    "inspect": ("zoo.commands.inspect", "show the loader's plan for a checkpoint, from headers only"),
}


def _commands() -> dict[str, tuple[object, str | None]]:
    """name -> (module path of a built-in, or the entry point of another package; its help or None)."""
    commands: dict[str, tuple[object, str | None]] = dict(BUILTIN)
    for ep in importlib.metadata.entry_points(group="zoo.commands"):
        commands.setdefault(ep.name, (ep, None))  # help: the module docstring's first line
    return commands


class CommandError(Exception):
    def __init__(self, name: str, target, why: str):
        super().__init__(f"command {name!r} (entry point {target.name} = {target.value} in group zoo.commands) {why}")
        self.why = why


def _import(name: str, target) -> object:
    """The command's module (an entry point's object); CommandError, one line, for one that does not load."""
    if isinstance(target, str):
        return importlib.import_module(target)
    try:
        module = target.load()
    except (Exception, SystemExit) as e:  # noqa: BLE001 - another package's command must not take zoo down
        from registry.errors import describe

        raise CommandError(name, target, f"does not load: {describe(e)}") from None
    missing = [f"{f}()" for f in ("add_arguments", "run") if not callable(getattr(module, f, None))]
    if missing:
        raise CommandError(name, target, f"has no {' or '.join(missing)}")
    return module


def _warn_unknown_plugins() -> None:
    """ZOO_PLUGINS naming a plugin no installed package provides is said, not silently ignored."""
    if os.environ.get("ZOO_PLUGINS") is None:
        return
    from registry.manager import allowed_plugins, unknown_plugin_message, unknown_plugins

    for name in unknown_plugins(allowed_plugins()):
        print(f"zoo: warning: {unknown_plugin_message(name)}", file=sys.stderr)


def _version() -> str:
    try:
        return importlib.metadata.version("zoo")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    commands = _commands()
    parser = argparse.ArgumentParser(prog="zoo", description="A plugin-based LLM model zoo.")
    parser.add_argument("--version", action="version", version=f"zoo {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    module = None
    for name, (target, help_) in commands.items():
        if help_ is None and chosen in (None, "-h", "--help"):
            try:
                help_ = (_import(name, target).__doc__ or target.value).strip().splitlines()[0]
            except CommandError as e:
                help_ = f"(broken: {e.why})"
        p = sub.add_parser(name, help=help_)
        if name == chosen:
            try:
                module = _import(name, target)
            except CommandError as e:
                print(f"zoo: error: {e}", file=sys.stderr)
                return 2
            module.add_arguments(p)
    args = parser.parse_args(argv)
    if module is None:
        parser.print_help(sys.stderr)
        return 2
    _warn_unknown_plugins()
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
