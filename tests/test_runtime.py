"""Runtime bookkeeping: block pool reference counts, chained prefix hashes, LRU eviction, the scheduler's
budget, chunking, continuous batching and preemption (with a model: tests/test_generate.py)."""
import pytest

from zoo.runtime.block_pool import BlockPool, hash_block
from zoo.runtime.kv_cache import KVCacheManager
from zoo.runtime.request import Request, RequestStatus
from zoo.runtime.sampling_params import SamplingParams
from zoo.runtime.scheduler import Scheduler

BS = 4


def req(rid, n_prompt, max_tokens=8, first=0, salt=None):
    return Request(rid, list(range(first, first + n_prompt)), SamplingParams(max_tokens=max_tokens, temperature=0),
                   cache_salt=salt)


def run_step(sched, token=7):
    """Schedule one step and feed back `token` for every request that samples (no model involved)."""
    out = sched.schedule()
    sampled = {s.request.request_id: token for s in out.scheduled if s.samples}
    finished = sched.update_from_output(out, sampled)
    return out, finished


# -- block pool --------------------------------------------------------------------------------------
def test_block_pool_refcounts_and_free_list():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert (a.ref_cnt, b.ref_cnt, pool.num_free_blocks) == (1, 1, 2)
    pool.touch([a])
    assert a.ref_cnt == 2
    pool.release([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.release([b, a])
    assert pool.num_free_blocks == 4
    with pytest.raises(RuntimeError, match="nobody references"):
        pool.release([a])
    with pytest.raises(RuntimeError, match="asked for 5 blocks"):
        pool.allocate(5)


def test_freed_cached_blocks_are_evicted_least_recently_used_first():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for i, blk in enumerate(blocks):
        pool.cache(blk, bytes([i]) * 16)
    pool.release([blocks[1]])
    pool.release([blocks[0]])
    pool.release([blocks[2]])
    assert pool.lookup(bytes([0]) * 16) is blocks[0]
    # A cache hit takes block 0 off the free list: it must not be evicted while referenced.
    pool.touch([blocks[0]])
    (new,) = pool.allocate(1)
    assert new is blocks[1]  # the least recently freed unreferenced block
    assert pool.lookup(bytes([1]) * 16) is None and new.block_hash is None and pool.num_evictions == 1
    assert pool.lookup(bytes([2]) * 16) is blocks[2]


def test_empty_blocks_are_reused_warmest_first_before_evicting_cached_ones():
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    pool.cache(a, b"a" * 16)
    pool.release([a])  # cached: kept as long as an empty block is left
    pool.release([b])
    pool.release([c])
    assert pool.allocate(1) == [c]  # the most recently freed empty block (its memory is the warmest)
    assert pool.allocate(1) == [b] and pool.num_evictions == 0
    assert pool.lookup(b"a" * 16) is a
    assert pool.allocate(1) == [a] and pool.num_evictions == 1 and pool.lookup(b"a" * 16) is None


def test_block_hash_chains_parent_tokens_and_namespace():
    h1 = hash_block(None, [1, 2, 3, 4], "m")
    assert h1 == hash_block(None, [1, 2, 3, 4], "m")
    assert h1 != hash_block(None, [1, 2, 3, 5], "m")
    assert h1 != hash_block(None, [1, 2, 3, 4], "m|salt")
    # Same tokens in the second block, different first block: different hash (it names the whole prefix).
    assert hash_block(h1, [5, 6, 7, 8], "m") != hash_block(hash_block(None, [0, 2, 3, 4], "m"), [5, 6, 7, 8], "m")


# -- prefix caching through the manager ----------------------------------------------------------------
def test_prefix_hit_reuses_complete_blocks_and_leaves_one_token_to_compute():
    kv = KVCacheManager(16, BS, namespace="model")
    a = req("a", 10)
    assert kv.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    kv.cache_blocks(a)  # blocks 0, 1 complete; the third holds 2 tokens and is not cached
    assert len(kv.pool.cached) == 2
    b = req("b", 10)
    blocks, n = kv.get_computed_blocks(b)
    assert n == 8 and [x.block_id for x in blocks] == kv.block_ids("a")[:2]
    # A prompt of exactly 8 tokens can reuse only one block: at least one token is computed.
    c = req("c", 8)
    assert kv.get_computed_blocks(c)[1] == 4
    # Another salt is another namespace: no hit.
    assert kv.get_computed_blocks(req("d", 10, salt="user-2"))[1] == 0
    assert kv.allocate_slots(b, 2, blocks)
    assert [blk.ref_cnt for blk in blocks] == [2, 2]
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 16 and len(kv.pool.cached) == 2  # freed but still cached


def test_allocate_slots_fails_without_side_effects():
    kv = KVCacheManager(3, BS)
    a = req("a", 12)
    assert not kv.allocate_slots(a, 13)
    assert kv.num_free_blocks == 3 and kv.block_ids("a") == []
    assert kv.allocate_slots(a, 12)
    assert kv.num_free_blocks == 0


# -- scheduler -----------------------------------------------------------------------------------------
def test_budget_chunks_prefill_and_decodes_go_first():
    sched = Scheduler(KVCacheManager(64, BS), max_num_batched_tokens=10, max_num_seqs=8)
    sched.add_request(req("a", 6))
    sched.add_request(req("b", 12, first=100))
    out, _ = run_step(sched)
    assert [(s.request.request_id, s.num_new_tokens, s.samples) for s in out.scheduled] == \
        [("a", 6, True), ("b", 4, False)]
    out, _ = run_step(sched)  # a decodes (1 token) first, b continues its prefill with the rest of the budget
    assert [(s.request.request_id, s.num_computed_tokens, s.num_new_tokens, s.samples) for s in out.scheduled] == \
        [("a", 6, 1, True), ("b", 4, 8, True)]
    assert out.num_batched_tokens == 9
    out, _ = run_step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 1)]


def test_continuous_batching_requests_join_and_leave_each_step():
    sched = Scheduler(KVCacheManager(64, BS), max_num_batched_tokens=64, max_num_seqs=2)
    sched.add_request(req("a", 3, max_tokens=2))
    sched.add_request(req("b", 3, max_tokens=4, first=10))
    sched.add_request(req("c", 3, max_tokens=1, first=20))
    out, fin = run_step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["a", "b"]  # max_num_seqs = 2
    out, fin = run_step(sched)
    assert [r.request_id for r in fin] == ["a"] and fin[0].finish_reason == "length"
    out, fin = run_step(sched)  # c joins in the step after a left
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("b", 1), ("c", 3)]
    assert [r.request_id for r in fin] == ["c"]
    while sched.has_unfinished():
        run_step(sched)
    assert sched.kv.num_free_blocks == 64


def test_stop_token_and_eos_finish_requests():
    sched = Scheduler(KVCacheManager(16, BS))
    r = Request("a", [1, 2, 3], SamplingParams(max_tokens=10), eos_token_ids={7})
    r2 = Request("b", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True), eos_token_ids={7})
    sched.add_request(r)
    sched.add_request(r2)
    _, fin = run_step(sched, token=7)
    assert fin == [r] and r.status is RequestStatus.FINISHED_STOPPED and r.stop_reason == 7
    while sched.has_unfinished():
        run_step(sched, token=7)
    assert r2.output_token_ids == [7, 7, 7] and r2.finish_reason == "length"


def test_min_tokens_holds_stop_tokens_back():
    sched = Scheduler(KVCacheManager(16, BS))
    r = Request("a", [1, 2, 3], SamplingParams(max_tokens=10, min_tokens=3), eos_token_ids={7})
    sched.add_request(r)
    while sched.has_unfinished():
        run_step(sched, token=7)
    assert r.output_token_ids == [7, 7, 7, 7] and r.finish_reason == "stop"
    with pytest.raises(ValueError, match="min_tokens=11"):
        SamplingParams(max_tokens=10, min_tokens=11)


def test_preemption_frees_blocks_and_requeues_at_the_front():
    sched = Scheduler(KVCacheManager(4, BS, enable_caching=False), max_num_batched_tokens=64)
    a, b = req("a", 4, max_tokens=6), req("b", 4, max_tokens=6, first=50)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched)  # 4 prompt tokens each: one block each
    run_step(sched)  # the 5th token: a second block each, the pool is full
    assert a.num_computed_tokens == 5 and b.num_computed_tokens == 5 and sched.kv.num_free_blocks == 0
    for _ in range(3):
        run_step(sched)
    # Both hold 8 tokens in 2 blocks; the 9th needs a third block: b (admitted later) is preempted.
    out, _ = run_step(sched)
    assert out.preempted == [b] and [s.request for s in out.scheduled] == [a]
    assert b.status is RequestStatus.PREEMPTED and sched.waiting[0] is b and b.num_computed_tokens == 0
    assert b.output_token_ids == [7] * 5  # outputs kept: they are part of the prefix it recomputes
    while sched.has_unfinished():
        run_step(sched)
    assert a.output_token_ids == [7] * 6 and b.output_token_ids == [7] * 6
    assert sched.kv.num_free_blocks == 4


def test_add_request_errors_name_the_request():
    sched = Scheduler(KVCacheManager(2, BS), max_model_len=100)
    with pytest.raises(ValueError, match="request 'x'.*need 3 KV blocks"):
        sched.add_request(req("x", 9))
    with pytest.raises(ValueError, match="max_model_len=100"):
        sched.add_request(req("y", 100))
    sched.add_request(req("z", 3))
    with pytest.raises(ValueError, match="'z' is already"):
        sched.add_request(req("z", 3))


# -- preemption with a model: a small pool gives the same outputs as a large one ------------------------
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    import torch

    from tiny import save_tiny
    from zoo.build import build_model

    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: extra threads only cost synchronisation
    model, config, _, _ = build_model(save_tiny("LlamaForCausalLM", tmp_path_factory.mktemp("llama")))
    yield model, config
    torch.set_num_threads(n)


@pytest.mark.parametrize("caching", [True, False])
def test_small_pool_preempts_and_gives_the_same_outputs(tiny_llama, caching):
    from zoo.runtime.engine import LLMEngine

    model, config = tiny_llama
    prompts = [[3 + i + j for j in range(5 + 3 * i)] for i in range(5)]
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=24, ignore_eos=True)
              for i in range(5)]
    params[0] = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for i in (2, 4):  # these also want their prompt's logprobs: a recomputed prompt must not add them twice
        params[i].prompt_logprobs = 2

    def outputs(num_blocks):
        engine = LLMEngine(model, config, num_blocks=num_blocks, block_size=BS, enable_prefix_caching=caching)
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(p, sp, request_id=str(i))
        done, plp = {}, {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    done[o.request_id], plp[o.request_id] = o.token_ids, o.prompt_logprobs
        assert engine.kv.num_free_blocks == num_blocks  # every block came back
        return [done[str(i)] for i in range(5)], engine.scheduler.num_preemptions, [plp[str(i)] for i in range(5)]

    large, n_large, plp_large = outputs(256)
    small, n_small, plp_small = outputs(12)  # the longest request alone needs 10 blocks
    assert n_large == 0 and n_small > 0
    assert small == large and all(len(o) == 24 for o in small)
    for i in (2, 4):
        assert len(plp_small[i]) == len(prompts[i]) and plp_small[i][0] is None
        assert [list(d) for d in plp_small[i][1:]] == [list(d) for d in plp_large[i][1:]]
        assert [v for d in plp_small[i][1:] for v in d.values()] == pytest.approx(
            [v for d in plp_large[i][1:] for v in d.values()], abs=1e-5)


def test_prompt_logprobs_survive_preemption_mid_prompt(tiny_llama):
    """Chunks of 6 tokens and a pool of 12 blocks: requests are preempted between the chunks of their prompt and
    recompute it; each prompt token's logprobs are recorded once, as an unhurried run records them."""
    from zoo.runtime.engine import LLMEngine

    model, config = tiny_llama
    prompts = [[3 + i + j for j in range(5 + 3 * i)] for i in range(5)]

    def run(num_blocks, chunk):
        engine = LLMEngine(model, config, num_blocks=num_blocks, block_size=BS, max_num_batched_tokens=chunk)
        for i, p in enumerate(prompts):
            engine.add_request(p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                 prompt_logprobs=2 if i in (2, 4) else None), request_id=str(i))
        done, mid = {}, 0
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.prompt_logprobs for o in engine.step() if o.finished})
            mid += sum(1 for r in engine.scheduler.waiting if r.num_preemptions and r.prompt_logprobs is not None
                       and 1 < len(r.prompt_logprobs) < r.num_prompt_tokens)
        return done, mid

    (calm, _), (hurried, mid) = run(256, 2048), run(12, 6)
    assert mid > 0  # (a request did wait, preempted, with part of its prompt's logprobs)
    for i in ("2", "4"):
        assert len(hurried[i]) == len(prompts[int(i)]) and [list(d or ()) for d in hurried[i]] == \
            [list(d or ()) for d in calm[i]]
        assert [v for d in hurried[i][1:] for v in d.values()] == pytest.approx(
            [v for d in calm[i][1:] for v in d.values()], abs=1e-5)


def test_a_request_larger_than_the_pool_is_refused_by_name(tiny_llama):
    from zoo.runtime.engine import LLMEngine

    model, config = tiny_llama
    engine = LLMEngine(model, config, num_blocks=4, block_size=BS)
    assert engine.max_model_len == 16  # capped by the pool: a request always fits it alone
    with pytest.raises(ValueError, match="request 'big'.*max_model_len=16"):
        engine.add_request(list(range(1, 20)), SamplingParams(), request_id="big")
    engine.add_request(list(range(1, 10)), SamplingParams(max_tokens=50, ignore_eos=True), request_id="ok")
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert outs[0].finish_reason == "length" and len(outs[0].token_ids) == 16 - 9
