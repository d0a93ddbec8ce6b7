"""load(): fill a module (typically built on the meta device) from a checkpoint, strictly.

Parameters are allocated once on the target device and dtype; tensors stream one at a time, in file
order, into their destination slices. The module is touched only at the end, and only if every
check passed: after a LoadError it holds exactly what it held before.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch

from loader.mapping import Region
from loader.plan import DType, TieDecision, plan
from loader.problems import LoadError, Problem, SourceError
from loader.quant import nonfinite_blocks
from loader.rules import Rules
from loader.shard import Parallel
from loader.sources import Source, open_source


WORKERS = min(4, os.cpu_count() or 1)  # reader threads


@dataclass
class LoadReport:
    source: str
    tp: Parallel | None = None  # the rank this load filled, under tensor parallelism
    tensors: int = 0
    parameters: int = 0  # distinct tensors allocated (tied parameters count once)
    bytes: int = 0  # bytes read from the checkpoint (under tensor parallelism: this rank's slices)
    seconds: float = 0.0
    provenance: dict[str, list[tuple[str, str, Region]]] = field(default_factory=dict)  # param -> (key, file, region)
    ignored: list[tuple[str, str, str]] = field(default_factory=list)  # (key, file, reason)
    ties: list[TieDecision] = field(default_factory=list)
    # parameters and buffers the load left on the meta device: non-persistent buffers no checkpoint holds
    # (transformers' rotary inv_freq), derived from the config; materialize() computes them
    on_meta: list[str] = field(default_factory=list)
    quantized: dict[str, str] = field(default_factory=dict)  # param -> its blocks' layout, kept quantised

    def __str__(self) -> str:
        s = "" if self.tp is None or self.tp.size == 1 else f"rank {self.tp.rank} of {self.tp.size}: "
        s += (f"loaded {self.tensors} tensors ({self.bytes / 1e6:.1f} MB) into {self.parameters} parameters "
             f"in {self.seconds:.2f} s from {self.source}")
        if self.ignored:
            s += f"; {len(self.ignored)} ignored"
        if self.on_meta:
            s += f"; left on meta (materialize() them): {', '.join(self.on_meta)}"
        return "\n".join([s] + [f"  {t}" for t in self.ties])


def load(module: torch.nn.Module, source, rules: Rules = Rules(), *, dtype: DType = None,
         device="cpu", check_finite: bool = False, tp: Parallel | None = None,
         progress: Callable[[int, int], None] | None = None,
         allocate: Callable[[dict[str, tuple[torch.Size, torch.dtype]]], dict[str, torch.Tensor]] | None = None,
         ) -> LoadReport:
    """Load `source` (a Source, a directory, a file or a hub id) into `module`; raise LoadError listing
    every problem. dtype= casts floating-point tensors on purpose: one dtype for every floating-point parameter, or
    a mapping of parameter names to dtypes (e.g. bfloat16 matrices beside float32 norms; a name it lacks keeps the
    module's dtype). progress(bytes_done, bytes_total) is called after each tensor. tp=Parallel(rank, size):
    `module` has rank-local shapes and only this rank's slices (the rules' Shard specs) are read.
    allocate(shapes), given the parameters to store (name -> (shape, dtype)), may return the storage of some
    of them (a caller's layout, e.g. one buffer in reading order: the tensors are then read straight into it,
    never copied again); the rest get their own tensors."""
    t0 = time.perf_counter()
    source = open_source(source, strict=False)
    p = plan(module, source, rules, dtype=dtype, tp=tp)
    if p.problems:
        raise LoadError(p.problems, f"{_count(p.problems)}: {source.directory} does not fit "
                                    f"{type(module).__name__} (nothing was loaded)")
    device = torch.device(device)
    written = {e.param for e in p.entries}  # (a persistent buffer the checkpoint lacks keeps its value)
    stored = [n for n, o in p.owner.items() if n == o and (n in written or not p.params[n].buffer)]
    shapes = {n: _stored_shape(p, n) for n in stored}  # (a quantised parameter: its blocks' bytes, uint8)
    storage = _given(allocate, {n: shapes[n] for n in stored if not p.params[n].buffer}, device) \
        if allocate is not None else {}
    storage.update({n: torch.empty(shapes[n][0], dtype=shapes[n][1], device=device)
                    for n in stored if n not in storage})
    for name, pads in p.pads.items():  # vocab rows past the real vocabulary: no checkpoint's, zero
        for pad in pads:
            pad.view(storage[name]).zero_()
    report = LoadReport(str(source.directory), tp=tp, ignored=p.ignored, ties=p.ties, parameters=len(storage))
    total = sum(e.nbytes() for e in p.entries)
    problems: list[Problem] = []

    def read(e) -> tuple[int, int]:  # (bytes read, non-finite values); runs in a worker thread
        if e.quant is not None:  # its rows' blocks
            layout = p.quant[e.param]
            dest = layout.rows(storage[e.param], *((e.region.start, e.region.stop) if e.region.dim == 0
                                                   else (0, layout.shape[0])))
        else:
            dest = e.region.view(storage[e.param])
        bad = []  # the plain path's count: per piece as the source reads it, while the piece is in the cache
        try:
            if e.slice is not None and e.transform is None:  # this rank's rows (cols) only, narrowed before
                n = source.read_slice_into(e.key, dest, e.slice.dim, e.slice.start, e.slice.stop)  # anything is read
            elif e.transform is None:
                n = source.read_into(e.key, dest, each=(lambda part: bad.append(nonfinite(part)))
                                     if check_finite and e.quant is None else None)
            else:  # read in the checkpoint's layout (this rank's slice of it), rearranged into the parameter's
                shape = list(e.shape)
                if e.slice is not None:
                    shape[e.slice.dim] = e.slice.stop - e.slice.start
                held = torch.empty(shape, dtype=dest.dtype, device=dest.device)
                n = source.read_into(e.key, held) if e.slice is None else \
                    source.read_slice_into(e.key, held, e.slice.dim, e.slice.start, e.slice.stop)
                e.transform.write(held, dest)
        except OSError as err:  # the file changed or failed under us
            raise SourceError([Problem("file", e.key, e.file, None, f"{e.key} in {e.file} cannot be read "
                                       f"({err.strerror or type(err).__name__})")]) from None
        if not check_finite:
            return n, 0
        if e.quant is not None:
            return n, nonfinite_blocks(dest, e.quant) * e.quant.block
        return n, sum(bad) if e.slice is None and e.transform is None else nonfinite(dest)

    entries = sorted(p.entries, key=lambda e: source.order(e.key))
    # A few threads fault pages in parallel (the copies release the GIL); results are taken in order.
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        for e, (n, bad) in zip(entries, pool.map(read, entries)):
            report.bytes += n
            report.provenance.setdefault(e.param, []).append((e.key, e.file, e.region))
            if bad:
                problems.append(Problem("nonfinite", e.key, e.file, f"{e.param}{e.region}",
                                        f"{e.key} in {e.file} has {bad} NaN/Inf values (-> {e.param}{e.region})"))
            if progress is not None:
                progress(report.bytes, total)
    if problems:
        raise LoadError(problems, f"{_count(problems)} in {source.directory} (nothing was loaded)")
    report.tensors = len({e.key for e in entries})  # (a key read part by part, a "fused" Shard's, counts once)
    _swap_in(module, p, storage, device)
    report.on_meta = on_meta(module)
    report.quantized = {n: str(layout) for n, layout in p.quant.items()}
    report.seconds = time.perf_counter() - t0
    return report


def on_meta(module: torch.nn.Module) -> list[str]:
    """Names of the parameters and buffers of `module` that are on the meta device."""
    return [name for name, t in [*module.named_parameters(remove_duplicate=False),
                                 *module.named_buffers(remove_duplicate=False)] if t.is_meta]


def materialize(module: torch.nn.Module, *, device="cpu", init: Callable[[torch.nn.Module], None] | None = None
                ) -> list[str]:
    """Compute the buffers a load left on the meta device (LoadReport.on_meta): the derived ones, such as the
    rotary embedding's inv_freq that transformers' modules register as non-persistent and compute from the config.
    Returns their names; parameters still on meta (weights no checkpoint filled) are a ValueError naming them.

    For each submodule holding meta buffers: without `init`, a fresh copy of the submodule is built on `device`
    with its own constructor from its `config` attribute (transformers' rotary modules take the config) and its
    buffers are taken; with `init`, the buffers are allocated on `device` and `init(submodule)` fills them in
    place (for transformers: `init=model._init_weights`, its own rope initialisation). A submodule without a
    `config` and no `init` is a ValueError naming its buffers.

        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config)
        report = load(model, path)           # report.on_meta: ['model.rotary_emb.inv_freq', ...]
        materialize(model)                   # model(ids) now runs
    """
    device = torch.device(device)
    weights = [n for n, t in module.named_parameters(remove_duplicate=False) if t.is_meta]
    if weights:
        raise ValueError(f"materialize: {len(weights)} parameters are on the meta device ({', '.join(weights[:4])}"
                         f"{', ...' if len(weights) > 4 else ''}): weights come from a checkpoint (load()), "
                         f"not from materialize()")
    done = []
    for mod_name, mod in module.named_modules():
        leaves = [leaf for leaf, b in mod._buffers.items() if b is not None and b.is_meta]
        if not leaves:
            continue
        names = [f"{mod_name}.{leaf}" if mod_name else leaf for leaf in leaves]
        if init is not None:
            for leaf in leaves:
                mod._buffers[leaf] = torch.empty(mod._buffers[leaf].shape, dtype=mod._buffers[leaf].dtype,
                                                 device=device)
            init(mod)
        else:
            config = getattr(mod, "config", None)
            if config is None:
                raise ValueError(f"materialize: {', '.join(names)} on the meta device, and {type(mod).__name__} has no "
                                 f"`config` to rebuild it from: pass init= (a function that fills its buffers)")
            with torch.device(device):
                fresh = type(mod)(config)
            for leaf, name in zip(leaves, names):
                new = fresh._buffers.get(leaf)
                old = mod._buffers[leaf]
                if new is None or new.is_meta or new.shape != old.shape:
                    raise ValueError(f"materialize: {type(mod).__name__}({type(config).__name__}) built anew has "
                                     f"no {leaf} of shape {list(old.shape)} for {name}: pass init=")
                mod._buffers[leaf] = new.to(device=device, dtype=old.dtype)
        left = [n for leaf, n in zip(leaves, names) if mod._buffers[leaf].is_meta]
        if left:
            raise ValueError(f"materialize: init({type(mod).__name__}) left {', '.join(left)} on the meta device")
        done += names
    return done
def _stored_shape(p, name: str) -> tuple[torch.Size, torch.dtype]:
    """What a parameter is stored as: its shape and dtype, or for a quantised one its bytes (uint8 [bytes])."""
    if name in p.quant:
        return torch.Size([p.quant[name].nbytes]), torch.uint8
    return torch.Size(p.params[name].shape), p.dtypes[name]


def _given(allocate, shapes: dict, device: torch.device) -> dict[str, torch.Tensor]:
    """The storage allocate() returned, checked against what was asked (a caller's bug is a ValueError)."""
    given = dict(allocate(shapes))
    for n, t in given.items():
        if n not in shapes or (t.shape, t.dtype) != shapes[n] or t.device != device:
            raise ValueError(f"load(allocate=...) returned {n} as {t.dtype} {list(t.shape)} on {t.device}; "
                             f"asked for {shapes[n][1]} {list(shapes[n][0])} on {device}" if n in shapes else
                             f"load(allocate=...) returned {n}, which was not asked for")
    return given


def nonfinite(t: torch.Tensor) -> int:
    """How many NaN/Inf values t holds. One read-only pass (a sum: any NaN or Inf makes it non-finite); the
    exact count only when the sum is not finite (then it may also be finite values overflowing the sum).
    bfloat16 / float16 on the CPU: the sums of the rows, as a product with a vector of ones (torch's reduction
    with a float32 accumulator reads these dtypes at ~0.3 GB/s, its GEMV at the memory's speed: 30x faster)."""
    if not t.is_floating_point() or t.numel() == 0:
        return 0
    if t.dtype in (torch.bfloat16, torch.float16) and t.is_cpu and t.is_contiguous():
        rows = t.view(-1, t.shape[-1]) if t.dim() > 1 else t.view(1, -1)
        sums = torch.mv(rows, _ones(rows.shape[1], t.dtype))  # NaN / Inf in a row make its sum NaN / Inf
        if torch.isfinite(sums).all():
            return 0
    elif torch.isfinite(t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32)):
        return 0
    return int((~torch.isfinite(t)).sum())


_held_ones: dict = {}


def _ones(n: int, dtype: torch.dtype) -> torch.Tensor:
    key = (n, dtype)
    if key not in _held_ones:
        if len(_held_ones) > 64:
            _held_ones.clear()
        _held_ones[key] = torch.ones(n, dtype=dtype)
    return _held_ones[key]


def _swap_in(module: torch.nn.Module, p, storage: dict[str, torch.Tensor], device: torch.device) -> None:
    clash = [Problem("shape", None, None, name, f"{name} has shape {list(p.params[name].shape)} but would share "
                                                 f"{owner}'s tensor of shape {list(storage[owner].shape)}")
             for name, owner in p.owner.items() if owner in storage and owner not in p.quant
             and storage[owner].shape != p.params[name].shape]
    if clash:  # plan() refuses such ties; checked again before the module is touched
        raise LoadError(clash, f"{_count(clash)} tying parameters of {type(module).__name__} (nothing was loaded)")
    old = dict(module.named_parameters(remove_duplicate=False))
    new_params: dict[str, torch.nn.Parameter] = {}
    for name, owner in p.owner.items():
        if p.params[name].buffer:
            if owner in storage:
                _set(module, name, storage[owner], buffer=True)
            continue
        if owner not in new_params:
            t = storage[owner]
            was = old[owner]
            new = torch.nn.Parameter(t, requires_grad=was.requires_grad and t.is_floating_point())
            new.__dict__.update(was.__dict__)  # layer attributes such as shard_sizes
            new.__dict__.pop("quant", None)
            if owner in p.quant:  # uint8 bytes: the layer reads the layout (shape, types) from here
                new.quant = p.quant[owner]
            new_params[owner] = new
        _set(module, name, new_params[owner], buffer=False)
    for mod in module.modules():  # buffers the checkpoint does not hold follow the parameters
        for leaf, b in mod._buffers.items():
            if b is not None and not b.is_meta and b.device != device:
                mod._buffers[leaf] = b.to(device)


def _set(module: torch.nn.Module, name: str, value, *, buffer: bool) -> None:
    mod_name, _, leaf = name.rpartition(".")
    sub = module.get_submodule(mod_name) if mod_name else module
    (sub._buffers if buffer else sub._parameters)[leaf] = value


def _count(problems: list) -> str:
    return f"{len(problems)} problem{'s' * (len(problems) != 1)}"
