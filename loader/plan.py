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
from loader.shard import Parallel, Slice, full_size, local_size, shard_dim, slice_of, split_problem
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
        if m.region.expert is not None and not (p.shape and m.region.expert < p.shape[0]):
            out.problems.append(Problem("shape", key, info.file, where,
                f"{key} in {info.file} is expert {m.region.expert} but {m.name} has shape {list(p.shape)}"))
            continue
        expected = m.region.shape(p.shape)
        if m.transform is not None:
            expected, where = m.transform.source_shape(expected), f"{where} ({m.transform.kind}d)"
        region, piece = m.region, None
        shard = next((s for pattern, s in shards if pattern.search(key)), None)
        if shard is not None and shard.kind != "replicated":
            got = _sharded(key, info, m, p.shape, expected, shard, tp)
            if isinstance(got, Problem):
                out.problems.append(got)
                continue
            expected, piece, region, pad = got
            if pad is not None:
                out.pads.setdefault(m.name, []).append(pad)
                writes.setdefault(m.name, []).append((pad.box(p.shape), "(vocab padding)", "", pad))
            if piece.stop == piece.start:  # a rank whose vocab part is all padding reads nothing of it
                continue
        if tuple(info.shape) != expected:
            out.problems.append(Problem("shape", key, info.file, where, f"{key} in {info.file} has shape "
                f"{list(info.shape)} but {where} expects {list(expected)}" + _missing_part(info.shape, piece, tp)))
        dst = dest_dtype(m.name, p, dtype)
        on_purpose = _asked(m.name, dtype) is not None and info.dtype.is_floating_point and dst.is_floating_point
        if info.quant is not None and (why := _unquantizable(p, m, piece)):
            out.problems.append(Problem("dtype", key, info.file, where, f"{key} in {info.file} is "
                f"{info.quant.name} (kept quantized) but {where} {why}; dequantize the file instead "
                f"(zoo run --dtype float32)"))
        elif not on_purpose and lossy(info.dtype, dst):  # dtype= casts floats to floats, nothing else
            out.problems.append(Problem("dtype", key, info.file, where,
                f"{key} in {info.file} is {_dt(info.dtype)} but {m.name} is {_dt(dst)}: a lossy cast "
                + ("(dtype= casts floating-point to floating-point only)" if _asked(m.name, dtype) is not None
                   else "(pass dtype= to load() to cast on purpose)")))
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


def _sharded(key: str, info, m, shape: tuple[int, ...], expected: tuple[int, ...], shard: Shard, tp: Parallel):
    """(full shape expected of the checkpoint tensor, this rank's Slice of it, the region it fills, the padding
    region or None), or the Problem that stops it."""
    d = shard_dim(shard)
    where = f"{m.name}{m.region}"

    def problem(why: str) -> Problem:
        return Problem("shape", key, info.file, where, f"{key} in {info.file} -> {where}: {why}")

    if m.transform is not None:
        return problem(f"a {m.transform.kind} Transform cannot be {shard.kind}-parallel")
    if d >= len(expected):
        return problem(f"a {shard.kind}-parallel shard splits dim {d}, but the parameter part has shape {list(expected)}")
    if why := split_problem(shard, tp.size):
        return problem(why)
    local = expected[d]
    full = full_size(shard, local, tp.size)
    try:
        ok = local_size(shard, full, tp.size) == local
    except ValueError:
        ok = False
    if not ok:
        return problem(f"its rank-local extent {local} on dim {d} is not what a {shard.kind}-parallel split of "
                       f"{full} over {tp.size} ranks gives (was the module built for tensor parallel size {tp.size}?)")
    piece = slice_of(shard, full, tp)
    full_shape = expected[:d] + (full,) + expected[d + 1:]
    region, pad, n = m.region, None, piece.stop - piece.start
    if n < local:  # the vocab's padding rows on this rank
        if m.region.dim is not None:
            return problem("a vocab-parallel parameter cannot also be a fused shard")
        region = dataclasses.replace(m.region, dim=d, start=0, stop=n)
        pad = dataclasses.replace(m.region, dim=d, start=n, stop=local)
    return full_shape, piece, region, pad


def _missing_part(shape: tuple[int, ...], piece: Slice | None, tp: Parallel | None) -> str:
    """', so rank r's rows a:b are not in the checkpoint' when its slice lies past the tensor's end."""
    if piece is None or tp is None:
        return ""
    text = f" (rank {tp.rank} reads {piece} of the full tensor)"
    if len(shape) > piece.dim and piece.stop > shape[piece.dim]:
        text = f": rank {tp.rank}'s slice, {piece}, is not in the checkpoint"
    return text


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
