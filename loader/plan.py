"""plan(): the mapping of every checkpoint tensor onto the module, and every problem, from headers alone.

load() computes the same plan first and streams only when it is clean.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from loader.coverage import overlapping_pairs, unwritten, volume
from loader.mapping import Mapper, ParamInfo, Region
from loader.problems import Problem
from loader.rules import Rules, Transform
from loader.sources import Source, open_source


@dataclass(frozen=True)
class Entry:
    key: str
    file: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    param: str
    region: Region
    transform: Transform | None = None  # the key holds the parameter in this layout


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


def plan(module: torch.nn.Module, source, rules: Rules = Rules(), *, dtype: torch.dtype | None = None) -> Plan:
    source = open_source(source, strict=False)
    rules = rules + source.rules
    params, groups = module_params(module)
    mapper = Mapper(rules, params)
    out = Plan(source, problems=list(source.problems), params=params)
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
        if tuple(info.shape) != expected:
            out.problems.append(Problem("shape", key, info.file, where,
                f"{key} in {info.file} has shape {list(info.shape)} but {where} expects {list(expected)}"))
        dst = dest_dtype(p, dtype)
        on_purpose = dtype is not None and info.dtype.is_floating_point and dst.is_floating_point
        if not on_purpose and lossy(info.dtype, dst):  # dtype= casts floats to floats, nothing else
            out.problems.append(Problem("dtype", key, info.file, where,
                f"{key} in {info.file} is {_dt(info.dtype)} but {m.name} is {_dt(dst)}: a lossy cast "
                + ("(dtype= casts floating-point to floating-point only)" if dtype is not None
                   else "(pass dtype= to load() to cast on purpose)")))
        out.entries.append(Entry(key, info.file, tuple(info.shape), info.dtype, m.name, m.region, m.transform))
        writes.setdefault(m.name, []).append((m.region.box(p.shape), key, info.file, m.region))

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
    for name, p in params.items():
        out.dtypes[name] = dest_dtype(p, dtype)
        if out.owner[name] == name:
            out.problems += _coverage(name, p, writes.get(name, []), mapper)
    return out


def module_params(module: torch.nn.Module) -> tuple[dict[str, ParamInfo], list[list[str]]]:
    """Every parameter and persistent buffer by name, and the groups of names that share one tensor."""
    params: dict[str, ParamInfo] = {}
    by_id: dict[int, list[str]] = {}
    for name, t in module.named_parameters(remove_duplicate=False):
        sizes = getattr(t, "shard_sizes", None)
        params[name] = ParamInfo(tuple(t.shape), t.dtype, tuple(sizes) if sizes else None, meta=t.is_meta)
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


def dest_dtype(p: ParamInfo, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a parameter is allocated with: load(dtype=) applies to floating-point parameters only."""
    return dtype if dtype is not None and p.dtype.is_floating_point else p.dtype


def _tie_clash(name: str, src: str, params: dict[str, ParamInfo], dtype: torch.dtype | None) -> Problem | None:
    """A tie needs one tensor that fits both parameters: the same shape and the same dtype."""
    a, b = params[name], params[src]
    if a.shape != b.shape:
        return Problem("shape", None, None, name, f"{name} has shape {list(a.shape)} but {src}, which it would be "
                                                  f"tied to, has shape {list(b.shape)}: they cannot share one tensor")
    da, db = dest_dtype(a, dtype), dest_dtype(b, dtype)
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
