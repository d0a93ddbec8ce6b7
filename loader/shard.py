"""Tensor-parallel arithmetic: which slice of a checkpoint tensor one rank holds, from a Shard rule.

    Parallel(rank, size)            one rank of a group of `size`
    shard_dim(shard)                the dim a Shard splits (its `dim`; else 1 for "row", else 0)
    part_shards(shard)              a "fused" Shard's parts, each as a Shard of its own kind
    local_size(shard, full, size)   rank-local extent along that dim of a `full`-long one
    full_size(shard, local, size)   the inverse: the full tensor's extent a `local`-long parameter part implies
    slice_of(shard, full, tp)       Slice(dim, start, stop, copies): rank tp.rank's rows (or cols) of the full
                                    tensor, and how many ranks hold that same slice (KV replication: size/heads)

Every rank's parameter has the same local shape; only the slice differs. A "fused" Shard is applied part by part
(part_shards), a "once" one is a whole slice on rank 0 and an empty one (zeros) elsewhere. The vocabulary is padded to a
multiple of 64 (of 64 x size when 64 rows do not split evenly) so each rank's part is whole; the padding rows
are no checkpoint's: the loader zeroes them.
"""
from __future__ import annotations

from dataclasses import dataclass

from loader.rules import Shard, padded_vocab


@dataclass(frozen=True)
class Parallel:
    rank: int
    size: int

    def __post_init__(self):
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor parallel rank {self.rank} of {self.size}: expected 0 <= rank < size >= 1")


@dataclass(frozen=True)
class Slice:
    dim: int
    start: int
    stop: int
    copies: int = 1  # ranks holding this same slice (1 unless the heads are replicated)

    def __str__(self) -> str:
        return f"{'cols' if self.dim == 1 else 'rows'} {self.start}:{self.stop}"


def shard_dim(shard: Shard) -> int:
    if shard.dim is not None:
        return shard.dim
    return 1 if shard.kind == "row" else 0


def part_shards(shard: Shard) -> list[Shard]:
    """The parts of a "fused" Shard, in order, each a Shard of its own kind ("column" or "kv") along its dim."""
    return [Shard(shard.pattern, kind, heads=shard.heads if kind == "kv" else 0, dim=shard.dim) for kind in shard.parts]


def split_problem(shard: Shard, n: int) -> str | None:
    """Why `shard` cannot split over `n` ranks whatever the tensor (a kv head count that neither divides nor
    is divided by n), or None."""
    if (shard.kind == "kv" or "kv" in shard.parts) and shard.heads % n and n % shard.heads:
        return f"{shard.heads} KV heads cannot be split over {n} ranks (neither divides the other)"
    return None


def local_size(shard: Shard, full: int, n: int) -> int:
    """Rank-local extent of a `full`-long dim; ValueError when it does not split."""
    if shard.kind in ("replicated", "once"):
        return full
    if shard.kind == "vocab":
        return padded_vocab(shard.size, n) // n
    parts = min(shard.heads, n) if shard.kind == "kv" else n
    if (why := split_problem(shard, n)) or full % parts:
        raise ValueError(why or f"size {full} does not split into {parts} equal parts")
    return full // parts


def full_size(shard: Shard, local: int, n: int) -> int:
    """The full tensor's extent along shard_dim that a rank-local extent `local` implies."""
    if shard.kind in ("replicated", "once"):
        return local
    if shard.kind == "vocab":
        return shard.size
    return local * (min(shard.heads, n) if shard.kind == "kv" else n)


def slice_of(shard: Shard, full: int, tp: Parallel) -> Slice | None:
    """Rank tp.rank's part of a `full`-long dim (None: replicated, the whole tensor; "once": all of it on rank 0,
    an empty slice elsewhere)."""
    if shard.kind == "replicated":
        return None
    part = local_size(shard, full, tp.size)
    dim = shard_dim(shard)
    if shard.kind == "once":
        return Slice(dim, 0, full if tp.rank == 0 else 0)
    if shard.kind == "vocab":
        start = min(tp.rank * part, shard.size)
        return Slice(dim, start, min(start + part, shard.size))
    if shard.kind == "kv" and shard.heads < tp.size:
        copies = tp.size // shard.heads
        head = tp.rank // copies
        return Slice(dim, head * part, (head + 1) * part, copies)
    return Slice(dim, tp.rank * part, (tp.rank + 1) * part)
