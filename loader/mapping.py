"""The rules as a function: checkpoint key -> (parameter, region), and back (parameter -> expected keys).

Shared by plan() and load(). A region is the part of a parameter one checkpoint tensor fills:
an expert index on dim 0 of a stacked parameter, and/or a shard range along a fused dim.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from loader.rules import Fuse, Rules, Transform

_DIM_NAMES = {0: "rows", 1: "cols"}


@dataclass(frozen=True)
class Region:
    """`param[expert].narrow(dim, start, stop - start)`; expert/dim None means the whole extent."""

    expert: int | None = None
    dim: int | None = None  # a dim of the per-expert tensor (what the checkpoint holds)
    start: int = 0
    stop: int = 0

    def __str__(self) -> str:
        parts = [] if self.expert is None else [str(self.expert)]
        if self.dim is not None:
            parts.append(f"{_DIM_NAMES.get(self.dim, f'dim {self.dim}')} {self.start}:{self.stop}")
        return f"[{', '.join(parts)}]" if parts else ""

    def view(self, t: torch.Tensor) -> torch.Tensor:
        if self.expert is not None:
            t = t[self.expert]
        if self.dim is not None:
            t = t.narrow(self.dim, self.start, self.stop - self.start)
        return t

    def box(self, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        """The region as (start, stop) per dim of the parameter."""
        dims = [(0, s) for s in shape]
        if self.expert is not None:
            dims[0] = (self.expert, self.expert + 1)
        if self.dim is not None:
            dims[self.dim + (self.expert is not None)] = (self.start, self.stop)
        return tuple(dims)

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape a checkpoint tensor must have to fill this region of a parameter of `shape`."""
        s = list(shape[1:] if self.expert is not None else shape)
        if self.dim is not None:
            s[self.dim] = self.stop - self.start
        return tuple(s)


@dataclass(frozen=True)
class ParamInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype
    shard_sizes: tuple[int, ...] | None = None
    buffer: bool = False
    meta: bool = False
    quantizable: bool = False  # its layer computes with block-quantised weights (the tensor's `quantizable`)


@dataclass(frozen=True)
class Mapped:
    kind: str  # "param", "ignored" or "unexpected"
    name: str  # the parameter (for "unexpected": the name the rules produced, which the module lacks)
    region: Region = Region()
    reason: str = ""  # for "ignored": the Ignore's reason; for "param": a fuse-size error, if any
    transform: Transform | None = None  # for "param": the key holds the parameter in this other layout


class Mapper:
    def __init__(self, rules: Rules, params: dict[str, ParamInfo], key_shapes: dict[str, tuple] | None = None):
        self.rules = rules
        self.params = params
        self.key_shapes = key_shapes or {}  # checkpoint key -> shape (the headers'): a fused parameter's shard sizes
        self._ignores = [(re.compile(i.pattern), i.reason) for i in rules.ignores]
        self._transforms = [(re.compile(t.pattern), t) for t in rules.transforms]

    # -- forward: key -> parameter ------------------------------------------------------------------
    def map(self, key: str) -> Mapped:
        m = self._map(key)
        transform = next((t for pattern, t in self._transforms if pattern.search(key)), None)
        if transform is None or m.kind != "param" or m.reason:
            return m
        if m.region != Region():
            return Mapped("param", m.name, m.region, reason=f"a {transform.kind} Transform must fill the whole "
                                                            f"parameter, not the region {m.region}")
        return Mapped("param", m.name, reason=transform.problem(self.params[m.name].shape) or "", transform=transform)

    def _map(self, key: str) -> Mapped:
        for pattern, reason in self._ignores:
            if pattern.search(key):
                return Mapped("ignored", key, reason=reason)
        name = key
        for r in self.rules.renames:
            name = _rename(name, r.src.removeprefix("^"), r.dst, anchored=r.src.startswith("^"))
        comps = name.split(".")
        expert, unstacked = None, comps
        for s in self.rules.stacks:
            for i in range(len(comps) - 1):
                if comps[i] == s.container and comps[i + 1].isdigit():
                    expert, unstacked = int(comps[i + 1]), comps[: i + 1] + comps[i + 2:]
                    break
            if expert is not None:
                break
        # Prefer the fully mapped name; fall back to less mapping when the module lacks that parameter
        # (a model that keeps experts as a ModuleList, or keeps q/k/v apart).
        options = [(unstacked, expert)] + ([(comps, None)] if expert is not None else [])
        first = None
        for base, e in options:
            fused = self._fuse(base)
            for cand in ([fused] if fused else []) + [(base, None, 0)]:
                pcomps, fuse, shard = cand
                pname = ".".join(pcomps)
                first = first or pname
                if pname in self.params:
                    return self._target(pname, e, fuse, shard)
        return Mapped("unexpected", first)

    def _fuse(self, comps: list[str]) -> tuple[list[str], Fuse, int] | None:
        for f in self.rules.fuses:
            for i, c in enumerate(comps):
                if c in f.parts:
                    return comps[:i] + [f.into] + comps[i + 1:], f, f.parts.index(c)
        return None

    def _target(self, pname: str, expert: int | None, fuse: Fuse | None, shard: int) -> Mapped:
        if fuse is None:
            return Mapped("param", pname, Region(expert))
        try:
            sizes = self.fuse_sizes(pname, fuse, stacked=expert is not None)
        except ValueError as e:
            return Mapped("param", pname, Region(expert), reason=str(e))
        start = sum(sizes[:shard])
        return Mapped("param", pname, Region(expert, fuse.dim, start, start + sizes[shard]))

    def fuse_sizes(self, pname: str, fuse: Fuse, *, stacked: bool) -> tuple[int, ...]:
        """Shard sizes along the fused dim: Fuse.sizes, else the parameter's shard_sizes, else the checkpoint's own
        shapes when they add up (_held_sizes), else equal."""
        p = self.params[pname]
        d = fuse.dim + stacked
        if d >= len(p.shape):
            raise ValueError(f"{pname} has shape {list(p.shape)}, no dim {d} to fuse {'/'.join(fuse.parts)} along")
        total = p.shape[d]
        sizes = fuse.sizes or p.shard_sizes or self._held_sizes(pname, fuse, d - stacked, stacked, total)
        if sizes is None:
            if total % len(fuse.parts):
                raise ValueError(f"{pname}: dim {d} of size {total} does not split equally into "
                                 f"{len(fuse.parts)} shards {'/'.join(fuse.parts)}; set shard_sizes on the parameter")
            sizes = (total // len(fuse.parts),) * len(fuse.parts)
        sizes = tuple(int(s) for s in sizes)
        if len(sizes) != len(fuse.parts) or sum(sizes) != total:
            raise ValueError(f"{pname}: shard sizes {list(sizes)} for {'/'.join(fuse.parts)} do not add up to "
                             f"dim {d} of size {total}")
        return sizes

    def _held_sizes(self, pname: str, fuse: Fuse, dim: int, stacked: bool, total: int) -> tuple[int, ...] | None:
        """The shard sizes the checkpoint's own shapes give (a grouped-query q/k/v: [Hq*D, Hkv*D, Hkv*D]), when
        it holds every part of `pname` (expert 0's, for a stacked one) and their extents along `dim` add up to
        the parameter's: then the split can be only that one. Else None."""
        comps = pname.split(".")
        at = next((i for i, c in enumerate(comps) if c == fuse.into), None)
        if at is None or not self.key_shapes:
            return None
        stack_at = None
        if stacked:
            stack_at = next((i for s in self.rules.stacks for i in range(len(comps) - 1)
                             if comps[i] == s.container), None)
            if stack_at is None:
                return None
        sizes = []
        for part in fuse.parts:
            c = comps[:at] + [part] + comps[at + 1:]
            if stack_at is not None:
                c.insert(stack_at + 1, "0")
            shape = self.key_shapes.get(self.unrename(".".join(c)))
            if shape is None or dim >= len(shape):
                return None
            sizes.append(int(shape[dim]))
        return tuple(sizes) if sum(sizes) == total else None

    # -- backward: parameter -> the keys the checkpoint should hold ------------------------------------
    def units(self, pname: str) -> list[tuple[str, Region]]:
        """(expected checkpoint key, region) for every piece of `pname` that one key fills."""
        p = self.params[pname]
        comps = pname.split(".")
        stack_at = None
        for s in self.rules.stacks:
            for i in range(len(comps) - 1):
                if comps[i] == s.container and not comps[i + 1].isdigit() and p.shape:
                    stack_at = i
        fuse_at, fuse = None, None
        for f in self.rules.fuses:
            for i, c in enumerate(comps):
                if c == f.into and fuse is None:
                    fuse_at, fuse = i, f
        sizes = None
        if fuse is not None:
            try:
                sizes = self.fuse_sizes(pname, fuse, stacked=stack_at is not None)
            except ValueError:
                fuse = None
        experts = range(p.shape[0]) if stack_at is not None else [None]
        out = []
        for e in experts:
            for shard in range(len(fuse.parts)) if fuse else [None]:
                c = list(comps)
                region = Region(e)
                if fuse is not None:
                    c[fuse_at] = fuse.parts[shard]
                    start = sum(sizes[:shard])
                    region = Region(e, fuse.dim, start, start + sizes[shard])
                if e is not None:
                    c.insert(stack_at + 1, str(e))
                out.append((self.unrename(".".join(c)), region))
        return out

    def unrename(self, name: str) -> str:
        for r in reversed(self.rules.renames):
            if r.dst or r.src.startswith("^"):  # (an unanchored rename to "" has no one place to undo at)
                name = _rename(name, r.dst, r.src.removeprefix("^"), anchored=r.src.startswith("^"))
        return name


def _rename(name: str, src: str, dst: str, *, anchored: bool) -> str:
    """`src` -> `dst` in `name`: every occurrence, or (anchored) only at its start."""
    if anchored:
        return dst + name[len(src):] if name.startswith(src) else name
    return name.replace(src, dst)
