"""Problems the loader finds, and the one exception that carries all of them.

Every problem names what is at fault: the checkpoint key, the file that holds it, and the parameter
(with the region of it, for fused and stacked parameters). `str(LoadError)` lists them one per line, the
first SHOWN of them (a config claiming 100000 layers must not print a million lines); `.problems` has all.
"""
from __future__ import annotations

from dataclasses import dataclass

SHOWN = 50
KINDS = ("missing", "unexpected", "duplicate", "shape", "dtype", "nonfinite", "file")


@dataclass(frozen=True)
class Problem:
    kind: str  # one of KINDS ("file": a source-level inconsistency such as a shard missing from disk)
    key: str | None  # the checkpoint key (for `missing`: the key expected, reversed through the rules)
    file: str | None  # the file holding the key (file name relative to the source directory)
    param: str | None  # the module parameter, with its region when it is a slice: "w[3, rows 0:32]"
    detail: str  # the whole sentence, naming key, file and parameter

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}"


class LoadError(Exception):
    """All the problems of one plan or load, raised together after the whole checkpoint was examined."""

    def __init__(self, problems: list[Problem], header: str | None = None):
        self.problems = list(problems)
        n = len(self.problems)
        self.header = header or f"{n} problem{'s' * (n != 1)} loading the checkpoint"
        super().__init__(str(self))

    def __str__(self) -> str:
        lines = [self.header + ":"] if self.problems else [self.header]
        lines += [f"  {p}" for p in self.problems[:SHOWN]]
        if len(self.problems) > SHOWN:
            lines.append(f"  ... and {len(self.problems) - SHOWN} more problems")
        return "\n".join(lines)


class SourceError(LoadError):
    """The checkpoint itself is inconsistent or unreadable (index vs shards, refused pickles, not found)."""
