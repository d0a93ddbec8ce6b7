"""plan(): the mapping of every checkpoint tensor onto the module, and every problem, from headers alone.

load() computes the same plan first and streams only when it is clean.

Under tensor parallelism (tp=Parallel(rank, size), the module built with rank-local shapes) the rules' Shard
specs say which slice of each checkpoint tensor the rank reads: the full tensor's shape is checked first, the
entry carries the slice, and coverage is of the rank-local parameters. plan_ranks() computes every rank's plan
in one process and proves that their slices together cover every element of every tensor exactly once (a
replicated slice by exactly the ranks meant to share it).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import dataclasses
import re
from collections.abc import Mapping

import torch

from loader.coverage import overlapping_pairs, unwritten, volume
from loader.mapping import Mapper, ParamInfo, Region
from loader.problems import Problem
from loader.quant import QuantLayout, QuantType, layout_for, nbytes as quant_nbytes
from loader.rules import Rules, Shard, Transform
from loader.shard import (Parallel, Slice, full_size, local_size, part_shards, shard_dim, slice_of,
                          split_problem)
from loader.sources import Source, open_source

# load(dtype=): one dtype for every floating-point parameter, a mapping name -> dtype (a name it lacks keeps the
# dtype the module was built with), or None (every parameter as built; a lossy cast into it is a problem)
DType = torch.dtype | Mapping[str, torch.dtype] | None


@dataclass(frozen=True)
class Entry:
    key: str
    file: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    param: str
    region: Region
    transform: Transform | None = None  # the key holds the parameter in this layout
    slice: Slice | None = None  # tensor parallel: the part of the key's tensor this rank reads (None: all)
    quant: QuantType | None = None  # kept block-quantised (loader/quant.py)

    def nbytes(self, itemsize: int | None = None) -> int:
        """Bytes of the part this entry reads."""
        if self.quant is not None:
            return quant_nbytes(self.shape, self.quant)
        n = 1
        for s in self.shape:
            n *= s
        if self.slice is not None and self.shape:
            n = n // self.shape[self.slice.dim] * (self.slice.stop - self.slice.start)
        return n * (itemsize or self.dtype.itemsize)


@dataclass(frozen=True)
class TieDecision:
    param: str
    source: str
    tied: bool  # True: param shares source's tensor; False: the checkpoint holds param, loaded on its own

    def __str__(self) -> str:
        if self.tied:
            return f"{self.param} tied to {self.source} (the checkpoint has no {self.param})"
        return f"{self.param} untied from {self.source} (the checkpoint holds its own {self.param})"


@dataclass
class Plan:
    source: Source
    entries: list[Entry] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    ignored: list[tuple[str, str, str]] = field(default_factory=list)  # (key, file, reason)
    ties: list[TieDecision] = field(default_factory=list)
    params: dict[str, ParamInfo] = field(default_factory=dict)  # every destination of the module
    owner: dict[str, str] = field(default_factory=dict)  # param -> the param whose storage it uses
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)  # param -> dtype it is allocated with
    tp: Parallel | None = None
    pads: dict[str, list[Region]] = field(default_factory=dict)  # param -> vocab padding rows (zeroed)
    quant: dict[str, QuantLayout] = field(default_factory=dict)  # param -> its blocks' layout (stored as bytes)

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        lines = [f"plan for {self.source.directory}: {len(self.entries)} tensors -> "
                 f"{len(set(self.owner.values()))} parameters, {len(self.ignored)} ignored, "
                 f"{len(self.problems)} problems"]
        lines += [f"  {t}" for t in self.ties]
        lines += [f"  {p}" for p in self.problems]
        return "\n".join(lines)


def plan(module: torch.nn.Module, source, rules: Rules = Rules(), *, dtype: DType = None,
         tp: Parallel | None = None) -> Plan:
    source = open_source(source, strict=False)
    rules = rules + source.rules
    params, groups = module_params(module)
    mapper = Mapper(rules, params, {k: tuple(source.info(k).shape) for k in source.keys()})
    out = Plan(source, problems=list(source.problems), params=params, tp=tp)
    shards = [(re.compile(s.pattern), s) for s in rules.shards] if tp is not None else []
    writes: dict[str, list[tuple[tuple, str, str, Region]]] = {}
    for key in source.keys():
        info = source.info(key)
        m = mapper.map(key)
        if m.kind == "ignored":
            out.ignored.append((key, info.file, m.reason))
            continue
        if m.kind == "unexpected":
            why = "no parameter of the module has that name" if m.name == key else \
                f"the rules map it to {m.name}, which the module does not have"
            out.problems.append(Problem("unexpected", key, info.file, None, f"{key} in {info.file}: {why}"))
            continue
        p, where = params[m.name], f"{m.name}{m.region}"
        if m.reason:
            out.problems.append(Problem("shape", key, info.file, m.name, f"{key} in {info.file}: {m.reason}"))
            continue
        shard = next((s for pattern, s in shards if pattern.search(key)), None)
        stacked = shard is not None and shard.stack  # its expert index is checked against the stack's full size
        if not stacked and m.region.expert is not None and not (p.shape and m.region.expert < p.shape[0]):
            out.problems.append(Problem("shape", key, info.file, where,
                f"{key} in {info.file} is expert {m.region.expert} but {m.name} has shape {list(p.shape)}"))
            continue
        expected = m.region.shape(p.shape)
        if m.transform is not None:
            expected, where = m.transform.source_shape(expected), f"{where} ({m.transform.kind}d)"
        pieces = [(None, m.region)]  # (the part of the key's tensor this rank reads, the region it fills)
        if shard is not None and shard.kind != "replicated":
            got = _sharded(key, info, m, p, shard, tp)
            if isinstance(got, Problem):
                out.problems.append(got)
                continue
            expected, pieces, pads = got
            for pad in pads:  # vocab padding, a "once" tensor on another rank than 0: zeros
                out.pads.setdefault(m.name, []).append(pad)
                writes.setdefault(m.name, []).append((pad.box(p.shape), "(zeros)" if shard.kind == "once"
                                                      else "(vocab padding)", "", pad))
            if not pieces:  # a rank that reads nothing of it (all padding, another rank's stack row or "once")
                continue
        if tuple(info.shape) != expected:
            out.problems.append(Problem("shape", key, info.file, where, f"{key} in {info.file} has shape "
                f"{list(info.shape)} but {where} expects {list(expected)}" + _missing_part(info.shape, pieces, tp)))
        dst = dest_dtype(m.name, p, dtype)
        on_purpose = _asked(m.name, dtype) is not None and info.dtype.is_floating_point and dst.is_floating_point
        if info.quant is not None and (why := _unquantizable(p, m, next((c for c, _ in pieces if c), None))):
            out.problems.append(Problem("dtype", key, info.file, where, f"{key} in {info.file} is "
                f"{info.quant.name} (kept quantized) but {where} {why}; dequantize the file instead "
                f"(zoo run --dtype float32)"))
        elif not on_purpose and lossy(info.dtype, dst):  # dtype= casts floats to floats, nothing else
            out.problems.append(Problem("dtype", key, info.file, where,
                f"{key} in {info.file} is {_dt(info.dtype)} but {m.name} is {_dt(dst)}: a lossy cast "
                + ("(dtype= casts floating-point to floating-point only)" if _asked(m.name, dtype) is not None
                   else "(pass dtype= to load() to cast on purpose)")))
        for piece, region in pieces:
            out.entries.append(Entry(key, info.file, tuple(info.shape), info.dtype, m.name, region, m.transform, piece,
                                     info.quant))
            writes.setdefault(m.name, []).append((region.box(p.shape), key, info.file, region))

    out.owner = {name: name for name in params}
    for name, src, tied in _ties(groups, rules, params, writes):
        if tied and (clash := _tie_clash(name, src, params, dtype)) is not None:
            out.problems.append(clash)  # no tie: `name` is then reported missing on its own as well
            continue
        out.ties.append(TieDecision(name, src, tied))
        if tied:
            out.owner[name] = src
    for name in list(out.owner):  # a tie of a tie ends at the tensor that is loaded
        while out.owner[out.owner[name]] != out.owner[name]:
            out.owner[name] = out.owner[out.owner[name]]
    out.problems += _quant_layouts(out)
    for name, p in params.items():
        out.dtypes[name] = dest_dtype(name, p, dtype)
        if out.owner[name] == name:
            out.problems += _coverage(name, p, writes.get(name, []), mapper)
    if tp is not None and tp.size > 1:
        out.problems = [dataclasses.replace(q, detail=f"rank {tp.rank} of {tp.size}: {q.detail}") for q in out.problems]
    return out


def _sharded(key: str, info, m, p: ParamInfo, shard: Shard, tp: Parallel):
    """(the full shape expected of the checkpoint tensor, this rank's pieces [(its Slice of the tensor, the region
    of the parameter it fills)], the regions this rank zeroes instead: vocab padding, a "once" tensor off rank 0),
    or the Problem that stops it. Sizes are in the parameter's layout; a transposed key's slice is on the
    checkpoint's dim."""
    where = f"{m.name}{m.region}"
    t = m.transform

    def problem(why: str) -> Problem:
        return Problem("shape", key, info.file, where, f"{key} in {info.file} -> {where}: {why}")

    if why := split_problem(shard, tp.size):
        return problem(why)
    if shard.stack:
        return _stack_sharded(m, p, shard, tp, problem)
    if t is not None and not (t.kind == "transpose" or (t.kind == "interleave" and shard.kind == "column"
                                                        and shard_dim(shard) == 0)):
        return problem(f"a key held in another layout ({t.kind}) cannot be {shard.kind}-parallel on dim "
                       f"{shard_dim(shard)} (an interleaved key splits column-parallel on dim 0 only: whole heads, "
                       f"one run of rows)")
    shape = m.region.shape(p.shape)  # what the key fills, in the parameter's layout
    d = shard_dim(shard)
    if d >= len(shape):
        return problem(f"a {shard.kind}-parallel shard splits dim {d}, but the parameter part has shape {list(shape)}")
    if m.region.dim is not None and shard.kind in ("vocab", "once", "fused"):
        return problem(f"a {shard.kind}-parallel key cannot also be a Fuse part")
    src = 1 - d if t is not None and t.kind == "transpose" and len(shape) == 2 else d  # the checkpoint's dim
    parts = _parts(shard, p, shape[d])
    if isinstance(parts, str):
        return problem(parts)
    pieces, pads, local_at, full_at = [], [], 0, 0
    for part, local in parts:
        full = full_size(part, local, tp.size)
        try:
            ok = local_size(part, full, tp.size) == local
        except ValueError:
            ok = False
        if not ok:
            return problem(f"its rank-local extent {local} on dim {d} is not what a {part.kind}-parallel split of "
                           f"{full} over {tp.size} ranks gives (was the module built for tensor parallel size "
                           f"{tp.size}?)")
        s = slice_of(part, full, tp)
        n = s.stop - s.start
        region = m.region if shard.kind != "fused" else \
            dataclasses.replace(m.region, dim=d, start=local_at, stop=local_at + local)
        if n < local:  # the vocab's padding rows on this rank; a "once" tensor's other ranks
            region = dataclasses.replace(m.region, dim=d, start=0, stop=n)
            pads.append(dataclasses.replace(m.region, dim=d, start=n, stop=local))
        if n:
            pieces.append((Slice(src, full_at + s.start, full_at + s.stop, s.copies), region))
        local_at, full_at = local_at + local, full_at + full
    full_shape = shape[:d] + (full_at,) + shape[d + 1:]
    return (t.source_shape(full_shape) if t is not None else full_shape), pieces, pads


def _parts(shard: Shard, p: ParamInfo, extent: int):
    """[(Shard, rank-local extent)] along the split dim: the shard itself, or a "fused" one's parts sized by the
    parameter's shard_sizes (else equally); a str saying why they do not fit."""
    if shard.kind != "fused":
        return [(shard, extent)]
    k = len(shard.parts)
    sizes = p.shard_sizes if p.shard_sizes and len(p.shard_sizes) == k and sum(p.shard_sizes) == extent else None
    if sizes is None and extent % k:
        return f"its rank-local extent {extent} does not split into the {k} parts {'/'.join(shard.parts)}"
    return list(zip(part_shards(shard), sizes or (extent // k,) * k))


def _stack_sharded(m, p: ParamInfo, shard: Shard, tp: Parallel, problem):
    """A Stack row's key under a stack Shard: read whole by the ranks whose rows of the stacked parameter hold it
    (KV-replicated rows by several), by no other."""
    e, shape = m.region.expert, m.region.shape(p.shape)
    if e is None or not shape:
        return problem("a stack shard needs a key that a Stack rule maps to a row of its parameter")
    local = p.shape[0]
    full = full_size(shard, local, tp.size)
    if local_size(shard, full, tp.size) != local:
        return problem(f"its {local} stack rows per rank are not what a {shard.kind}-parallel split of {full} over "
                       f"{tp.size} ranks gives (was the module built for tensor parallel size {tp.size}?)")
    if e >= full:
        return problem(f"it is row {e} of a stack that holds {full} rows ({local} on each of {tp.size} ranks)")
    s = slice_of(shard, full, tp)
    if not s.start <= e < s.stop:
        return shape, [], []  # another rank's row
    return shape, [(Slice(0, 0, shape[0], s.copies), dataclasses.replace(m.region, expert=e - s.start))], []


def _missing_part(shape: tuple[int, ...], pieces: list, tp: Parallel | None) -> str:
    """', so rank r's rows a:b are not in the checkpoint' when its slice lies past the tensor's end."""
    cut = [c for c, _ in pieces if c is not None]
    if not cut or tp is None:
        return ""
    piece = next((c for c in cut if len(shape) > c.dim and c.stop > shape[c.dim]), None)
    if piece is not None:
        return f": rank {tp.rank}'s slice, {piece}, is not in the checkpoint"
    return f" (rank {tp.rank} reads {', '.join(map(str, cut))} of the full tensor)"


@dataclass
class RankPlans:
    """Every rank's plan, and the proof that their slices cover each checkpoint tensor exactly once."""

    plans: list[Plan]
    problems: list[Problem] = field(default_factory=list)  # every rank's, then the union's

    @property
    def ok(self) -> bool:
        return not self.problems

    def bytes(self, rank: int) -> int:
        """Bytes rank `rank` reads (its slices, at the checkpoint's dtypes)."""
        return sum(e.nbytes() for e in self.plans[rank].entries)

    def __str__(self) -> str:
        lines = [f"tensor parallel size {len(self.plans)}: {len(self.problems)} problems"]
        lines += [f"  rank {r}: {len(p.entries)} tensors, {self.bytes(r) / 1e6:.2f} MB read"
                  for r, p in enumerate(self.plans)]
        return "\n".join(lines)


def plan_ranks(module: torch.nn.Module, source, rules: Rules = Rules(), size: int = 1, *,
               dtype: DType = None) -> RankPlans:
    """plan() for every rank of a tensor-parallel group of `size`, in this process (no rank is spawned), and
    the proof that the union of their slices covers every element of every checkpoint tensor exactly once:
    a column/row/vocab slice by one rank, a KV-replicated one by exactly size/heads ranks, a replicated
    tensor by every rank."""
    source = open_source(source, strict=False)
    plans = [plan(module, source, rules, dtype=dtype, tp=Parallel(r, size)) for r in range(size)]
    out = RankPlans(plans, [q for p in plans for q in p.problems])
    if out.problems:  # a rank that does not plan cleanly has no union to prove
        return out
    reads: dict[str, dict[tuple, list[int]]] = {}  # key -> box of the full tensor -> the ranks reading it
    copies: dict[tuple[str, tuple], int] = {}
    for r, p in enumerate(plans):
        for e in p.entries:
            box = tuple((0, s) for s in e.shape)
            if e.slice is not None:
                box = box[:e.slice.dim] + ((e.slice.start, e.slice.stop),) + box[e.slice.dim + 1:]
            reads.setdefault(e.key, {}).setdefault(box, []).append(r)
            copies[e.key, box] = e.slice.copies if e.slice is not None else size
    for key in source.keys():
        if any(key == k for k, _, _ in plans[0].ignored):
            continue
        info = source.info(key)
        boxes = reads.get(key, {})
        full = tuple((0, s) for s in info.shape)
        for box, ranks in boxes.items():
            if len(ranks) != copies[key, box]:
                out.problems.append(Problem("duplicate", key, info.file, None,
                    f"{key} in {info.file}: {_box(box)} is read by ranks {ranks}, expected {copies[key, box]} of them"))
        listed = list(boxes)
        for i, j in overlapping_pairs(listed):
            out.problems.append(Problem("duplicate", key, info.file, None, f"{key} in {info.file}: {_box(listed[i])} "
                f"(ranks {boxes[listed[i]]}) overlaps {_box(listed[j])} (ranks {boxes[listed[j]]})"))
        if gap := unwritten(full, listed):
            out.problems.append(Problem("missing", key, info.file, None,
                f"{key} in {info.file}: {gap} of {volume(full)} elements are read by no rank of {size}"))
    return out


def _box(box: tuple) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in box) + "]"


def module_params(module: torch.nn.Module) -> tuple[dict[str, ParamInfo], list[list[str]]]:
    """Every parameter and persistent buffer by name, and the groups of names that share one tensor."""
    params: dict[str, ParamInfo] = {}
    by_id: dict[int, list[str]] = {}
    for name, t in module.named_parameters(remove_duplicate=False):
        sizes = getattr(t, "shard_sizes", None)
        params[name] = ParamInfo(tuple(t.shape), t.dtype, tuple(sizes) if sizes else None, meta=t.is_meta,
                                 quantizable=bool(getattr(t, "quantizable", False)))
        by_id.setdefault(id(t), []).append(name)
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for leaf, t in mod._buffers.items():
            if t is not None and leaf not in mod._non_persistent_buffers_set:
                name = f"{mod_name}.{leaf}" if mod_name else leaf
                params[name] = ParamInfo(tuple(t.shape), t.dtype, buffer=True, meta=t.is_meta)
    return params, [g for g in by_id.values() if len(g) > 1]


def _ties(groups, rules: Rules, params, writes):
    """(param, source, tied) decisions: tensors the module already shares, then the Tie rules."""
    seen = set()
    for group in groups:
        written = [n for n in group if writes.get(n)]
        src = written[0] if written else group[0]
        for name in group:
            if name != src:
                seen.add(name)
                yield name, src, not writes.get(name)
    for t in rules.ties:  # (for tensors the module keeps apart, a checkpoint that holds both needs no decision)
        if t.param in params and t.source in params and t.param not in seen and not writes.get(t.param):
            seen.add(t.param)
            yield t.param, t.source, True


def _unquantizable(p: ParamInfo, m, piece) -> str | None:
    """Why a quantised tensor cannot fill this part of p as blocks (None: it can): whole rows of a matrix
    whose layer computes with quantised weights."""
    if not p.quantizable:
        return "belongs to a layer that computes with float weights only"
    if m.transform is not None or piece is not None or m.region.expert is not None or m.region.dim not in (None, 0):
        return "is filled through a transform, a tensor-parallel slice, an expert index or columns, not whole rows"
    return None


def _quant_layouts(out: Plan) -> list[Problem]:
    """Each parameter filled from quantised tensors gets its layout (row ranges and their types); one that
    would mix quantised and float tensors, or whose shape the blocks do not tile, is a problem."""
    problems, pieces = [], {}
    for e in out.entries:
        pieces.setdefault(e.param, []).append(e)
    for name, entries in pieces.items():
        quant = [e for e in entries if e.quant is not None]
        if not quant:
            continue
        if len(quant) != len(entries):
            floats = next(e for e in entries if e.quant is None)
            problems.append(Problem("dtype", floats.key, floats.file, name, f"{name} would mix quantized tensors "
                f"({quant[0].key}: {quant[0].quant.name}) and float ones ({floats.key}: {_dt(floats.dtype)}); "
                f"dequantize the file instead (zoo run --dtype float32)"))
            continue
        shape = out.params[name].shape
        rows = [(e.region.start, e.region.stop) if e.region.dim == 0 else (0, shape[0] if shape else 0) for e in quant]
        layout = layout_for(shape, [(a, b, e.quant) for (a, b), e in zip(rows, quant)])
        if isinstance(layout, str):
            problems.append(Problem("shape", quant[0].key, quant[0].file, name, f"{quant[0].key} in {quant[0].file} "
                                    f"-> {name}: {layout}"))
            continue
        out.quant[name] = layout
    return problems


def _asked(name: str, dtype: DType) -> torch.dtype | None:
    """What load(dtype=) asks of one parameter: the dtype, the mapping's entry for its name, or None (as built)."""
    return dtype.get(name) if isinstance(dtype, Mapping) else dtype


def dest_dtype(name: str, p: ParamInfo, dtype: DType) -> torch.dtype:
    """The dtype a parameter is allocated with: load(dtype=) applies to floating-point parameters only."""
    asked = _asked(name, dtype)
    return asked if asked is not None and p.dtype.is_floating_point else p.dtype


def _tie_clash(name: str, src: str, params: dict[str, ParamInfo], dtype: DType) -> Problem | None:
    """A tie needs one tensor that fits both parameters: the same shape and the same dtype."""
    a, b = params[name], params[src]
    if a.shape != b.shape:
        return Problem("shape", None, None, name, f"{name} has shape {list(a.shape)} but {src}, which it would be "
                                                  f"tied to, has shape {list(b.shape)}: they cannot share one tensor")
    da, db = dest_dtype(name, a, dtype), dest_dtype(src, b, dtype)
    if da != db:
        return Problem("dtype", None, None, name, f"{name} is {_dt(da)} but {src}, which it would be tied to, "
                                                  f"is {_dt(db)}: they cannot share one tensor")
    return None


def _coverage(name: str, p: ParamInfo, writes: list, mapper: Mapper) -> list[Problem]:
    problems = []
    boxes = [w[0] for w in writes]
    for i, j in overlapping_pairs(boxes):
        (ba, ka, fa, ra), (bb, kb, fb, rb) = writes[i], writes[j]
        where = f"{name}{ra if volume(ba) < volume(bb) else rb}"  # the smaller of the two is the overlap
        problems.append(Problem("duplicate", kb, fb, where, f"{where} is written twice: by {ka} in {fa} and by {kb} in {fb}"))
    if not writes and p.buffer:
        if p.meta:
            problems.append(Problem("missing", name, None, name,
                f"{name}: a persistent buffer on the meta device that no checkpoint key fills "
                f"(compute it lazily, or register it with persistent=False)"))
        return problems
    for key, region in mapper.units(name):
        unit = region.box(p.shape)
        gap = unwritten(unit, boxes)
        if gap:
            where = f"{name}{region}"
            text = f"{key} -> {where}" if key != where else f"{key}: the checkpoint has no tensor for it"
            total = volume(unit)
            if gap < total:
                text += f" (partly written: {gap} of {total} elements missing)"
            problems.append(Problem("missing", key, None, where, text))
    return problems


def lossy(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether casting src -> dst can change a value (bf16 -> fp32 cannot; fp32 -> bf16 can)."""
    if src == dst or src == torch.bool:
        return False
    if dst == torch.bool or src.is_complex or dst.is_complex:
        return True
    if src.is_floating_point:
        if not dst.is_floating_point:
            return True
        s, d = torch.finfo(src), torch.finfo(dst)
        return not (d.eps <= s.eps and d.max >= s.max and d.smallest_normal <= s.smallest_normal)
    s = torch.iinfo(src)
    if dst.is_floating_point:
        exact = 2 ** round(1 - torch.log2(torch.tensor(torch.finfo(dst).eps)).item())
        return max(-s.min, s.max) > exact
    d = torch.iinfo(dst)
    return d.min > s.min or d.max < s.max


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
