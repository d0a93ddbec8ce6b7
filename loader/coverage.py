"""Coverage per element range, without per-element masks: boxes are (start, stop) per dim.

A parameter's writes are a handful of boxes (one per checkpoint tensor: an expert row, a fused shard);
overlaps are found with a sweep along dim 0, and what a box list leaves unwritten in a unit is counted
on the grid the boxes' own edges draw (a few cells, not one per element).
"""
from __future__ import annotations

import itertools
import math

Box = tuple[tuple[int, int], ...]


def volume(box: Box) -> int:
    return math.prod(b - a for a, b in box)


def overlap(a: Box, b: Box) -> bool:
    return all(a0 < b1 and b0 < a1 for (a0, a1), (b0, b1) in zip(a, b))


def overlapping_pairs(boxes: list[Box]) -> list[tuple[int, int]]:
    """Index pairs (i, j), i before j in the list, of boxes that share at least one element."""
    if not boxes or not boxes[0]:  # 0-dim parameter: every write is the whole of it
        return [(0, j) for j in range(1, len(boxes))]
    order = sorted(range(len(boxes)), key=lambda i: boxes[i][0])
    active: list[int] = []
    pairs = []
    for i in order:
        start = boxes[i][0][0]
        active = [j for j in active if boxes[j][0][1] > start]
        pairs += [(min(i, j), max(i, j)) for j in active if overlap(boxes[i], boxes[j])]
        active.append(i)
    return sorted(pairs)


def unwritten(unit: Box, boxes: list[Box]) -> int:
    """How many elements of `unit` no box covers."""
    clipped = []
    for b in boxes:
        c = tuple((max(a0, u0), min(a1, u1)) for (a0, a1), (u0, u1) in zip(b, unit))
        if all(a < b for a, b in c):
            if c == unit:
                return 0
            clipped.append(c)
    if not clipped:
        return volume(unit)
    edges = [sorted({u0, u1, *(c[d][0] for c in clipped), *(c[d][1] for c in clipped)})
             for d, (u0, u1) in enumerate(unit)]
    missing = 0
    for cell in itertools.product(*[list(zip(e, e[1:])) for e in edges]):
        if not any(all(c0 <= a and b <= c1 for (a, b), (c0, c1) in zip(cell, c)) for c in clipped):
            missing += volume(cell)
    return missing
