"""Tensor parallelism on torch.distributed: this process is rank 0 and runs the engine (scheduler, sampler);
ranks 1..N-1 are workers that run the same forward on their own slices every step.

    group = TensorParallelGroup(path, size, dtype=torch.float32)   # spawns, joins gloo, loads rank 0's slices
    engine = LLMEngine(group.model, group.config, ...)
    group.attach(engine)    # the workers allocate their KV caches (their heads only); each step is mirrored
    ...
    group.close()

Launch: by default rank 0 spawns the workers (torch.multiprocessing, a free port on 127.0.0.1). Under `torchrun`
(RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT in the environment) nothing is spawned: every process joins the
launched group (env://), rank 0 runs the command and the others call `run_worker(path)` (zoo run does; an LLM
built on a rank > 0 does too, and ends the process when rank 0 closes).

Each rank loads only its slices (loader Shard rules). Rank 0 tells the workers what to do on a control group
whose wait never times out (a worker may idle between requests for as long as rank 0 does): "caches" (a pool
of the engine's shape, its heads only; a hybrid model's recurrent state slots and snapshots as many as rank 0's,
each holding its heads' / channels' states), "forward" (the step's metadata: token ids, positions, slots, block
tables; a hybrid's state slots and the snapshot saves / restores rank 0 ran before the step, run on the worker's
own states first; a multimodal step's image features and M-RoPE positions), "encode" (the images rank 0's encoder
cache missed: a vision tower split by heads runs on every rank, its all-reduces joined; the features that the
step merges then travel with "forward", so only rank 0 keeps an encoder cache), "logits" (the hidden rows rank 0
takes the head of), "load" / "release" (a kept pool, below), "stop".
The row-parallel sums and the vocab gathers (zoo/layers/parallel.py) are collectives of the default group,
each with a timeout. Sampling happens on rank 0 only.

Across machines (torchrun --nnodes N, gloo over TCP): a rank that dies ends the run with an error naming its rank
and host (`Roll`: every rank's host and pid gathered at init; each worker beats in the group's TCP store and says
why before it leaves on its own, so rank 0 tells the rank that died from those that stopped after it).

`shared_workers()` keeps spawned workers up across groups of one size (each group loads its own model on them):
one spawn for many models, as the tests use it.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from loader import Parallel
from zoo.runtime.batch import ForwardBatch

INIT_TIMEOUT = 120.0  # seconds for every rank to start, join and load (spawned interpreters import torch)
STEP_TIMEOUT = 20.0  # seconds a collective waits for the other ranks (a dead rank is usually seen at once)
JOIN_TIMEOUT = 10.0  # seconds a worker gets to exit after close()
IDLE_TIMEOUT = datetime.timedelta(days=365)  # a worker waiting for rank 0's next step: as long as rank 0 idles
BEAT = 0.25  # seconds between a worker's heartbeats in the group's store
STALE = 1.5  # after a failed collective, a worker whose heartbeat does not move for this long is taken for dead
BATCH_FIELDS = ("query_start_loc", "seq_lens", "positions", "slot_mapping", "block_tables", "logits_indices",
                "block_size", "query_start_loc_cpu", "seq_lens_cpu", "num_tokens_cpu",
                "state_indices", "state_indices_cpu", "has_initial_state_cpu",  # hybrid SSM: each request's slot
                "mm_positions", "mm_embeds", "mrope_positions")  # multimodal: the step's image rows, M-RoPE


class TensorParallelError(RuntimeError):
    """A rank failed: its number, and what it said (or how it died)."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched() -> tuple[int, int] | None:
    """(rank, world size) when a launcher (torchrun) started this process as one rank of a group, else None."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return None
    try:
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except ValueError:
        raise TensorParallelError(f"RANK={os.environ['RANK']!r} / WORLD_SIZE={os.environ['WORLD_SIZE']!r} in the "
                                  f"environment are not integers") from None
    return (rank, size) if size > 1 else None


def _init(rank: int, size: int, port: int | None, seconds: float):
    """Join the default group (tcp on 127.0.0.1:port, or env:// for a launcher); returns (the control group, the
    group's Roll)."""
    timeout = datetime.timedelta(seconds=seconds)
    if port is None:
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=size, timeout=timeout)
        addr = (os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "0")))
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                                timeout=timeout)
        addr = ("127.0.0.1", port)
    ctl = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return ctl, Roll(rank, size, addr)


class Roll:
    """Who each rank is and which still live, for naming a rank that died on whichever machine it ran.

    At init every rank says its host name and pid (an all-gather). Each worker then adds 1 to its key in the
    group's TCP store (the one the group met at: rank 0's, or torchrun's agent's) every BEAT seconds from a daemon
    thread, and writes why before it leaves on its own: a failed collective, or its launcher's SIGTERM (torchrun
    stops every rank of a node when one of them dies; the thread takes the signal, so it is said even while the
    main thread waits inside a collective). After a failed collective, rank 0 reads the beats twice, STALE seconds
    apart: a worker whose beat stopped and that left no word died (or its host cannot be reached)."""

    def __init__(self, rank: int, size: int, addr: tuple[str, int]):
        self.rank, self.size = rank, size
        hosts = [None] * size
        dist.all_gather_object(hosts, (socket.gethostname(), os.getpid()))
        self.hosts: list[tuple[str, int]] = hosts  # [(host name, pid)] by rank
        self.store = dist.TCPStore(addr[0], addr[1], is_master=False,
                                   timeout=datetime.timedelta(seconds=STEP_TIMEOUT))

    def name(self, rank: int) -> str:
        return f"rank {rank} (host {self.hosts[rank][0]})"

    def beat(self) -> None:
        """A worker: beat from a daemon thread until the process ends; the thread also takes SIGTERM (blocked here,
        in the main thread, from now on; call this from the main thread)."""
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        threading.Thread(target=self._beat, name=f"zoo-tp-beat-{self.rank}", daemon=True).start()

    def _beat(self) -> None:
        beating = True
        while True:
            if signal.sigtimedwait({signal.SIGTERM}, BEAT) is not None:
                self.leave("was stopped by its launcher (SIGTERM), after another rank failed")
                os._exit(128 + signal.SIGTERM)
            if beating:
                try:
                    self.store.add(f"zoo/beat/{self.rank}", 1)
                except (RuntimeError, dist.DistError):
                    beating = False  # the store is gone (rank 0's process, or the launcher): keep taking SIGTERM

    def leave(self, why: str, *, wait: bool = False) -> None:
        """A worker leaving on its own says why (rank 0 reads it when it names the ranks that failed). `wait`: then
        wait until rank 0 has named them: under torchrun, a rank that exits makes its launcher stop every rank of its
        node, rank 0 too when it is one of them, before rank 0 could say who died. Rank 0 may see the failure only
        when its own collective times out (_set_timeout's: a peer it was not waiting on died), then reads the beats
        for STALE s: the wait allows twice that."""
        with contextlib.suppress(RuntimeError, dist.DistError):
            self.store.set(f"zoo/left/{self.rank}", why)
            if wait:
                self.store.wait(["zoo/named"], datetime.timedelta(seconds=2 * (_TIMEOUT[0] + STALE)))

    def failed(self, exits=dict) -> list[str]:
        """Rank 0, after a failed collective: what became of each worker that is gone, those that died first
        (`exits()`: the exit status of the spawned workers that ended, by rank, read after the wait: how they died)."""
        def beats():
            out = {}
            for r in range(1, self.size):
                with contextlib.suppress(RuntimeError, dist.DistError):
                    out[r] = self.store.add(f"zoo/beat/{r}", 0)
            return out

        def words():
            out = {}
            for r in range(1, self.size):
                with contextlib.suppress(RuntimeError, dist.DistError):
                    if self.store.check([f"zoo/left/{r}"]):
                        out[r] = self.store.get(f"zoo/left/{r}").decode(errors="replace")
            return out

        before = beats()
        time.sleep(STALE)
        after, left = beats(), words()
        exits = exits()
        stopped = [r for r in range(1, self.size) if r not in after or after[r] == before.get(r) or r in exits]
        deadline = time.monotonic() + STALE  # a rank stopped by its launcher stops beating, then says why
        while any(r not in left and r not in exits for r in stopped) and time.monotonic() < deadline:
            time.sleep(0.1)
            left = words()
        with contextlib.suppress(RuntimeError, dist.DistError):
            self.store.set("zoo/named", "1")  # the workers waiting in leave() may go
        died = [f"{self.name(r)} " + (_how(exits[r]) if r in exits else
                                      f"died (no heartbeat for {STALE:g} s, or its host cannot be reached)")
                for r in stopped if r not in left]
        return died + [f"{self.name(r)} {why}" for r, why in sorted(left.items())]


def _how(code: int) -> str:
    return f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"


def _load(path, rank: int, size: int, dtype: torch.dtype):
    """(model, config, spec, report) of this rank, or the error text; every rank learns every rank's outcome."""
    from zoo.build import build_model

    try:
        built, error = build_model(path, dtype=dtype, tp=Parallel(rank, size)), None
    except Exception as e:  # noqa: BLE001 - said by rank 0, naming this rank
        built, error = None, f"{type(e).__name__}: {e}"
    errors = [None] * size
    dist.all_gather_object(errors, error)
    bad = [(r, e) for r, e in enumerate(errors) if e is not None]
    if bad:
        raise TensorParallelError("; ".join(f"tensor parallel rank {r} of {size} could not load {path}: {e}"
                                            for r, e in bad))
    return built


def _status_kb(field: str) -> int:
    """A field of /proc/self/status in kB (VmRSS, VmHWM); 0 where there is no /proc."""
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) for line in f if line.startswith(field + ":")), 0)
    except OSError:
        return 0


class Peak:
    """This process's peak resident memory from now on: the kernel's high-water mark (VmHWM) reset here
    (/proc/self/clear_refs 5), less the resident size now (the interpreter, torch, what was loaded before)."""

    def __init__(self):
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
        self.baseline_kb = _status_kb("VmRSS")

    def above_baseline(self) -> int:
        """Bytes of peak resident memory above the baseline."""
        return max(_status_kb("VmHWM") - self.baseline_kb, 0) * 1024


def _stats(rank: int, report, peak: Peak) -> dict:
    return {"rank": rank, "read_bytes": report.bytes, "tensors": report.tensors, "report": str(report),
            "peak_bytes": peak.above_baseline()}


class _Array:
    """A CPU tensor inside a control message, carried as a numpy array: pickling a torch tensor costs ~0.12 ms each
    way (its storage's reduction), a numpy array's raw bytes ~4 us, and a step's message holds a dozen tensors."""
    __slots__ = ("array",)

    def __init__(self, tensor: torch.Tensor):
        self.array = tensor.numpy()


_AS_NUMPY = {torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
             torch.uint8, torch.bool}


def pack(obj):
    """A message with its tensors (in dicts, and lists of dicts) as _Arrays where numpy holds their dtype."""
    if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and obj.dtype in _AS_NUMPY:
        return _Array(obj.detach())
    if isinstance(obj, dict):
        return {k: pack(v) for k, v in obj.items()}
    if isinstance(obj, list) and obj and isinstance(obj[0], dict):
        return [pack(v) for v in obj]
    return obj


def unpack(obj):
    """pack's inverse: the same tensors, bit for bit."""
    if isinstance(obj, _Array):
        return torch.from_numpy(obj.array)
    if isinstance(obj, dict):
        return {k: unpack(v) for k, v in obj.items()}
    if isinstance(obj, list) and obj and isinstance(obj[0], dict):
        return [unpack(v) for v in obj]
    return obj


def orders(ctl):
    """A worker's messages from rank 0 on the control group, each a dict with its "op", until it says stop."""
    while True:
        msg = [None]
        dist.broadcast_object_list(msg, src=0, group=ctl)
        if msg[0]["op"] == "stop":
            return
        yield unpack(msg[0])


def pools(model, order: dict) -> tuple[dict, dict, dict]:
    """The "caches" order: this process's (KV caches, recurrent states, their snapshots) for its own layers (its
    heads / channels, its stage's layers), as many blocks, slots and snapshots as rank 0's engine holds."""
    from zoo.runtime.kv_cache import allocate_kv_caches, cache_specs
    from zoo.runtime.state_pool import allocate_states, state_specs

    specs = state_specs(model)
    return (allocate_kv_caches(cache_specs(model), order["num_blocks"], order["block_size"]),
            allocate_states(specs, order["state_slots"]) if specs else {},
            allocate_states(specs, order["state_snapshots"]) if specs and order["state_snapshots"] else {})


def _serve(rank: int, size: int, path: str, dtype: torch.dtype, ctl) -> None:
    """A worker's loop: load its slices, then do what rank 0 says until it says stop."""
    from zoo.runtime.state_pool import apply_copies

    _check_layout(path, size)  # what rank 0 did before its baseline (imports the config, registry and plugins)
    peak = Peak()
    model, _, _, report = _load(path, rank, size, dtype)
    _set_timeout(STEP_TIMEOUT)
    caches, states, snapshots = {}, {}, {}
    for step in orders(ctl):
        op = step["op"]
        if op == "forward":
            apply_copies(step["state_copies"], states, snapshots)  # rank 0's snapshot saves / restores, in order
            with torch.inference_mode():
                model(step["input_ids"], step["positions"],
                      ForwardBatch(kv_caches=caches if step["cached"] else {},
                                   ssm_states=states if step["states"] else {}, **step["batch"]))
        elif op == "logits":
            with torch.inference_mode():
                model.compute_logits(step["hidden"])  # [N, H] -> [N, V]: joins the gather; rank 0 samples
        elif op == "encode":
            with torch.inference_mode():
                model.encode_images(step["items"])  # joins the split tower's all-reduces; rank 0 keeps the output
        elif op == "caches":
            caches, states, snapshots = pools(model, step)
        elif op == "stats":
            dist.all_gather_object([None] * size, _stats(rank, report, peak))
        elif op == "release":  # a kept pool: the group that used this model closed
            model, caches = None, {}
        elif op == "load":
            _set_timeout(INIT_TIMEOUT)
            peak = Peak()
            model, _, _, report = _load(step["path"], rank, size, step["dtype"])
            _set_timeout(STEP_TIMEOUT)


def _worker(rank: int, size: int, port: int, path: str, dtype: torch.dtype, serve=None) -> None:
    """A spawned rank: join, then serve (`serve`: another loop than _serve's) until rank 0 says stop. Its threads:
    its share of the cores this process may run on (the ranks share one machine), OMP_NUM_THREADS where set."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    omp = os.environ.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(omp) if omp.isdigit() and int(omp) > 0 else max(1, cores // size))
    roll = None
    try:
        ctl, roll = _init(rank, size, port, INIT_TIMEOUT)
        roll.beat()
        (serve or _serve)(rank, size, path, dtype, ctl)
    except TensorParallelError as e:
        _leave(roll, _why(e))  # rank 0 says it
    except Exception as e:  # noqa: BLE001 - rank 0 names this rank; the trace is for whoever reads stderr
        _leave(roll, _why(e))
        traceback.print_exc()
        os._exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_worker(path, *, dtype: torch.dtype = torch.float32, serve=None) -> int:
    """A launched rank > 0 (torchrun): join the group from the environment, load this rank's slices of `path`,
    serve rank 0's steps until it closes (`serve`: another loop than _serve's, e.g. a pipeline stage's). Returns
    the exit status (0; 1 when this rank failed, said on stderr)."""
    rank, size = launched() or (0, 1)
    if rank == 0:
        raise TensorParallelError("run_worker() is for ranks > 0 of a launched group; rank 0 builds the LLM")
    roll, why = None, None
    try:
        ctl, roll = _init(rank, size, None, INIT_TIMEOUT)
        roll.beat()
        (serve or _serve)(rank, size, str(path), dtype, ctl)
    except TensorParallelError as e:
        why = _why(e)  # rank 0 says it
    except Exception as e:  # noqa: BLE001
        print(f"tensor parallel rank {rank} of {size}: {type(e).__name__}: {e}", file=sys.stderr)
        why = _why(e)
    if why is None:
        if dist.is_initialized():
            dist.destroy_process_group()
        return 0
    # (out of the handlers: the failed step's frames, which hold the groups and their connections, are gone)
    _leave(roll, why, wait=True)
    return 1


def _why(error: BaseException) -> str:
    """A failing worker's word to rank 0: its error's first line (gloo's source location cut)."""
    first = re.sub(r"^\[[^\]]*\] ", "", str(error).splitlines()[0] if str(error) else "")
    first = first if len(first) <= 100 else first[:99] + "…"
    return f"left after its own step failed ({type(error).__name__}: {first})"


def _leave(roll: Roll | None, why: str, *, wait: bool = False) -> None:
    """Leave the groups (the other ranks see this one gone at once), then say why to rank 0; `wait`: until rank 0
    has named the failure (a launched rank: Roll.leave)."""
    if dist.is_initialized():
        with contextlib.suppress(RuntimeError, dist.DistError):
            dist.destroy_process_group()
    if roll is not None:
        roll.leave(why, wait=wait)


_TIMEOUT = [INIT_TIMEOUT]  # what _set_timeout set last (a failing worker waits for rank 0 twice that: Roll.leave)


def _set_timeout(seconds: float) -> None:
    """Collectives of the default group wait at most `seconds` from now on (gloo's per-operation timeout;
    ProcessGroup.set_timeout: setting the backend's options.timeout, as this did before, changes nothing once
    the group is built, so every collective waited INIT_TIMEOUT)."""
    _TIMEOUT[0] = seconds
    try:
        dist.distributed_c10d._get_default_group().set_timeout(datetime.timedelta(seconds=seconds))
    except (AttributeError, RuntimeError):  # kept at the init timeout where torch does not expose it
        pass


def _check_layout(path, size: int) -> None:
    from registry import get_registry
    from zoo.build import tensor_parallel_model, validate_spec
    from zoo.runtime.model_files import config_at

    config = config_at(path)
    spec = get_registry().resolve(config)
    try:
        validate_spec(spec, config)  # the plugin's own refusal first, as one process gives it
        tensor_parallel_model(spec, config, size)  # on meta: shapes only
    except ValueError as e:
        raise TensorParallelError(f"{path}: {e}") from None


class _Pool:
    """Spawned workers and the group they joined with rank 0."""

    def __init__(self, size: int, path, dtype: torch.dtype, serve=None):
        port = free_port()
        ctx = mp.get_context("spawn")
        self.size = size
        self.workers = [ctx.Process(target=_worker, args=(r, size, port, str(path), dtype, serve), daemon=True,
                                    name=f"zoo-rank-{r}") for r in range(1, size)]
        for w in self.workers:
            w.start()
        self.ctl, self.roll = None, None
        try:
            self.ctl, self.roll = _init(0, size, port, INIT_TIMEOUT)
        except BaseException:
            self.stop()
            raise

    def alive(self) -> bool:
        return dist.is_initialized() and all(w.is_alive() for w in self.workers)

    def stop(self) -> None:
        if self.alive() and self.ctl is not None:
            try:
                dist.broadcast_object_list([{"op": "stop"}], src=0, group=self.ctl)
            except (RuntimeError, dist.DistError):
                pass
        for w in self.workers:
            w.join(timeout=JOIN_TIMEOUT)
            if w.is_alive():
                w.kill()
                w.join(timeout=JOIN_TIMEOUT)
        if dist.is_initialized():
            dist.destroy_process_group()


_KEEP = 0  # shared_workers() depth
_IDLE: _Pool | None = None  # a kept pool no group uses


@contextlib.contextmanager
def shared_workers():
    """Inside, a closed group leaves its spawned workers up and the next group of the same size loads its model
    on them (one spawn for many models); on exit the kept workers stop."""
    global _KEEP, _IDLE
    _KEEP += 1
    try:
        yield
    finally:
        _KEEP -= 1
        if not _KEEP and _IDLE is not None:
            pool, _IDLE = _IDLE, None
            pool.stop()


class TensorParallelGroup:
    """Rank 0's side: the workers (spawned, kept or launched), the group, and rank 0's model."""
    what = "tensor parallel"  # (errors say it; zoo/runtime/pipeline.py's group says "pipeline parallel")

    def __init__(self, path, size: int, *, dtype: torch.dtype = torch.float32):
        global _IDLE
        if size < 2:
            raise ValueError(f"tensor_parallel_size={size}: a group needs 2 or more ranks")
        self.size, self.closed, self.pool = size, True, None
        env = launched()
        if env is not None and env != (0, size):
            raise TensorParallelError(f"tensor parallel size {size}, but the launcher started this process as rank "
                                      f"{env[0]} of {env[1]} (RANK / WORLD_SIZE in the environment)")
        _check_layout(path, size)  # an architecture or config that cannot split is said before anything spawns
        kept, _IDLE = _IDLE, None
        if kept is not None and not (kept.size == size and kept.alive()):
            kept.stop()
            kept = None
        if dist.is_initialized() and kept is None:
            raise RuntimeError("torch.distributed is already initialised in this process: one tensor-parallel LLM "
                               "at a time (close() the other first)")
        try:
            if env is not None:  # torchrun: every rank is already running; join them
                self.ctl, self.roll = _init(0, size, None, INIT_TIMEOUT)
            elif kept is not None:  # the kept workers load this model
                self.pool, self.ctl, self.roll = kept, kept.ctl, kept.roll
                _set_timeout(INIT_TIMEOUT)
                dist.broadcast_object_list([{"op": "load", "path": str(path), "dtype": dtype}], src=0, group=self.ctl)
            else:
                self.pool = _Pool(size, path, dtype)
                self.ctl, self.roll = self.pool.ctl, self.pool.roll
            self.closed = False
            self.peak = Peak()
            self.model, self.config, self.spec, self.load_report = self._guard(_load, path, 0, size, dtype)
        except BaseException:
            self.close(keep=False)
            raise
        _set_timeout(STEP_TIMEOUT)
        self.runner = None  # the attached engine's model runner (its state snapshot copies go with each step)
        self._mirror()

    @property
    def workers(self) -> list:
        """The spawned worker processes (none under a launcher)."""
        return self.pool.workers if self.pool is not None else []

    def _send(self, msg: dict) -> None:
        dist.broadcast_object_list([pack(msg)], src=0, group=self.ctl)

    def _mirror(self) -> None:
        """Every forward, head and encoder call of rank 0's model is one on each worker, with the same inputs (a
        forward outside an engine too: parity's one-shot image forward)."""
        self.model.register_forward_pre_hook(self._broadcast_step)
        head = self.model.compute_logits

        def compute_logits(hidden):  # on the same rows
            self._send({"op": "logits", "hidden": hidden.detach()})
            return head(hidden)

        self.model.compute_logits = compute_logits
        if callable(getattr(self.model, "encode_images", None)):
            encode = self.model.encode_images

            def encode_images(items):  # on the same images
                self._send({"op": "encode", "items": items})
                return encode(items)

            self.model.encode_images = encode_images

    def attach(self, engine) -> None:
        """Size the workers' caches (KV blocks, recurrent state slots and snapshots) as the engine's pool, and send the
        engine's state snapshot copies with each step (another engine on the same group may attach later: parity runs
        one per scenario)."""
        runner = self.runner = engine.runner
        runner.keep_state_copies = True
        slots, snapshots = engine.kv.state_slots, engine.kv.state_snapshots
        self._guard(self._send, {"op": "caches", "num_blocks": engine.kv.pool.num_blocks,
                                 "block_size": runner.block_size,
                                 "state_slots": slots.num_slots if slots is not None else 0,
                                 "state_snapshots": snapshots.num_snapshots if snapshots is not None else 0})
        execute = runner.execute

        def guarded(*args, **kwargs):  # a failing collective inside the step becomes an error naming the rank
            return self._guard(execute, *args, **kwargs)

        runner.execute = guarded

    def rank_stats(self) -> list[dict]:
        """Every rank's {"rank", "read_bytes", "tensors", "report" (its LoadReport: its slices only), "peak_bytes"
        (its process's peak resident memory above what it held before loading: weights, KV cache, activations)}."""
        self._guard(self._send, {"op": "stats"})
        out = [None] * self.size
        self._guard(dist.all_gather_object, out, _stats(0, self.load_report, self.peak))
        return out

    def _broadcast_step(self, module, args) -> None:
        input_ids, positions, batch = args
        copies = self.runner.take_state_copies() if self.runner is not None else []
        self._send({"op": "forward", "input_ids": input_ids, "positions": positions, "state_copies": copies,
                    "cached": bool(batch.kv_caches), "states": bool(batch.ssm_states),  # (none: a whole prompt)
                    "batch": {f: getattr(batch, f) for f in BATCH_FIELDS}})

    def _guard(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except TensorParallelError:
            raise
        except (RuntimeError, dist.DistError) as e:
            raise self._failure(e) from None

    def _failure(self, error: BaseException) -> TensorParallelError:
        def exits():
            return {r: w.exitcode for r, w in enumerate(self.workers, start=1) if w.exitcode is not None}

        said = self.roll.failed(exits) if getattr(self, "roll", None) is not None else \
            [f"rank {r} {_how(c)}" for r, c in exits().items()]
        self.close(keep=False)
        if said:
            return TensorParallelError(f"{self.what} {'; '.join(said)}; the run is over (group of {self.size})")
        first = str(error).splitlines()[0] if str(error) else ""
        return TensorParallelError(f"{self.what} group of {self.size}: a collective failed on rank 0 "
                                   f"({type(error).__name__}: {first}); every rank still beats")

    def close(self, keep: bool = True) -> None:
        """Tell the workers to stop (or, inside shared_workers(), to drop this model and wait for the next), wait
        for them (then end them), and leave the group."""
        global _IDLE
        if self.closed:
            return
        self.closed = True
        if self.pool is None:  # launched: the other ranks end when told; the launcher collects them
            if dist.is_initialized():
                with contextlib.suppress(RuntimeError, dist.DistError):
                    self._send({"op": "stop"})
                dist.destroy_process_group()
            return
        if keep and _KEEP and self.pool.alive():
            try:
                self._send({"op": "release"})
                _IDLE = self.pool
                return
            except (RuntimeError, dist.DistError):
                pass
        self.pool.stop()
