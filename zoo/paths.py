"""Where zoo keeps what it derives once per machine (compiled kernels, configs converted from GGUF)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir(kind: str) -> Path:
    """$ZOO_CACHE/<kind>, else $XDG_CACHE_HOME/zoo/<kind>, else ~/.cache/zoo/<kind>."""
    root = os.environ.get("ZOO_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "zoo"
    return Path(root).expanduser() / kind
