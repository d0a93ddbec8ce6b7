"""The model runner: owns the KV tensors, turns a schedule into one flattened ForwardBatch, runs the
model, computes logits only for the rows that sample (and the prompt rows of a request that wants its
prompt_logprobs), and samples.

Shape legend (as in zoo/runtime/batch.py):
    T = tokens this step   B = requests this step   N = requests that sample   MB = max blocks of one request

Metadata is built once per step in plain Python lists (`plan`: a StepLists; a decode step has T = B entries);
the fused native step reads them as they are, the module path gets one tensor per ForwardBatch field
(`tensors`): no per-request tensor ops. On the CPU with the native kernels on
(zoo.kernels; ZOO_FAST=0 turns them off): the float32 weights are packed into one buffer in the order a
step reads them (kernels.pack_weights), the KV caches live in transparent huge pages (kernels.huge_empty),
and the steps of a Llama-structured model run as one native call
(zoo.kernels.fused: the same kernels as the module path, equal logits bit for bit, no per-layer Python; LLaVA's
language model on the steps without image rows); other steps, other models and hooked models (parity taps) run
the modules.
The device path (CUDA, or forced on the CPU with ZOO_DEVICE_PATH=1 / kernels.set_device_path): the modules with
the Triton kernels (their torch references on the CPU), the step's metadata in one host-to-device copy
(`one_copy`), and no host read inside the model's forward (forced on the CPU: zoo.kernels.host_sync raises on one).
`last_timings` holds the seconds each phase of the latest step took, and its requests and tokens
(bench/generate.py reports them).
"""
from __future__ import annotations

import contextlib
import math
import time
from typing import Callable

import torch

from zoo import kernels
from zoo.kernels import host_sync
from zoo.kernels import triton as triton_kernels
from zoo.kernels.fused import FusedDecoder, StepBuffers
from zoo.runtime.batch import CacheSpec, ForwardBatch, StepLists
from zoo.runtime.kv_cache import KVCacheManager, allocate_kv_caches
from zoo.runtime.multimodal import MultiModal
from zoo.runtime.request import Request
from zoo.runtime.sampler import Sampler, SamplerOutput
from zoo.runtime.scheduler import SchedulerOutput
from zoo.runtime.state_pool import allocate_states, apply_copies


def one_copy(device: torch.device, *lists: list[int]) -> list[torch.Tensor]:
    """The lists as int64 tensors on `device`, in one host-to-device copy (pinned, asynchronous on CUDA)."""
    host = torch.tensor([v for values in lists for v in values], dtype=torch.int64)
    if device.type == "cuda":
        host = host.pin_memory().to(device, non_blocking=True)
    elif device.type != "cpu":
        host = host.to(device)
    return list(host.split([len(values) for values in lists]))


class ModelRunner:
    def __init__(self, model: torch.nn.Module, specs: dict[str, CacheSpec], num_blocks: int, block_size: int,
                 *, device: torch.device | str = "cpu", state_specs: dict | None = None, num_state_slots: int = 0,
                 num_state_snapshots: int = 0):
        self.model = model
        self.device = torch.device(device)
        self.block_size = block_size
        native = self.device.type == "cpu" and kernels.enabled()
        # the device path (an accelerator, or forced on the CPU: kernels.set_device_path): no native kernels,
        # the batch's metadata copied in one transfer, no host read inside a step (checked when forced)
        self.device_path = kernels.device_path(torch.empty(0, device=self.device))
        if native:  # the same tensors, in transparent huge pages
            self.kv_caches = kernels.huge_empty({p: ((num_blocks, block_size, *s.per_token), s.dtype)
                                                 for p, s in specs.items()})
        else:
            self.kv_caches = allocate_kv_caches(specs, num_blocks, block_size, self.device)
        # hybrid / SSM models: prefix -> the recurrent state tensors [S, *shape] (zoo/runtime/state_pool.py)
        self.ssm_states = allocate_states(state_specs, num_state_slots, self.device) if state_specs else {}
        self.state_snapshots = allocate_states(state_specs, num_state_snapshots, self.device) \
            if state_specs and num_state_snapshots else {}
        self.sampler = Sampler()
        # Called with (sampling requests, raw logits [N, V]) every step: parity tests and debugging.
        self.logits_hook: Callable[[list[Request], torch.Tensor], None] | None = None
        self.last_timings: dict[str, float] = {}  # seconds of prepare / forward / logits / sample; requests, tokens
        self.packed_bytes = kernels.pack_weights(model) if native else 0
        built = FusedDecoder.qualify(model, self.kv_caches) if native else \
            "the device path is forced (ZOO_DEVICE_PATH)" if self.device_path and self.device.type == "cpu" else \
            "the device is not the CPU" if self.device.type != "cpu" else "the native kernels are off"
        self.fused = built if isinstance(built, FusedDecoder) else None
        # which path a step takes, and why (zoo run says it; docs/plugins.md: what keeps a model on the fast one)
        images = "; a step with image rows runs the modules" if MultiModal.supports(model) else ""
        self.step_path = f"fused native step (one call per step{images})" if self.fused is not None else \
            f"module path ({'native kernels per module' if native else self._kernels()}): the fused step does not apply: {built}"
        self.mm: MultiModal | None = None  # the engine sets it for a model that takes images
        # snapshot copies run since the last take_state_copies(), kept when a tensor-parallel group is attached
        self.keep_state_copies = False
        self.state_copies: list[tuple[str, int, int]] = []
        # the greedy fast step (`fast_step`), the Sampler's greedy path and the engine's deferred detokenisation:
        # False sends every step through the general path (plan, fused.run or the modules, the Sampler's general
        # draw, text every step), which they equal (bench/generate.py times both; tests/test_fast_step.py)
        self.fast = True
        self.buffers = StepBuffers(self.fused) if self.fused is not None and self.fused.long_rope is None else None
        # the last fast step's (request, seq_len, its block list, the blocks its table row holds)
        self.steady: list[tuple[Request, int, list, int]]
        self.fast_steps = self.steady_steps = 0  # steps the fast step ran, and of them the steady ones (tests)

    @property
    def fast(self) -> bool:
        return self._fast

    @fast.setter
    def fast(self, on: bool) -> None:
        self._fast = self.sampler.fast = bool(on)
        self.steady = []  # (steps on the general path meanwhile: the next fast step plans afresh)

    def take_state_copies(self) -> list[tuple[str, int, int]]:
        """The state snapshot saves / restores run on this process's states since the last call, in order (a
        tensor-parallel group sends them to its workers with the step: zoo/runtime/distributed.py)."""
        copies, self.state_copies = self.state_copies, []
        return copies

    def _kernels(self) -> str:
        if not self.device_path:
            return "torch"
        return "device path, the Triton kernels' torch references" if self.device.type == "cpu" or \
            triton_kernels.missing() else "device path, Triton kernels"

    def plan(self, out: SchedulerOutput, kv: KVCacheManager) -> StepLists:
        """The step's metadata as host lists; also queues the prompt rows' logprob targets (self.prompt_targets)
        and applies the SSM state copies the scheduler queued."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl, seq_lens, tables, sample_rows = [0], [], [], []
        prompt_rows: list[int] = []  # rows whose logits give a prompt token's logprobs (after the sampled rows)
        self.prompt_targets: list[tuple[Request, int]] = []  # (request, prompt position p): logits of p -> token p+1
        for s in out.scheduled:
            start, n = s.num_computed_tokens, s.num_new_tokens
            end = start + n
            table = kv.block_ids(s.request.request_id)
            ids += s.request.all_token_ids[start:end]
            positions += range(start, end)
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            qsl.append(qsl[-1] + n)
            seq_lens.append(end)
            tables.append(table)
            if s.samples:
                sample_rows.append(qsl[-1] - 1)
            req = s.request
            if req.wants_prompt_logits:  # (resumes where it stopped: a preempted request's are not done twice)
                for p in range(max(start, len(req.prompt_logprobs) - 1), min(end, req.num_prompt_tokens - 1)):
                    prompt_rows.append(qsl[-2] + p - start)
                    self.prompt_targets.append((req, p))
        width = max(len(t) for t in tables)
        if kv.state_snapshots is not None:  # queued boundary snapshots (saves) and prefix-hit restores
            copies = kv.state_snapshots.drain()
            apply_copies(copies, self.ssm_states, self.state_snapshots)
            if self.keep_state_copies:  # (tensor parallelism: each worker runs them on its own states)
                self.state_copies += copies
        return StepLists(ids, positions, slots, qsl, seq_lens, [s.request.num_tokens for s in out.scheduled],
                         [b for t in tables for b in (t + [0] * (width - len(t)))], width, sample_rows + prompt_rows)

    def tensors(self, step: StepLists, out: SchedulerOutput, kv: KVCacheManager) -> tuple[torch.Tensor, torch.Tensor, ForwardBatch]:
        """The step's (input_ids [T], positions [T], ForwardBatch) on the runner's device: the module path's input."""
        dev = self.device
        # (a pipeline's stage 0 may hold no recurrent layer while later stages do: the slots are the engine's)
        states = [kv.state_slots.slot(s.request.request_id) for s in out.scheduled] \
            if kv.state_slots is not None else []
        # every field in one host buffer (copied to a device once)
        qsl_t, seq_t, positions_t, slots_t, tables_t, rows_t, input_ids, states_t = one_copy(
            dev, step.query_start_loc_cpu, step.seq_lens_cpu, step.positions, step.slot_mapping, step.block_tables,
            step.logits_indices, step.input_ids, states)
        qsl_t, seq_t, tables_t = qsl_t.to(torch.int32), seq_t.to(torch.int32), tables_t.to(torch.int32)
        batch = ForwardBatch(
            query_start_loc=qsl_t,
            seq_lens=seq_t,
            positions=positions_t,
            slot_mapping=slots_t,
            block_tables=tables_t.view(len(step.seq_lens_cpu), step.max_blocks),
            logits_indices=rows_t,
            kv_caches=self.kv_caches,
            block_size=self.block_size,
            query_start_loc_cpu=step.query_start_loc_cpu,
            seq_lens_cpu=step.seq_lens_cpu,
            num_tokens_cpu=step.num_tokens_cpu,
        )
        if states:  # each request's state slot; it holds a state only once tokens were computed
            batch.ssm_states = self.ssm_states
            batch.state_indices_cpu = states
            batch.has_initial_state_cpu = [s.num_computed_tokens > 0 for s in out.scheduled]
            batch.state_indices = states_t
        if self.mm is not None:  # image features for the placeholder rows this step covers (encoded if new)
            batch.mm_positions, batch.mm_embeds = self.mm.gather(out.scheduled, step.query_start_loc_cpu)  # [M], [M, H]
            batch.mrope_positions = self.mm.positions_3d(out.scheduled, dev)  # [3, T] or None
        return input_ids, positions_t, batch

    def fast_step(self, out: SchedulerOutput, kv: KVCacheManager) -> tuple[list[Request], SamplerOutput] | None:
        """The step on the fused driver with its argmax, when every scheduled request samples a plain greedy token
        (Request.plain_greedy) and nothing else reads the logits (no logits_hook, no prompt logprobs, no images):
        the general path's tokens without its Python. A decode step of the requests of the fast step before, in
        the same order, each one token further in the same blocks, updates the kept metadata in place (no plan:
        `_advance`); any other step plans afresh. None: the general path runs it."""
        buffers, scheduled, steady = self.buffers, out.scheduled, self.steady
        if buffers is None or buffers.fused is not self.fused or self.logits_hook is not None or self.mm is not None:
            self.steady = []  # (the buffers are the driver's: not a runner's whose driver was taken away)
            return None
        t0 = time.perf_counter()
        if len(steady) == len(scheduled) and self._advance(scheduled, kv.req_blocks):
            if not self.fused.usable(quick=True):
                self.steady = []
                return None
            buffers.cover(max(n for _, n, _, _ in steady))
            self.steady_steps += 1
        else:
            if not self.fused.usable():
                self.steady = []
                return None
            for s in scheduled:
                if not s.samples or not s.request.plain_greedy or s.request.wants_prompt_logits:
                    self.steady = []
                    return None
            step = self.plan(out, kv)
            buffers.load(step)
            held = kv.req_blocks
            self.steady = [(s.request, n, held[s.request.request_id], len(held[s.request.request_id]))
                           for s, n in zip(scheduled, step.seq_lens_cpu)]
        t1 = time.perf_counter()
        tokens, values = buffers()
        self.fast_steps += 1
        if not all(map(math.isfinite, values)):
            tokens = [t if math.isfinite(v) else None for t, v in zip(tokens, values)]
        self.last_timings = dict(prepare=t1 - t0, forward=buffers.native_s, logits=0.0, native=buffers.native_s,
                                 sample=0.0, requests=len(scheduled), tokens=buffers.args.T)
        return [s.request for s in scheduled], SamplerOutput(tokens, [None] * len(tokens))

    def _advance(self, scheduled, held: dict) -> bool:
        """The steady decode step: each request of the last fast step, in order, computes its next token in the
        same block list (a block the scheduler appended goes onto its table row while the row has room); its token,
        position, slot and length written into the kept buffers. False (the buffers half written: the caller loads
        the step afresh) when a request differs."""
        buffers, steady, bs = self.buffers, self.steady, self.block_size
        ids, pos, slots, seq_lens, tables = buffers.ids, buffers.pos, buffers.slots, buffers.seq_lens, buffers.tables
        a, b = buffers.args, len(steady)
        mb = a.max_blocks
        for i, s in enumerate(scheduled):
            r, p, blocks, width = steady[i]  # (p: the position this step computes, the length the last step left)
            if s.request is not r or s.num_computed_tokens != p or s.num_new_tokens != 1 or not s.samples \
                    or held.get(r.request_id) is not blocks:
                return False
            if p >= width * bs:  # into the block the scheduler just gave it: on its table row, if it has room
                if width == mb or len(blocks) <= width:
                    return False
                tables[i * mb + width] = blocks[width].block_id
                width += 1
            ids[i], pos[i], seq_lens[i] = r.all_token_ids[p], p, p + 1
            slots[i] = tables[i * mb + p // bs] * bs + p % bs
            steady[i] = (r, p + 1, blocks, width)
        if a.T != b:  # the step before was a prefill: one token and one sampled row per request now
            buffers.qsl[:b + 1], buffers.row_ids[:b] = range(b + 1), range(b)
            a.T = a.N = b
        return True

    def execute(self, out: SchedulerOutput, kv: KVCacheManager) -> tuple[list[Request], SamplerOutput | None]:
        """Run one step; returns the requests that sampled and what they sampled (in the same order)."""
        done = self.fast_step(out, kv) if self.fast else None
        return done if done is not None else self._execute(out, kv)

    @torch.inference_mode()
    def _execute(self, out: SchedulerOutput, kv: KVCacheManager) -> tuple[list[Request], SamplerOutput | None]:
        """The general path: the step's logits (`forward_logits`), its prompt logprobs, then the Sampler's draw."""
        reqs = [s.request for s in out.scheduled if s.samples]
        logits, timings = self.forward_logits(out, kv)  # [N + P, V]
        t3 = time.perf_counter()
        if self.prompt_targets:  # the rows after the N sampled ones: prompt tokens' logprobs
            add_prompt_logprobs(logits[len(reqs):], self.prompt_targets)
            logits = logits[:len(reqs)]  # [N, V]
        if not reqs:
            self.last_timings = dict(timings, sample=0.0)
            return [], None
        if self.logits_hook is not None:
            self.logits_hook(reqs, logits)
        sampled = self.sampler(logits, reqs)
        self.last_timings = dict(timings, sample=time.perf_counter() - t3)
        return reqs, sampled

    def forward_logits(self, out: SchedulerOutput, kv: KVCacheManager) -> tuple[torch.Tensor | None, dict]:
        """The step planned and run, on the fused driver or the modules: (the logits of its sampled rows, then of its
        prompt-logprob rows (self.prompt_targets) [N + P, V], or None when there are none; the seconds of each phase,
        and the step's requests and tokens). A pipeline's rank 0 replaces it (zoo/runtime/pipeline.py)."""
        t0 = time.perf_counter()
        step = self.plan(out, kv)
        shape = dict(requests=len(out.scheduled), tokens=len(step.input_ids))
        guard = host_sync.forbid() if self.device_path and self.device.type == "cpu" else contextlib.nullcontext()
        if self.fused is not None and (self.mm is None or not self.mm.covers(out.scheduled)) and self.fused.usable():
            t1 = time.perf_counter()
            logits = self.fused.run(step)  # [N, V], forward and head in one call, straight from the lists
            t2 = t3 = time.perf_counter()
            shape["native"] = self.fused.native_s
        else:
            input_ids, positions, batch = self.tensors(step, out, kv)
            t1 = time.perf_counter()
            with guard:  # (forced device path on the CPU: no host read inside the model's step)
                hidden = self.model(input_ids, positions, batch)  # [T, H]
                t2 = time.perf_counter()
                logits = self.model.compute_logits(hidden[batch.logits_indices]) \
                    if len(batch.logits_indices) else None  # [N + P, V]
            t3 = time.perf_counter()
        return logits, dict(prepare=t1 - t0, forward=t2 - t1, logits=t3 - t2, **shape)


def add_prompt_logprobs(logits: torch.Tensor, targets: list[tuple[Request, int]]) -> None:
    """Append to each target request's prompt_logprobs the entry of prompt token p + 1: {that token: its raw
    logprob, then the top-n tokens'} from logits [P, V] at position p (n = its SamplingParams.prompt_logprobs)."""
    lp = logits.float().log_softmax(-1)  # [P, V]
    want = torch.tensor([r.all_token_ids[p + 1] for r, p in targets], device=lp.device)  # [P]
    chosen = lp.gather(1, want[:, None])[:, 0].tolist()  # [P]
    k = max(r.sampling_params.prompt_logprobs for r, _ in targets)
    top_vals, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], want[:, None][:, :0])  # [P, k]
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    for i, (r, p) in enumerate(targets):
        n = r.sampling_params.prompt_logprobs
        d = {r.all_token_ids[p + 1]: chosen[i]}
        for t, v in zip(top_ids[i][:n], top_vals[i][:n]):
            d.setdefault(t, v)
        r.prompt_logprobs.append(d)
