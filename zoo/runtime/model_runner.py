"""The model runner: owns the KV tensors, turns a schedule into one flattened ForwardBatch, runs the
model, computes logits only for the rows that sample, and samples.

Shape legend (as in zoo/runtime/batch.py):
    T = tokens this step   B = requests this step   N = requests that sample   MB = max blocks of one request

Metadata is built once per step from per-request lists (B entries, not T) and tensor ops.
"""
from __future__ import annotations

from typing import Callable

import torch

from zoo.runtime.batch import CacheSpec, ForwardBatch
from zoo.runtime.kv_cache import KVCacheManager, allocate_kv_caches
from zoo.runtime.request import Request
from zoo.runtime.sampler import Sampler, SamplerOutput
from zoo.runtime.scheduler import SchedulerOutput


class ModelRunner:
    def __init__(self, model: torch.nn.Module, specs: dict[str, CacheSpec], num_blocks: int, block_size: int,
                 *, device: torch.device | str = "cpu"):
        self.model = model
        self.device = torch.device(device)
        self.block_size = block_size
        self.kv_caches = allocate_kv_caches(specs, num_blocks, block_size, self.device)
        self.sampler = Sampler()
        # Called with (sampling requests, raw logits [N, V]) every step: parity tests and debugging.
        self.logits_hook: Callable[[list[Request], torch.Tensor], None] | None = None

    def prepare(self, out: SchedulerOutput, kv: KVCacheManager) -> tuple[torch.Tensor, torch.Tensor, ForwardBatch]:
        sched = out.scheduled
        counts = [s.num_new_tokens for s in sched]  # [B]
        starts = [s.num_computed_tokens for s in sched]  # [B]
        ids: list[int] = []
        for s, start, n in zip(sched, starts, counts):
            ids += s.request.all_token_ids[start:start + n]
        qsl = [0]
        for n in counts:
            qsl.append(qsl[-1] + n)
        seq_lens = [a + n for a, n in zip(starts, counts)]
        tables = [kv.block_ids(s.request.request_id) for s in sched]
        sample_rows = [qsl[i + 1] - 1 for i, s in enumerate(sched) if s.samples]

        b, t = len(sched), qsl[-1]
        counts_t = torch.tensor(counts, dtype=torch.int64)
        req_of_token = torch.repeat_interleave(torch.arange(b), counts_t)  # [T]
        offset = torch.tensor(starts, dtype=torch.int64) - torch.tensor(qsl[:-1], dtype=torch.int64)  # [B]
        positions = torch.arange(t, dtype=torch.int64) + offset[req_of_token]  # [T]
        block_tables = torch.zeros(b, max(len(x) for x in tables), dtype=torch.int32)  # [B, MB]
        for i, row in enumerate(tables):
            block_tables[i, :len(row)] = torch.tensor(row, dtype=torch.int32)
        slot_mapping = (block_tables[req_of_token, positions // self.block_size].to(torch.int64) * self.block_size
                        + positions % self.block_size)  # [T]
        dev = self.device
        batch = ForwardBatch(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            positions=positions.to(dev),
            slot_mapping=slot_mapping.to(dev),
            block_tables=block_tables.to(dev),
            logits_indices=torch.tensor(sample_rows, dtype=torch.int64, device=dev),
            kv_caches=self.kv_caches,
            block_size=self.block_size,
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
        )
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)  # [T]
        return input_ids, batch.positions, batch

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, kv: KVCacheManager) -> tuple[list[Request], SamplerOutput | None]:
        """Run one step; returns the requests that sampled and what they sampled (in the same order)."""
        input_ids, positions, batch = self.prepare(out, kv)
        hidden = self.model(input_ids, positions, batch)  # [T, H]
        reqs = [s.request for s in out.scheduled if s.samples]
        if not reqs:
            return [], None
        logits = self.model.compute_logits(hidden[batch.logits_indices])  # [N, V]
        if self.logits_hook is not None:
            self.logits_hook(reqs, logits)
        return reqs, self.sampler(logits, reqs)
