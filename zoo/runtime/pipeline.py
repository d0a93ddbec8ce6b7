"""Pipeline parallelism: the decoder layers split into contiguous stages, one process each (gloo on the CPU).

    group = PipelineGroup(path, size, dtype=torch.float32)   # spawns stages 1.., each loads only its tensors
    engine = LLMEngine(group.model, group.config, ...)      # rank 0 is stage 0: scheduler, sampler, its layers
    group.attach(engine)
    ...
    group.close()

Shape legend: T = tokens of the step    H = hidden size    N = rows whose logits are sampled    V = vocab size

The layout, from the model itself (no plugin declares one): the decoder layers are the one ModuleList whose modules
carry `layer_idx` 0..L-1; stage s holds layers ranges[s] (contiguous, the first stages one more where L does not
split evenly). Outside the layers, the siblings of the layer list that are embeddings or registered before it, and
every module outside the text model but the head (a vision tower, a projector), are stage 0's; the other siblings
registered after the list (the final norm) and the LMHead are the last stage's; a module sharing a parameter with
one a stage holds is held too (tied embeddings: the last stage reads embed_tokens for its head).

A stage's model is the whole model with the other stages' modules swapped for parameter-free stand-ins, so the
plugin's own forward runs unchanged: a layer of another stage passes its input through, except the one just before
the stage's first layer, which receives the previous stage's hidden states [T, H] (dist.recv), and the one just
after its last layer, which sends them on (dist.isend); another stage's embedding gives zeros [T, H], its final norm
passes through, its head or vision tower raises if called. The loader reads only the stage's tensors: every other
checkpoint key is an Ignore naming the stage that reads it, so each stage's load stays strict, and `plan_stages`
(`zoo inspect --pipeline-parallel-size N`) proves each key read by exactly one stage, or by the stages that share it.

The runtime: rank 0 (stage 0) schedules and samples. Each step is cut into micro-batches of about equal tokens
(`micro_batches`: as many as the stages by default, none under MIN_MICRO_TOKENS tokens; a request may be cut in two,
like a chunked prefill's chunks),
all sent to every stage in one message on the control group. Stage 0 runs them in order, sending each one's hidden
states on without waiting (dist.isend), so stage s runs micro-batch m while stage s - 1 runs m + 1; the last stage
runs the final norm and the head on each micro-batch's logits rows and sends the logits [N, V] to rank 0, which
posted its receives before the step began. A step of M micro-batches over S stages takes about (M + S - 1) / M
stage-steps, not S: the overlap. Each stage holds the KV cache and the recurrent states of its own layers, indexed
by rank 0's block tables and state slots (rank 0's snapshot saves / restores are sent with the step).

With tensor parallelism (tp ranks a stage, world = stages x tp, a stage's ranks consecutive): each rank holds its
slices of its stage's layers (the tensor-parallel model, split as above), and its tensor-parallel layers talk within
the stage's group (zoo.layers.parallel.GROUP). Every rank of a stage holds the whole hidden states after each layer,
so rank (s, t) sends to (s + 1, t); the last stage's ranks gather the logits and its rank (S - 1, 0) sends them; a
vision tower split over stage 0's ranks runs on each of them (an "encode" message, as tensor parallelism alone).
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

import loader
from zoo.layers.embedding import LMHead, VocabEmbedding
from zoo.runtime.batch import ForwardBatch
from zoo.runtime.distributed import (BATCH_FIELDS, INIT_TIMEOUT, Peak, TensorParallelError,
                                     TensorParallelGroup, _check_layout, _init, _Pool, _set_timeout, _stats, launched,
                                     orders, pools, run_worker)
from zoo.runtime.scheduler import ScheduledRequest, SchedulerOutput


# seconds a stage waits for the hidden states of the stage before it, and rank 0 for the logits: a stage runs its
# layers while the next waits, and a prefill chunk through a large model's share of layers may take minutes on a
# CPU (a stage that dies is seen at once, when its connection drops)
STAGE_TIMEOUT = 600.0

# the fewest tokens a micro-batch is cut to: below it a stage's matmuls are bound by reading its weights, which each
# micro-batch reads again, so cutting costs more than the stages' overlap gains (bench/pipeline.py)
MIN_MICRO_TOKENS = 32


@dataclass(frozen=True)
class Stage:
    """Pipeline stage `index` of `size`; under pipeline x tensor parallelism, tensor-parallel rank `tp_rank` of the
    stage's `tp_size` ranks. Global rank = index * tp_size + tp_rank: a stage's ranks are consecutive."""
    index: int
    size: int
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self):
        if self.size < 1 or not 0 <= self.index < self.size:
            raise ValueError(f"pipeline stage {self.index} of {self.size}: expected 0 <= stage < size >= 1")
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tensor parallel rank {self.tp_rank} of {self.tp_size}: expected 0 <= rank < size")

    @property
    def last(self) -> bool:
        return self.index == self.size - 1

    def rank_of(self, index: int) -> int:
        """The global rank of stage `index`'s process that holds this process's tensor-parallel part."""
        return index * self.tp_size + self.tp_rank


def stage_ranges(num_layers: int, size: int) -> list[range]:
    """Contiguous layer ranges, one per stage, the first num_layers % size of them one layer longer."""
    if num_layers < size:
        raise ValueError(f"pipeline parallel size {size}: the model has {num_layers} decoder layers, fewer than the "
                         f"stages")
    base, extra = divmod(num_layers, size)
    starts = [s * base + min(s, extra) for s in range(size + 1)]
    return [range(starts[s], starts[s + 1]) for s in range(size)]


def decoder_layers(model: nn.Module) -> str:
    """The name of the model's decoder layer list: the one ModuleList whose modules carry layer_idx 0..L-1."""
    found = [name for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)
             and all(getattr(layer, "layer_idx", None) == i for i, layer in enumerate(m))]
    if len(found) != 1:
        raise ValueError(f"{type(model).__name__} has no pipeline-parallel layout: expected one list of decoder "
                         f"layers (modules with layer_idx 0..L-1), found {found or 'none'}")
    return found[0]


def _parts(model: nn.Module, layers: str) -> dict[str, str]:
    """Module name -> "first" or "last" for the modules outside the decoder layers that hold tensors."""
    path = layers.split(".")
    out = {}
    for depth, step in enumerate(path):
        parent_name = ".".join(path[:depth])
        parent = model.get_submodule(parent_name)
        after = False
        for name, child in parent.named_children():
            if name == step:
                after = True
                continue
            if next(child.parameters(), None) is None and next(child.buffers(), None) is None:
                continue
            full = f"{parent_name}.{name}" if parent_name else name
            if depth == len(path) - 1:  # siblings of the layers in the text model: embeddings, and the final norm
                out[full] = "last" if after and not isinstance(child, VocabEmbedding) else "first"
            else:  # outside the text model: the head, and what feeds the embeddings (a vision tower, a projector)
                out[full] = "last" if isinstance(child, LMHead) else "first"
    return out


def homes(model: nn.Module, size: int) -> dict[str, set[int]]:
    """Every parameter and persistent buffer name -> the stages that hold it (a tied one: every sharer's stage)."""
    layers = decoder_layers(model)
    ranges = stage_ranges(len(model.get_submodule(layers)), size)
    stage_of = {i: s for s, r in enumerate(ranges) for i in r}
    parts = _parts(model, layers)
    tensors = list(model.named_parameters(remove_duplicate=False)) + \
        [(f"{m}.{b}" if m else b, t) for m, mod in model.named_modules(remove_duplicate=False)
         for b, t in mod._buffers.items() if t is not None and b not in mod._non_persistent_buffers_set]
    out: dict[str, set[int]] = {}
    for name, _ in tensors:
        if name.startswith(layers + "."):
            out[name] = {stage_of[int(name[len(layers) + 1:].split(".")[0])]}
            continue
        part = next((p for p in parts if name.startswith(p + ".")), None)
        if part is None:
            raise ValueError(f"{type(model).__name__}: {name} is neither in a decoder layer nor in a module beside "
                             f"them; no pipeline stage holds it")
        out[name] = {0} if parts[part] == "first" else {size - 1}
    by_id: dict[int, list[str]] = {}
    for name, t in tensors:
        by_id.setdefault(id(t), []).append(name)
    for names in by_id.values():  # one tensor under several names (tied): held wherever one of them is
        shared = set().union(*(out[n] for n in names))
        for n in names:
            out[n] = shared
    return out


class _Handoff(nn.Module):
    """Decoder layer `index` of another stage: passes the hidden states through; the one just before this stage's
    layers receives them from the previous stage, the one just after sends them to the next (without waiting: the
    stage goes on to its next micro-batch; `wait()` at the step's end)."""

    def __init__(self, index: int, *, recv_from: int | None = None, send_to: int | None = None):
        super().__init__()
        self.index, self.recv_from, self.send_to = index, recv_from, send_to
        self.sending: list = []  # (the send, its tensor): the tensor is kept alive until the send completes

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, batch) -> torch.Tensor:
        if self.send_to is not None:
            out = hidden_states.float().contiguous()  # [T, H]
            self.sending.append((dist.isend(out, self.send_to), out))
        if self.recv_from is not None:
            hidden_states = torch.empty(hidden_states.shape, dtype=torch.float32)  # [T, H]
            dist.recv(hidden_states, self.recv_from)
        return hidden_states

    def wait(self) -> None:
        for work, _ in self.sending:
            work.wait()
        self.sending.clear()


def handoffs(model: nn.Module) -> list[_Handoff]:
    """The stand-ins of a stage's model that send (found once after the split, waited on every step)."""
    return [m for m in model.modules() if isinstance(m, _Handoff) and m.send_to is not None]


class _Zeros(nn.Module):
    """Another stage's embedding: zeros [T, H] (the hidden states arrive before this stage's first layer)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.hidden_size = hidden_size

    def forward(self, ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return torch.zeros(ids.shape[0], self.hidden_size)  # [T] -> [T, H]


class _Through(nn.Module):
    """Another stage's final norm: its input, unchanged."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return x


class _Absent(nn.Module):
    """A module another stage holds and this one never runs (a head, a vision tower)."""

    def __init__(self, name: str, stage: int):
        super().__init__()
        self.name, self.stage = name, stage

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"{self.name} is held by pipeline stage {self.stage}; this stage does not run it")


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent), leaf, new)


def split(model: nn.Module, source, rules: loader.Rules, stage: Stage, tp: loader.Parallel | None = None
          ) -> loader.Rules:
    """Make `model` (on meta, whole, or a tensor-parallel rank's `tp`) stage `stage`'s, in place; returns `rules` plus
    an Ignore, naming the stages that read them, for every checkpoint key this stage does not read (mapped by the
    whole model's plan)."""
    held = homes(model, stage.size)
    full = loader.plan(model, source, rules, tp=tp)
    stages_of: dict[str, set[int]] = {}
    for e in full.entries:
        stages_of.setdefault(e.key, set()).update(held[e.param])
    others: dict[tuple[int, ...], list[str]] = {}
    for key, stages in stages_of.items():
        if stage.index not in stages:
            others.setdefault(tuple(sorted(stages)), []).append(key)
    ignores = tuple(loader.Ignore("^(?:" + "|".join(re.escape(k) for k in keys) + ")$",
                                  f"pipeline stage {', '.join(map(str, s))} of {stage.size} reads it")
                    for s, keys in others.items())
    layers = decoder_layers(model)
    mine = stage_ranges(len(model.get_submodule(layers)), stage.size)[stage.index]
    for i in range(len(model.get_submodule(layers))):
        if i not in mine:
            _swap(model, f"{layers}.{i}", _Handoff(
                i, recv_from=stage.rank_of(stage.index - 1) if i == mine.start - 1 else None,
                send_to=stage.rank_of(stage.index + 1) if i == mine.stop else None))
    for name, side in _parts(model, layers).items():
        module = model.get_submodule(name)
        keep = any(stage.index in held[f"{name}.{p}"] for p, _ in module.named_parameters(remove_duplicate=False))
        if keep or (side == "first" and stage.index == 0) or (side == "last" and stage.last):
            continue
        if isinstance(module, VocabEmbedding):
            _swap(model, name, _Zeros(module.hidden_size))
        elif side == "last" and not isinstance(module, LMHead):
            _swap(model, name, _Through())
        else:
            _swap(model, name, _Absent(name, 0 if side == "first" else stage.size - 1))
    return rules + loader.Rules(ignores=ignores)


@dataclass
class StagePlans:
    plans: list  # loader.Plan per stage
    ranges: list[range]  # the decoder layers of each stage
    holds: list[list[str]]  # the modules besides the decoder layers each stage reads (embeddings, a tower, head)
    replicated: dict[str, list[int]]  # key -> the stages that read it (tied parameters)
    problems: list  # loader.Problem: a stage that does not plan, a key no stage reads

    def bytes(self, stage: int) -> int:
        return sum(e.nbytes() for e in self.plans[stage].entries)


def plan_stages(build, source, size: int) -> StagePlans:
    """Every stage's plan, in this process (nothing spawned), and the proof that each checkpoint key is read by
    exactly the stages that hold its parameter: one, or those sharing a tied one; a key that no stage reads and no
    rule ignores is a problem. `build()` gives a fresh (whole model on meta, rules) each call."""
    source = loader.open_source(source, strict=False)
    plans, ranges = [], None
    for s in range(size):
        model, rules = build()
        if ranges is None:
            layers = decoder_layers(model)
            ranges, parts = stage_ranges(len(model.get_submodule(layers)), size), list(_parts(model, layers))
            held = homes(model, size)
            expected: dict[str, set[int]] = {}
            for e in loader.plan(model, source, rules).entries:
                expected.setdefault(e.key, set()).update(held[e.param])
        plans.append(loader.plan(model, source, split(model, source, rules, Stage(s, size))))
    holds = [[m for m in parts if any(e.param.startswith(m + ".") for e in p.entries)] for p in plans]
    out = StagePlans(plans, ranges, holds, {}, [q for p in plans for q in p.problems])
    if out.problems:
        return out
    readers: dict[str, set[int]] = {}
    for s, p in enumerate(plans):
        for e in p.entries:
            readers.setdefault(e.key, set()).add(s)
    ignored = {k for k, _, reason in plans[0].ignored if not reason.startswith("pipeline stage")}
    for key in source.keys():
        got, want = readers.get(key, set()), expected.get(key, set())
        if key in ignored:
            continue
        info = source.info(key)
        if not got:
            out.problems.append(loader.Problem("missing", key, info.file, None,
                                               f"{key} in {info.file} is read by no pipeline stage of {size}"))
        elif got != want:
            out.problems.append(loader.Problem("duplicate", key, info.file, None, f"{key} in {info.file} is read by "
                                               f"stages {sorted(got)}, expected {sorted(want)}"))
        elif len(got) > 1:
            out.replicated[key] = sorted(got)
    return out


# -- the runtime -----------------------------------------------------------------------------------------------

# the ForwardBatch fields every stage reads: the tensor-parallel step's (state slots, M-RoPE positions) but the
# image rows, merged into the hidden states on stage 0
STEP_FIELDS = tuple(f for f in BATCH_FIELDS if f not in ("mm_positions", "mm_embeds"))


def micro_batches(scheduled: list[ScheduledRequest], count: int) -> list[list[ScheduledRequest]]:
    """The step's spans as `count` micro-batches of about equal tokens (fewer when the step has fewer tokens), in
    order. A request cut between two micro-batches is two spans, the first computing its tokens before the second,
    as a chunked prefill's chunks do (every stage runs the micro-batches in order); only the second samples."""
    total = sum(s.num_new_tokens for s in scheduled)
    count = max(1, min(count, total))
    ends = [total * (k + 1) // count for k in range(count)]  # each micro-batch's end in the step's tokens
    out: list[list[ScheduledRequest]] = [[] for _ in range(count)]
    k = filled = 0
    for s in scheduled:
        start, left = s.num_computed_tokens, s.num_new_tokens
        while left:
            if filled == ends[k]:
                k += 1
            take = min(left, ends[k] - filled)
            out[k].append(ScheduledRequest(s.request, take, start))
            start, left, filled = start + take, left - take, filled + take
    return out


def check_stages(path, size: int) -> None:
    """A model that cannot split into `size` stages, said (ValueError naming the model) before anything spawns."""
    from registry import get_registry
    from zoo.runtime.model_files import config_at

    config = config_at(path)
    spec = get_registry().resolve(config)
    with torch.device("meta"):
        model = spec.build(config)
    try:
        stage_ranges(len(model.get_submodule(decoder_layers(model))), size)
    except ValueError as e:
        raise ValueError(f"{path} ({spec.architectures[0]}): {e}") from None


def _stage_of(rank: int, world: int, tp: int) -> Stage:
    """This rank's stage (a pipeline of world / tp stages of tp ranks each), after joining its stage's tensor-parallel
    group when tp > 1 (every rank creates every stage's group, in stage order, as torch.distributed asks)."""
    stage = Stage(rank // tp, world // tp, rank % tp, tp)
    if tp > 1:
        from zoo.layers import parallel

        for s in range(stage.size):
            group = dist.new_group([s * tp + t for t in range(tp)], backend="gloo")
            if s == stage.index:
                parallel.GROUP = group
    return stage


def _load_stage(path, stage: Stage, dtype: torch.dtype):
    """((model, config, spec, report) of this rank, the logits' width, the (KV cache specs, state specs) of the
    ranks that cost the most per token and per request); every rank learns every rank's outcome."""
    from zoo.build import build_model
    from zoo.layers.parallel import ParallelLMHead
    from zoo.runtime.kv_cache import bytes_per_token, cache_specs
    from zoo.runtime.state_pool import bytes_per_request, state_specs

    try:
        tp = loader.Parallel(stage.tp_rank, stage.tp_size) if stage.tp_size > 1 else None
        built = build_model(path, dtype=dtype, stage=stage, tp=tp)
        heads = [m.full_vocab if isinstance(m, ParallelLMHead) else m.weight.shape[0] for m in built[0].modules()
                 if isinstance(m, LMHead)]
        said = (None, cache_specs(built[0]), state_specs(built[0]), heads[0] if heads else 0)
    except Exception as e:  # noqa: BLE001 - said by rank 0, naming this rank
        built, said = None, (f"{type(e).__name__}: {e}", {}, {}, 0)
    every = [None] * (stage.size * stage.tp_size)
    dist.all_gather_object(every, said)
    bad = [(r, e) for r, (e, *_) in enumerate(every) if e is not None]
    if bad:
        raise TensorParallelError("; ".join(f"pipeline parallel rank {r} (stage {r // stage.tp_size} of {stage.size}) "
                                            f"could not load {path}: {e}" for r, e in bad))
    kv = max((s[1] for s in every), key=bytes_per_token)  # (one rank's pool must not outgrow the budget)
    states = max((s[2] for s in every), key=bytes_per_request)  # (and the slots exist if any stage has states)
    return built, every[-1][3], (kv, states)


def _serve_stage(rank: int, world: int, path: str, dtype: torch.dtype, ctl, tp: int = 1) -> None:
    """A stage's loop (ranks > 0; `tp` ranks a stage): load its layers' tensors (its slices of them), then run rank
    0's steps until it says stop."""
    from zoo.runtime.state_pool import apply_copies

    stage = _stage_of(rank, world, tp)
    peak = Peak()
    (model, _, _, report), _, _ = _load_stage(path, stage, dtype)
    senders = handoffs(model)
    _set_timeout(STAGE_TIMEOUT)
    caches, states, snapshots = {}, {}, {}
    for step in orders(ctl):
        op = step["op"]
        if op == "forward":
            apply_copies(step["copies"], states, snapshots)  # rank 0's snapshot saves / restores, in order
            sending = []
            with torch.inference_mode():
                for micro in step["micro"]:  # in order: a request cut in two computes its first span first
                    batch = ForwardBatch(kv_caches=caches, ssm_states=states, **micro["batch"])
                    hidden = model(micro["input_ids"], micro["positions"], batch)  # [T, H] (the last's: normed)
                    if stage.last and len(batch.logits_indices):
                        logits = model.compute_logits(hidden[batch.logits_indices]).float().contiguous()  # [N, V]
                        if stage.tp_rank == 0:  # (the stage's ranks gathered the same logits)
                            sending.append(dist.isend(logits, 0))
            for handoff in senders:
                handoff.wait()
            for work in sending:
                work.wait()
        elif op == "encode" and stage.index == 0:  # a vision tower split over stage 0's ranks: join rank 0's run
            with torch.inference_mode():
                model.encode_images(step["items"])
        elif op == "caches":
            caches, states, snapshots = pools(model, step)  # this stage's layers, in rank 0's blocks and slots
        elif op == "stats":
            dist.all_gather_object([None] * world, _stats(rank, report, peak))


class PipelineGroup(TensorParallelGroup):
    """Rank 0's side: stage 0's model, the other ranks (spawned, or launched by torchrun), their group; `tp` ranks a
    stage under pipeline x tensor parallelism. Errors, close() and rank_stats() are the tensor-parallel group's."""
    what = "pipeline parallel"

    def __init__(self, path, size: int, *, dtype: torch.dtype = torch.float32, micro_batches: int | None = None,
                 tp: int = 1):
        if size < 2:
            raise ValueError(f"pipeline_parallel_size={size}: a pipeline needs 2 or more stages")
        if micro_batches is not None and (not isinstance(micro_batches, int) or micro_batches < 1):
            raise ValueError(f"micro_batches={micro_batches!r}: expected an int >= 1")
        if not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size={tp!r}: expected an int >= 1")
        world = size * tp
        self.size, self.closed, self.pool, self.roll = world, True, None, None  # (size: every rank, for the group)
        # a step's micro-batches: `micro`, fewer where each would have under `min_tokens` tokens (a decode step of a
        # few requests stays whole: its stages stream their weights once, not once per micro-batch)
        self.micro, self.min_tokens = micro_batches or size, MIN_MICRO_TOKENS
        env = launched()
        if env is not None and env != (0, world):
            raise TensorParallelError(f"pipeline parallel size {size} x tensor parallel size {tp} is {world} ranks, "
                                      f"but the launcher started this process as rank {env[0]} of {env[1]} (RANK / "
                                      f"WORLD_SIZE in the environment)")
        check_stages(path, size)  # a model that cannot split is said before anything spawns
        if tp > 1:
            _check_layout(path, tp)
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialised in this process: one parallel LLM at a time "
                               "(close() the other first)")
        try:
            if env is not None:  # torchrun: every rank is already running; join them
                self.ctl, self.roll = _init(0, world, None, INIT_TIMEOUT)
            else:
                self.pool = _Pool(world, path, dtype, serve=partial(_serve_stage, tp=tp))
                self.ctl, self.roll = self.pool.ctl, self.pool.roll
            self.closed = False
            self.stage = self._guard(_stage_of, 0, world, tp)
            self.peak = Peak()
            built, self.vocab, self.pool_specs = self._guard(_load_stage, path, self.stage, dtype)
            self.model, self.config, self.spec, self.load_report = built
            self.senders = handoffs(self.model)
        except BaseException:
            self.close()
            raise
        _set_timeout(STAGE_TIMEOUT)
        self.hooked, self.copies, self.in_step = False, [], False

    def attach(self, engine) -> None:
        """Size every stage's caches as the engine's pool (KV blocks, state slots and snapshots); run each step as
        micro-batches through the stages, taking the logits from the last one."""
        runner = self.runner = engine.runner
        runner.fused = None  # stage 0's layers run as modules, between the stand-ins that pass the hidden states on
        tp = f" of {self.stage.tp_size} tensor-parallel ranks each" if self.stage.tp_size > 1 else ""
        runner.step_path = f"module path (pipeline parallel over {self.stage.size} stages{tp}, up to {self.micro} " \
                           f"micro-batches a step)"
        slots, snapshots = engine.kv.state_slots, engine.kv.state_snapshots
        self._guard(self._send, {"op": "caches", "num_blocks": engine.kv.pool.num_blocks,
                                 "block_size": runner.block_size,
                                 "state_slots": slots.num_slots if slots is not None else 0,
                                 "state_snapshots": snapshots.num_snapshots if snapshots is not None else 0})
        if snapshots is not None:  # the saves / restores the runner runs on stage 0's states go to every stage
            drain = snapshots.drain

            def drained():
                copies = drain()
                self.copies += copies
                return copies

            snapshots.drain = drained
        if not self.hooked:
            self.hooked = True
            self.model.register_forward_pre_hook(self._outside_step)
            if self.stage.tp_size > 1 and callable(getattr(self.model, "encode_images", None)):
                encode = self.model.encode_images

                def encode_images(items):  # the tower is split over stage 0's ranks: they join each run
                    self._send({"op": "encode", "items": items})
                    return encode(items)

                self.model.encode_images = encode_images
        execute = runner.execute

        def guarded(*args, **kwargs):  # a failing send / recv inside the step becomes an error naming the rank
            return self._guard(execute, *args, **kwargs)

        runner.execute = guarded
        runner.forward_logits = self._forward_logits

    def _forward_logits(self, out: SchedulerOutput, kv) -> tuple[torch.Tensor | None, dict]:
        """The runner's forward_logits over the stages: the step cut into micro-batches, all sent to the stages in
        one message; stage 0 runs each and sends its hidden states on without waiting, so stage s runs micro-batch
        m while stage s - 1 runs m + 1; the last stage's logits for each arrive here. The logits [N + P, V] are laid
        out as one process's (every sampled row, then every prompt-logprob row)."""
        runner = self.runner
        t0 = time.perf_counter()
        parts, targets = [], []
        tokens = sum(s.num_new_tokens for s in out.scheduled)
        for scheduled in micro_batches(out.scheduled, min(self.micro, max(1, tokens // self.min_tokens))):
            sub = SchedulerOutput(scheduled)
            step = runner.plan(sub, kv)  # (the first one drains the step's snapshot copies into self.copies)
            targets += runner.prompt_targets
            parts.append((sum(s.samples for s in scheduled), runner.tensors(step, sub, kv)))
        runner.prompt_targets = targets
        copies, self.copies = self.copies, []
        fields = STEP_FIELDS if self.stage.tp_size == 1 else BATCH_FIELDS  # (stage 0's other ranks merge the images)
        self._send({"op": "forward", "copies": copies, "micro": [
            {"input_ids": ids, "positions": pos, "batch": {f: getattr(batch, f) for f in fields}}
            for _, (ids, pos, batch) in parts]})
        logits = [torch.empty(len(batch.logits_indices), self.vocab) for _, (_, _, batch) in parts]  # [N_m + P_m, V]
        last = self.stage.rank_of(self.stage.size - 1)
        recvs = [dist.irecv(x, last) for x in logits if len(x)]
        t1 = time.perf_counter()
        self.in_step = True
        try:
            with torch.inference_mode():
                for _, (ids, pos, batch) in parts:
                    self.model(ids, pos, batch)  # [T_m, H], sent on to stage 1 by the stand-in after stage 0's layers
        finally:
            self.in_step = False
        for handoff in self.senders:
            handoff.wait()
        for work in recvs:
            work.wait()
        t2 = time.perf_counter()
        rows = [x[:n] for (n, _), x in zip(parts, logits)] + [x[n:] for (n, _), x in zip(parts, logits)]
        return torch.cat(rows) if sum(map(len, rows)) else None, dict(
            prepare=t1 - t0, forward=t2 - t1, logits=0.0, requests=len(out.scheduled),
            tokens=tokens, micro_batches=len(parts))

    def _outside_step(self, module, args) -> None:
        if not self.in_step:
            raise RuntimeError(f"stage 0 of a {self.stage.size}-stage pipeline runs its model only inside an engine step "
                               f"(the stages take the step's micro-batches from it); use the LLM / engine")

    def close(self, keep: bool = True) -> None:
        from zoo.layers import parallel

        super().close(keep=False)  # (stage workers serve no tensor-parallel group: never kept for one)
        parallel.GROUP = None  # (its stage's group is gone with the others: a later model talks to the default one)


def run_stage(path, *, dtype: torch.dtype = torch.float32, tp: int = 1) -> int:
    """A launched rank > 0 (torchrun) of a pipeline (`tp` ranks a stage): serve its part of `path` until rank 0
    closes; the exit status."""
    return run_worker(path, dtype=dtype, serve=partial(_serve_stage, tp=tp))
