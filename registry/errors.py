"""The registry's errors, and `describe`: an exception from a plugin as one line with where it was raised."""
from __future__ import annotations

import os
import traceback


class RegistryError(Exception):
    """A conflict between plugins, or a plugin that does not follow the hook contract."""

    def __init__(self, message: str, *, conflicts: tuple[str, ...] = ()):
        super().__init__(message)
        self.conflicts = conflicts  # architectures claimed by two plugins


class PluginError(RegistryError, ValueError):
    """A plugin's model class does not import, or its constructor raised: one line naming the plugin, the
    architecture and the original error (a ValueError too: callers that refuse a config catch it)."""


def describe(exc: BaseException) -> str:
    """'Type: first line of the message (at file:line)', the place being the innermost frame of the raise below
    the frame that caught it, outside importlib, this package and generated code (a dataclass's `__init__` is
    "<string>": the plugin's own call is named instead; none for a module that is not found; a syntax error: its
    own file and line); sys.exit reads as such."""
    if isinstance(exc, SystemExit):
        what = f"called sys.exit({exc.code!r})"
    else:
        text = str(exc).strip()
        what = f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{what} (at {_short(exc.filename)}:{exc.lineno})"
    here = os.path.dirname(os.path.abspath(__file__))
    frames = [f for f in traceback.extract_tb(exc.__traceback__)[1:]
              if not f.filename.startswith("<") and "importlib" not in f.filename
              and os.path.dirname(os.path.abspath(f.filename)) != here]
    return f"{what} (at {_short(frames[-1].filename)}:{frames[-1].lineno})" if frames else what


def _short(path: str) -> str:
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel
