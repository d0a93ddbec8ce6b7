"""The scheduler: one mechanism for prefill, chunked prefill, decode and prefix-cache hits.

Each step every request is given `min(tokens it has not computed, budget left)` new tokens, under a
per-step token budget (max_num_batched_tokens) and a cap on running requests (max_num_seqs). Running
requests go first (a decoding request catches up by one token), then waiting ones in arrival order.
A request samples when the step brings num_computed_tokens to num_tokens; a prefill chunk that stops
short of the end does not. Requests join and leave at every step (continuous batching).

When the KV pool runs out, the most recently admitted running request is preempted by recompute: its
blocks are freed, it goes back to the front of the waiting queue with num_computed_tokens = 0, and its
outputs so far become part of the prefix it recomputes (prefix-cache hits make that cheap).

A model with a two-set rope (longrope, kv.long_rope_past) rotates a request with the long set once its length
is past the switch: a request whose decode crosses it is recomputed whole with the long set (blocks freed,
num_computed_tokens = 0, its block hashes dropped), as transformers' Phi-3 generate drops its cache there.

Hybrid SSM models with prefix caching (kv.clip_to_blocks): a chunk that would cross a block boundary
stops at the last one it reaches, so the recurrent state at that boundary exists to be snapshotted.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from zoo.runtime.kv_cache import KVCacheManager
from zoo.runtime.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens computed this step, from request.num_computed_tokens on
    num_computed_tokens: int  # before this step (cache hits included)
    samples: bool = False  # the step reaches the request's last token: it samples the next one

    def __post_init__(self):
        self.samples = self.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # running ones first
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, kv: KVCacheManager, *, max_num_batched_tokens: int = 2048, max_num_seqs: int = 64,
                 max_model_len: int | None = None):
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError(f"Scheduler: max_num_batched_tokens={max_num_batched_tokens} and "
                             f"max_num_seqs={max_num_seqs} must be >= 1")
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # -- lifecycle ---------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in the scheduler")
        if self.max_model_len is not None and req.num_prompt_tokens >= self.max_model_len:
            raise ValueError(f"request {req.request_id!r}: prompt of {req.num_prompt_tokens} tokens does not fit "
                             f"max_model_len={self.max_model_len}")
        min_blocks = -(-(req.num_prompt_tokens + 1) // self.kv.block_size)
        if min_blocks > self.kv.pool.num_blocks:
            raise ValueError(f"request {req.request_id!r}: {req.num_prompt_tokens} prompt tokens need {min_blocks} KV "
                             f"blocks, the pool has {self.kv.pool.num_blocks} (raise num_blocks)")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def finish_request(self, request_id: str, status: RequestStatus, reason=None) -> None:
        """End a request (stop string, abort): free its blocks, drop it from the queues."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        if not req.finished:
            req.finish(status, reason)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._clip(req.num_computed_tokens, min(req.num_tokens - req.num_computed_tokens, budget))
            while not self.kv.allocate_slots(req, n):
                victim = self.running.pop()  # the latest admitted; never one already scheduled
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, n, req.num_computed_tokens))
                budget -= n
                i += 1
                continue
            break  # req itself was preempted: nothing after it is left in running

        # Admit waiting requests, unless this step had to preempt (the pool is tight).
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            req = self.waiting[0]
            hit_blocks, num_hit = self.kv.get_computed_blocks(req)
            n = self._clip(num_hit, min(req.num_tokens - num_hit, budget))
            if not self.kv.allocate_slots(req, n, hit_blocks):
                break
            self.waiting.popleft()
            self.kv.record_hit(req.num_tokens, num_hit)
            if req.num_cached_tokens is None:
                req.num_cached_tokens = num_hit
            req.num_computed_tokens = num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n, num_hit))
            budget -= n
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        return out

    def _clip(self, computed: int, n: int) -> int:
        """n new tokens after `computed`, cut at the last block boundary they cross (hybrids with caching)."""
        if not self.kv.clip_to_blocks:
            return n
        boundary = (computed + n) // self.kv.block_size * self.kv.block_size
        return boundary - computed if boundary > computed else n

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance the scheduled requests, append the sampled tokens, and finish those that stop.

        `sampled` maps request id -> token for the requests that sampled. Returns the requests that
        finished this step (their blocks are already freed).
        """
        finished = []
        for s in out.scheduled:
            req = s.request
            req.num_computed_tokens = s.num_computed_tokens + s.num_new_tokens
            self.kv.cache_blocks(req)
            token = sampled.get(req.request_id)
            if token is None:
                continue
            req.append_output(token)
            status, reason = self._check_stop(req, token)
            if status is not None:
                self.finish_request(req.request_id, status, reason)
                finished.append(req)
            elif (past := self.kv.long_rope_past) is not None and req.num_tokens == past + 1 \
                    and req.num_prompt_tokens <= past:
                self._recompute_long(req)
        return finished

    def _recompute_long(self, req: Request) -> None:
        """The request just crossed longrope's switch: its keys (short rotation) are recomputed with the long one."""
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.block_hashes.clear()  # (hashed short; the recomputed blocks hash long)
        req.status = RequestStatus.PREEMPTED
        self.running.remove(req)
        self.waiting.appendleft(req)

    def _check_stop(self, req: Request, token: int):
        p = req.sampling_params
        if token in req.stop_token_ids and req.num_output_tokens > p.min_tokens:
            return RequestStatus.FINISHED_STOPPED, token
        if req.grammar is not None and (req.grammar.done or req.grammar.failed):  # complete: nothing may follow
            return (RequestStatus.FINISHED_ERROR, "grammar") if req.grammar.failed else \
                (RequestStatus.FINISHED_STOPPED, token)
        if req.num_output_tokens >= p.max_tokens:
            return RequestStatus.FINISHED_LENGTH, None
        if self.max_model_len is not None and req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH, None
        return None, None
