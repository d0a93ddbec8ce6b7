"""Tensor parallelism on torch.distributed: this process is rank 0 and runs the engine (scheduler, sampler);
ranks 1..N-1 are spawned workers that run the same forward on their own slices every step.

    group = TensorParallelGroup(path, size, dtype=torch.float32)   # spawns, joins gloo, loads rank 0's slices
    engine = LLMEngine(group.model, group.config, ...)
    group.attach(engine)    # the workers allocate their KV caches (their heads only); each step is mirrored
    ...
    group.close()

Each rank loads only its slices (loader Shard rules). Before every forward, rank 0 broadcasts the step's
metadata (token ids, positions, slots, block tables, logits rows); every rank runs the step; the row-parallel
sums and the vocab gathers (zoo/layers/parallel.py) are collectives of the default group, so the workers keep
step with rank 0. Sampling happens on rank 0 only. The rendezvous is a free port on 127.0.0.1 chosen here;
initialisation and every collective have timeouts, and a rank that dies ends the run with an error naming it.
"""
from __future__ import annotations

import datetime
import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from loader import Parallel
from zoo.runtime.batch import ForwardBatch

INIT_TIMEOUT = 120.0  # seconds for every rank to start, join and load (spawned interpreters import torch)
STEP_TIMEOUT = 20.0  # seconds a collective waits for the other ranks (a dead rank is usually seen at once)
JOIN_TIMEOUT = 10.0  # seconds a worker gets to exit after close()


class TensorParallelError(RuntimeError):
    """A rank failed: its number, and what it said (or how it died)."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, size: int, port: int, seconds: float) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=seconds))


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


def _worker(rank: int, size: int, port: int, path: str, dtype: torch.dtype) -> None:
    """A spawned rank: join, load its slices, then mirror rank 0's steps until it says stop."""
    torch.set_num_threads(1)
    try:
        _init(rank, size, port, INIT_TIMEOUT)
        model, _, _, _ = _load(path, rank, size, dtype)
        _set_timeout(STEP_TIMEOUT)
        from zoo.runtime.kv_cache import allocate_kv_caches, cache_specs

        hello = [None]
        dist.broadcast_object_list(hello, src=0)  # the pool's shape, decided by rank 0's engine
        caches = allocate_kv_caches(cache_specs(model), hello[0]["num_blocks"], hello[0]["block_size"])
        while True:
            msg = [None]
            dist.broadcast_object_list(msg, src=0)
            if msg[0] is None:
                break
            _mirror(model, msg[0], caches)
    except TensorParallelError:
        pass  # rank 0 says it
    except Exception:  # noqa: BLE001 - rank 0 names this rank; the trace is for whoever reads stderr
        traceback.print_exc()
        os._exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@torch.inference_mode()
def _mirror(model, step: dict, caches: dict) -> None:
    """Rank 0's step on this rank: the forward, then the head on the rows that sample (the gathers join)."""
    batch = ForwardBatch(kv_caches=caches, **step["batch"])
    hidden = model(step["input_ids"], step["positions"], batch)  # [T, H]
    if len(batch.logits_indices):
        model.compute_logits(hidden[batch.logits_indices])  # [N, V]: only rank 0 samples


def _set_timeout(seconds: float) -> None:
    """Collectives of the default group wait at most `seconds` from now on (gloo's per-operation timeout)."""
    try:
        dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu")).options.timeout = \
            datetime.timedelta(seconds=seconds)
    except (AttributeError, RuntimeError):  # kept at the init timeout where torch does not expose it
        pass


def _check_layout(path, size: int) -> None:
    from registry import get_registry
    from zoo.build import tensor_parallel_model
    from zoo.runtime.model_files import read_config

    config = read_config(str(path), str(path))
    try:
        tensor_parallel_model(get_registry().resolve(config), config, size)  # on meta: shapes only
    except ValueError as e:
        raise TensorParallelError(f"{path}: {e}") from None


class TensorParallelGroup:
    """Rank 0's side: the spawned workers, the group, and rank 0's model."""

    def __init__(self, path, size: int, *, dtype: torch.dtype = torch.float32):
        if size < 2:
            raise ValueError(f"tensor_parallel_size={size}: a group needs 2 or more ranks")
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialised in this process: one tensor-parallel LLM "
                               "at a time (close() the other first)")
        self.size = size
        _check_layout(path, size)  # an architecture or config that cannot split is said before anything spawns
        port = free_port()
        ctx = mp.get_context("spawn")
        self.workers = [ctx.Process(target=_worker, args=(r, size, port, str(path), dtype), daemon=True,
                                    name=f"zoo-tp-rank-{r}") for r in range(1, size)]
        for w in self.workers:
            w.start()
        try:
            _init(0, size, port, INIT_TIMEOUT)
            self.model, self.config, self.spec, self.load_report = self._guard(_load, path, 0, size, dtype)
        except BaseException:
            self.close()
            raise
        _set_timeout(STEP_TIMEOUT)
        self.closed = False

    def attach(self, engine) -> None:
        """Size the workers' caches as the engine's pool, and mirror every forward of the engine's model."""
        runner = engine.runner
        self._guard(dist.broadcast_object_list, [{"num_blocks": engine.kv.pool.num_blocks,
                                                  "block_size": runner.block_size}], src=0)
        self.model.register_forward_pre_hook(self._broadcast_step)
        execute = runner.execute

        def guarded(*args, **kwargs):  # a failing collective inside the step becomes an error naming the rank
            return self._guard(execute, *args, **kwargs)

        runner.execute = guarded

    def _broadcast_step(self, module, args) -> None:
        input_ids, positions, batch = args
        step = dict(input_ids=input_ids, positions=positions, batch=dict(
            query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens, positions=batch.positions,
            slot_mapping=batch.slot_mapping, block_tables=batch.block_tables, logits_indices=batch.logits_indices,
            block_size=batch.block_size, query_start_loc_cpu=batch.query_start_loc_cpu,
            seq_lens_cpu=batch.seq_lens_cpu))
        dist.broadcast_object_list([step], src=0)

    def _guard(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except TensorParallelError:
            raise
        except (RuntimeError, dist.DistError) as e:
            raise self._failure(e) from None

    def _failure(self, error: BaseException) -> TensorParallelError:
        for w in self.workers:
            w.join(timeout=1.0)  # a rank that died is seen as exited within a moment
        dead = [(r, w.exitcode) for r, w in enumerate(self.workers, start=1) if w.exitcode is not None]
        self.close()
        if dead:
            said = ", ".join(f"rank {r} " + (f"was killed by signal {-c}" if c < 0 else f"exited with status {c}")
                             for r, c in dead)
            return TensorParallelError(f"tensor parallel group of {self.size}: {said}; the run is over")
        return TensorParallelError(f"tensor parallel group of {self.size}: a collective failed on rank 0 "
                                   f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})")

    def close(self) -> None:
        """Tell the workers to stop, wait for them (then end them), and leave the group."""
        if getattr(self, "closed", False):
            return
        self.closed = True
        if dist.is_initialized():
            if all(w.is_alive() for w in self.workers):
                try:
                    dist.broadcast_object_list([None], src=0)
                except (RuntimeError, dist.DistError):
                    pass
        for w in self.workers:
            w.join(timeout=JOIN_TIMEOUT)
            if w.is_alive():
                w.kill()
                w.join(timeout=JOIN_TIMEOUT)
        if dist.is_initialized():
            dist.destroy_process_group()
