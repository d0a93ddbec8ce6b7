"""Soak test of the runtime's scheduling: a seeded random workload through one engine, every request's output
compared with the same request run alone in a fresh engine.

The invariant (vLLM keeps the same kind of test): with greedy sampling, and with seeded sampling, a request's
tokens (and its logprobs and prompt logprobs, within float noise) do not depend on what runs beside it or on how
the scheduler slices it. The workload: requests arriving at random steps, random prompt lengths, prompts that
share prefixes (stems, repeats, and a finished request's prompt + output: hits on blocks published by decode,
and on blocks freed, still cached, and taken back), aborts while waiting, mid-prefill and mid-decode, a KV pool
small enough to preempt, a token budget small enough to chunk prefills, varied max_tokens / min_tokens / stop
tokens / EOS, logprobs and prompt logprobs on some. After every step the block pool's accounting is checked
(reference counts equal the requests' block lists, free lists hold exactly the unreferenced blocks); at the
end every block is free and every state slot back.

Models: a tiny Llama (the fused native step) and a tiny Bamba (attention + Mamba2: the module path with the
native kernels, its state slots, the state snapshots a prefix hit restores, and preemption of recurrent state).
"""
from __future__ import annotations

import os
import random
from collections import Counter
from dataclasses import dataclass, replace

import pytest

from test_hybrid import CASES as HYBRID_CASES
from tiny import save_tiny
from zoo import kernels
from zoo.build import build_model
from zoo.runtime.engine import LLMEngine
from zoo.runtime.request import RequestStatus
from zoo.runtime.sampling_params import SamplingParams

BS = 4  # the alone runs' block size (a soak run picks its own: 2, 4 or 8)
VOCAB = 128  # tests/tiny.py's BASE (EOS = 2)
# |logprob - alone| (measured: up to 2e-6 on Llama; 1.1e-5 on Bamba, whose scan sums in another order when the
# schedule moves its chunk boundaries)
LOGPROB_ATOL = {"llama": 1e-5, "bamba": 5e-5}
# the native kernels on, as by default (ZOO_FAST=0 or the forced device path: the paths are not asserted)
NATIVE = os.environ.get("ZOO_FAST") != "0" and os.environ.get("ZOO_DEVICE_PATH") != "1"


@dataclass
class Job:
    rid: str
    prompt: list[int]
    params: SamplingParams
    arrive: int  # the step before which it is added
    abort: tuple[str, int] | None = None  # ("waiting", 0), ("prefill", 0) or ("decode", after k output tokens)
    compare: bool = True  # greedy or seeded: its output is reproducible


class Model:
    """A tiny checkpoint read back from disk, and the outputs of requests run alone on it (cached: a job's
    reference depends on its prompt, params and the engine's max_model_len only)."""

    def __init__(self, name, path, hybrid):
        self.name, self.hybrid = name, hybrid
        self.model, self.config, _, _ = build_model(path)
        self.tokenizer = word_tokenizer()
        self.alone: dict = {}

    def reference(self, job: Job, max_model_len: int):
        key = (tuple(job.prompt), repr(job.params), max_model_len)
        if key not in self.alone:
            engine = LLMEngine(self.model, self.config, self.tokenizer, block_size=BS, num_blocks=256,
                               max_model_len=max_model_len)
            engine.add_request(job.prompt, replace(job.params), request_id=job.rid)
            outs = [o for _ in iter(engine.has_unfinished_requests, False) for o in engine.step() if o.finished]
            check_drained(engine)
            self.alone[key] = outs[0]
        return self.alone[key]


def word_tokenizer():
    """Token i decodes to the word "w<i>" (0-2: pad, BOS, EOS, special): stop strings match whole or part words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>"] + [f"w{i}" for i in range(3, VOCAB)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return Model("llama", save_tiny("LlamaForCausalLM", tmp_path_factory.mktemp("soak-llama")), hybrid=False)


@pytest.fixture(scope="module")
def bamba(tmp_path_factory):
    arch, overrides, _ = HYBRID_CASES["bamba"]
    path = save_tiny(arch, tmp_path_factory.mktemp("soak-bamba"), initializer_range=0.2, **overrides)
    return Model("bamba", path, hybrid=True)


# -- the workload -----------------------------------------------------------------------------------------------

def workload(rng: random.Random, model: Model, n: int, max_model_len: int) -> list[Job]:
    stems = [[rng.randrange(3, VOCAB) for _ in range(rng.choice([BS, 2 * BS, 3 * BS + 1, 5 * BS - 1]))]
             for _ in range(3)]
    jobs: list[Job] = []
    for i in range(n):
        kind = rng.random()
        if kind < 0.15 and jobs:  # an earlier prompt again
            prompt = list(rng.choice(jobs).prompt)
        elif kind < 0.3 and jobs:  # an earlier request's prompt and output (blocks its decode published)
            earlier = rng.choice(jobs)
            out = model.reference(earlier, max_model_len).token_ids
            prompt = earlier.prompt + out[:rng.randint(1, max(1, len(out)))]
            prompt = prompt[:max_model_len - 2] + [rng.randrange(3, VOCAB)]
        elif kind < 0.8:  # a shared stem, cut anywhere, and a tail of its own
            stem = rng.choice(stems)
            prompt = stem[:rng.randint(1, len(stem))] + [rng.randrange(3, VOCAB) for _ in range(rng.randint(0, 9))]
        else:
            prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 6 * BS))]
        max_tokens = rng.randint(1, 20)
        seeded, sampled = rng.random() < 0.25, rng.random() < 0.1
        params = SamplingParams(
            max_tokens=max_tokens, temperature=0.9 if seeded or sampled else 0.0, top_k=rng.choice([0, 20]),
            seed=rng.randrange(1 << 30) if seeded else None, min_tokens=rng.choice([0, 0, rng.randint(0, max_tokens)]),
            stop_token_ids=rng.sample(range(3, VOCAB), rng.choice([0, 0, 3, 8])), ignore_eos=rng.random() < 0.5,
            stop=rng.choice([[]] * 6 + [[f"w{rng.randrange(3, VOCAB)}"], ["w1", "w9"], ["1 w"]]),
            logprobs=rng.choice([None, None, 0, 3]), prompt_logprobs=rng.choice([None] * 4 + [0, 2]))
        r = rng.random()
        abort = ("waiting", 0) if r < 0.06 else ("prefill", 0) if r < 0.14 else \
            ("decode", rng.randint(1, max(1, max_tokens // 2))) if r < 0.25 else None
        jobs.append(Job(f"r{i}", prompt, params, rng.randint(0, 40), abort, compare=not sampled))
    return jobs


# -- the accounting ---------------------------------------------------------------------------------------------

def check_pool(engine: LLMEngine) -> None:
    """The pool's reference counts are the requests' block lists; its free lists hold exactly the unreferenced
    blocks (once each, a cached one under its own hash); only running requests hold blocks and state slots."""
    kv, pool, sched = engine.kv, engine.kv.pool, engine.scheduler
    refs = Counter(b.block_id for blocks in kv.req_blocks.values() for b in blocks)
    assert [b.ref_cnt for b in pool.blocks] == [refs[i] for i in range(pool.num_blocks)], "ref counts"
    empty, free = [b.block_id for b in pool.empty], list(pool.free)
    assert len(set(empty + free)) == len(empty) + len(free), "a block twice in the free lists"
    assert sorted(empty + free) == [b.block_id for b in pool.blocks if b.ref_cnt == 0], "free lists"
    assert all(b.block_hash is None for b in pool.empty) and all(b.block_hash is not None for b in pool.free.values())
    assert all(b.block_hash == h for h, b in pool.cached.items()), "a cached block under another hash"
    running = {r.request_id for r in sched.running}
    assert set(kv.req_blocks) == running, "blocks held by a request that is not running"
    for r in sched.running:
        assert len(kv.req_blocks[r.request_id]) * kv.block_size >= r.num_computed_tokens
    if kv.state_slots is not None:
        assert kv.state_slots.num_free == kv.state_slots.num_slots - len(running)
        assert all(kv.state_slots.has(rid) for rid in running)


def check_drained(engine: LLMEngine) -> None:
    """Everything finished or aborted: every block free and unreferenced, every state slot back."""
    kv, pool = engine.kv, engine.kv.pool
    assert not engine.has_unfinished_requests() and not engine.scheduler.requests and not kv.req_blocks
    assert pool.num_free_blocks == pool.num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)
    if kv.state_slots is not None:
        assert kv.state_slots.num_free == kv.state_slots.num_slots
    check_pool(engine)


# -- the soak ---------------------------------------------------------------------------------------------------

def soak(model: Model, seed: int, stats: Counter) -> None:
    rng = random.Random(seed)
    block_size = rng.choice([2, 4, 8])  # a pool of 40 to 72 tokens: a few requests fill it
    engine_kw = dict(block_size=block_size, num_blocks=rng.choice([40, 56, 72]) // block_size,
                     max_num_batched_tokens=rng.choice([3, 5, 8, 13]), max_num_seqs=rng.choice([2, 3, 4, 8]),
                     enable_prefix_caching=rng.random() < 0.85)
    if model.hybrid:  # fewer state slots than sequences, and few snapshots (LRU-evicted)
        engine_kw.update(num_state_slots=rng.choice([2, 3]), num_state_snapshots=rng.choice([1, 2, 4, 8]))
    engine = LLMEngine(model.model, model.config, model.tokenizer, **engine_kw)
    if NATIVE:  # the paths the runtime takes by default: the fused step for Llama, the modules for the hybrid
        assert kernels.enabled()
        assert (engine.runner.fused is not None and engine.runner.fused.usable()) is (not model.hybrid), \
            engine.runner.step_path
    jobs = workload(rng, model, 14, engine.max_model_len)
    pending = sorted(jobs, key=lambda j: j.arrive)
    by_id = {j.rid: j for j in jobs}
    final, aborted = {}, {}
    step = 0
    while pending or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests():
            step = max(step, pending[0].arrive)
        while pending and pending[0].arrive <= step:
            job = pending.pop(0)
            engine.add_request(job.prompt, replace(job.params), request_id=job.rid)
        for rid, req in list(engine.scheduler.requests.items()):
            phase, after = by_id[rid].abort or (None, 0)
            if phase == "waiting" and req.status is RequestStatus.WAITING \
                    or phase == "prefill" and 0 < req.num_computed_tokens < req.num_prompt_tokens \
                    or phase == "decode" and req.num_output_tokens >= after:
                aborted[rid] = list(req.output_token_ids)
                engine.abort_request(rid)
                stats[f"aborted {phase}"] += 1
        # blocks freed while cached (block id -> hash), before this step's admissions
        free_cached = {i: b.block_hash for i, b in engine.kv.pool.free.items()}
        running = {r.request_id for r in engine.scheduler.running}
        outs = engine.step()
        step += 1
        for r in engine.scheduler.running:  # admitted this step, with one of them as a prefix hit
            if r.request_id not in running and any(
                    free_cached.get(b) == h for b, h in zip(engine.kv.block_ids(r.request_id), r.block_hashes)):
                stats["hits on freed cached blocks"] += 1
        final.update({o.request_id: o for o in outs if o.finished})
        check_pool(engine)
    check_drained(engine)
    stats["steps"] += step
    stats["preemptions"] += engine.scheduler.num_preemptions
    stats["evictions"] += engine.kv.pool.num_evictions
    stats["prefix-hit tokens"] += engine.kv.prefix_hits

    for job in jobs:
        want = model.reference(job, engine.max_model_len)
        what = f"{model.name} seed {seed} {job.rid} ({job.params}, prompt {len(job.prompt)} tokens)"
        if job.rid in aborted:
            if job.compare:  # what it had produced is the start of its output alone
                assert aborted[job.rid] == want.token_ids[:len(aborted[job.rid])], what
            continue
        got = final[job.rid]
        stats["finished " + got.finish_reason] += 1
        stats["stopped by a string"] += isinstance(got.stop_reason, str)
        stats["cached prompt tokens"] += got.num_cached_tokens
        stats["preempted requests"] += got.num_preemptions > 0
        if not job.compare:
            continue
        stats["seeded" if job.params.seed is not None else "greedy"] += 1
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == \
            (want.token_ids, want.text, want.finish_reason, want.stop_reason), what
        stats["max logprob error"] = max(stats["max logprob error"],
                                         assert_logprobs(got.logprobs, want.logprobs, model.name, what + ": logprobs"),
                                         assert_logprobs(got.prompt_logprobs, want.prompt_logprobs, model.name,
                                                         what + ": prompt logprobs"))
        stats["prompt logprobs"] += got.prompt_logprobs is not None


def assert_logprobs(got, want, name, what) -> float:
    """The same tokens at every position, their values within LOGPROB_ATOL; returns the largest difference."""
    assert (got is None) == (want is None), what
    worst = 0.0
    assert len(got or ()) == len(want or ()), what
    for i, (g, w) in enumerate(zip(got or (), want or ())):
        assert (g is None) == (w is None) and list(g or ()) == list(w or ()), f"{what}, position {i}: {g} vs {w}"
        for t in g or ():
            worst = max(worst, abs(g[t] - w[t]))
            assert abs(g[t] - w[t]) <= LOGPROB_ATOL[name], f"{what}, position {i}, token {t}: {g[t]} vs {w[t]}"
    return worst


@pytest.mark.parametrize("which,seeds", [("llama", range(5)), ("bamba", range(100, 105))])
def test_soak_outputs_do_not_depend_on_the_schedule(which, seeds, request):
    model = request.getfixturevalue(which)
    stats = Counter()
    for seed in seeds:
        soak(model, seed, stats)
    print(which, dict(stats))
    # the workload reached what it is meant to exercise
    for what in ("preemptions", "evictions", "prefix-hit tokens", "hits on freed cached blocks", "aborted waiting",
                 "aborted prefill", "aborted decode", "finished stop", "finished length", "seeded",
                 "prompt logprobs", "preempted requests", "cached prompt tokens", "stopped by a string"):
        assert stats[what] > 0, f"{which}: the soak never reached {what!r}: {dict(stats)}"
