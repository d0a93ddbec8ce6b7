"""EngineLoop: one background thread steps an LLMEngine; any thread adds and aborts requests (`zoo serve`).

    loop = EngineLoop(engine).start()
    rid = loop.add(prompt, SamplingParams(max_tokens=8), sink)   # ValueError naming the field, at once
    ...                                                           # sink(RequestOutput) once per step, in
    loop.abort(rid)                                               # the loop's thread; never blocks

Every request of every caller joins the same engine, so they are batched continuously. A step holds the
lock that add() takes (the engine is not thread-safe); abort() only queues the id, which the loop drops
before its next step (the request's blocks are freed then). An exception inside a step ends the requests
then running (their sinks get the exception) and the loop goes on with the next ones: it never dies.
The loop also keeps the serving metrics (time to first token, inter-token latency) that /metrics reports.
"""
from __future__ import annotations

import bisect
import sys
import threading
import time
from collections import deque
from typing import Callable

from zoo.runtime.engine import LLMEngine, RequestOutput
from zoo.runtime.sampling_params import SamplingParams

Sink = Callable[[object], None]  # called with each RequestOutput of the request, or the exception that ended it

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class Histogram:
    """Prometheus-style cumulative buckets, a sum and a count."""

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one: +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, total = [], 0
        for bound, n in zip((*map(repr, self.buckets), "+Inf"), self.counts):
            total += n
            out.append(f'{name}_bucket{{le="{bound}"}} {total}')
        return out + [f"{name}_sum {self.sum!r}", f"{name}_count {self.count}"]


class EngineLoop:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._lock = threading.Lock()  # a step or an add
        self._wake = threading.Event()
        self._aborts: deque[str] = deque()
        self._sinks: dict[str, Sink] = {}
        self._times: dict[str, float] = {}  # request id -> arrival, then the time of its last token
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="zoo-engine-loop", daemon=True)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.finished: dict[str, int] = {}  # finish reason -> count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.step_errors = 0

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=10)

    # -- any thread --------------------------------------------------------------------------------
    def add(self, prompt, params: SamplingParams, sink: Sink, *, request_id: str | None = None, images=None) -> str:
        """Add a request (`images`: for a model that takes them); a ValueError (naming the field) when the engine
        refuses it."""
        with self._lock:
            rid = self.engine.add_request(prompt, params, request_id=request_id, images=images)
            self._sinks[rid] = sink
            self._times[rid] = time.monotonic()
            self.prompt_tokens += self.engine.scheduler.requests[rid].num_prompt_tokens
        self._wake.set()
        return rid

    def abort(self, request_id: str) -> None:
        """Drop a request before the next step (its blocks freed); its sink hears nothing more."""
        self._aborts.append(request_id)
        self._wake.set()

    # -- the loop's thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._closed:
            self._wake.clear()
            if not self._aborts and not self.engine.has_unfinished_requests():
                self._wake.wait()
                continue
            with self._lock:
                self._drop_aborted()
                if not self.engine.has_unfinished_requests():
                    continue
                try:
                    outputs = self.engine.step()
                except Exception as e:  # noqa: BLE001 - the loop must outlive one bad step
                    self._fail_all(e)
                    continue
                now = time.monotonic()
                deliveries = [(self._sinks.get(o.request_id), o) for o in outputs]
                for out in outputs:
                    self._account(out, now)
            for sink, out in deliveries:
                if sink is not None:
                    _deliver(sink, out)

    def _drop_aborted(self) -> None:
        while self._aborts:
            rid = self._aborts.popleft()
            if self._sinks.pop(rid, None) is not None:
                self.engine.abort_request(rid)
                self._times.pop(rid, None)
                self.finished["abort"] = self.finished.get("abort", 0) + 1

    def _account(self, out: RequestOutput, now: float) -> None:
        if out.delta_token_ids and out.request_id in self._times:
            (self.itl if out.token_ids[:-1] else self.ttft).observe(now - self._times[out.request_id])
            self._times[out.request_id] = now
            self.generation_tokens += len(out.delta_token_ids)
        if out.finished:
            self._sinks.pop(out.request_id, None)
            self._times.pop(out.request_id, None)
            self.finished[out.finish_reason] = self.finished.get(out.finish_reason, 0) + 1

    def _fail_all(self, error: Exception) -> None:
        """A step raised: end every request the engine holds, tell their callers, keep looping."""
        self.step_errors += 1
        print(f"zoo serve: error: a step failed ({type(error).__name__}: {error}); its requests are ended",
              file=sys.stderr, flush=True)
        for rid in list(self.engine.scheduler.requests):
            self.engine.abort_request(rid)
            self._times.pop(rid, None)
            sink = self._sinks.pop(rid, None)
            if sink is not None:
                _deliver(sink, error)

    # -- what /metrics reports ---------------------------------------------------------------------
    def stats(self) -> dict:
        kv = self.engine.kv
        sched = self.engine.scheduler
        return {
            "running": len(sched.running), "waiting": len(sched.waiting),
            "kv_blocks_total": kv.pool.num_blocks, "kv_blocks_used": kv.pool.num_blocks - kv.num_free_blocks,
            "prefix_queries": kv.prefix_queries, "prefix_hits": kv.prefix_hits,
            "preemptions": sched.num_preemptions,
        }


def _deliver(sink: Sink, item) -> None:
    try:
        sink(item)
    except Exception as e:  # noqa: BLE001 - a caller's sink (its event loop closed) must not stop the loop
        print(f"zoo serve: warning: a result could not be delivered ({type(e).__name__}: {e})", file=sys.stderr)
