"""Plain-text tables for the terminal."""
from __future__ import annotations

from typing import Iterable, Sequence


def format_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    rows = [[str(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def print_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> None:
    print(format_table(header, rows))
