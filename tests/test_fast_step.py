"""The fast step (ModelRunner.fast_step: the fused driver's argmax, metadata kept and updated in place between decode
steps) against the general path (runner.fast = False: plan, fused.run, the Sampler) on the same requests: every
token, logprob and finish reason equal, while requests join and leave, sample with seeds, ask for logprobs mid-run,
hit the prefix cache, prefill in chunks, are preempted and recomputed. Each test also checks that the fast step ran
(and steadily), so none passes by never taking it."""
from __future__ import annotations

import pytest
import torch

from zoo import kernels
from zoo.runtime.engine import LLMEngine
from zoo.runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not kernels.enabled(), reason="the fast step runs on the native kernels")

BS = 4  # small blocks: decode steps cross block boundaries often


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from tiny import save_tiny
    from zoo.build import build_model

    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: extra threads only cost synchronisation
    model, config, _, _ = build_model(save_tiny("LlamaForCausalLM", tmp_path_factory.mktemp("llama"), vocab_size=256,
                                                hidden_size=128, intermediate_size=192, max_position_embeddings=1024,
                                                randomize=True))
    yield model, config
    torch.set_num_threads(n)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def prompt(i: int, n: int) -> list[int]:
    return [(7 * i + 3 * j) % 250 + 3 for j in range(n)]


def drive(model, config, arrivals: dict[int, list], *, fast: bool, modules: bool = False,
          **engine_kw) -> tuple[dict, LLMEngine]:
    """Step an engine to the end, adding arrivals[k] (request id, prompt, params) before step k: {request id:
    (tokens, logprobs, finish reason)} and the engine. `modules`: without the fused driver (the module path, where
    only the Sampler's greedy path is fast)."""
    engine = LLMEngine(model, config, block_size=BS, **{"num_blocks": 256, **engine_kw})
    engine.runner.fast = fast
    if modules:
        engine.runner.fused = None
    done, k = {}, 0
    while engine.has_unfinished_requests() or any(i >= k for i in arrivals):
        for rid, ids, params in arrivals.get(k, ()):
            engine.add_request(ids, params, request_id=rid)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.token_ids, out.logprobs, out.finish_reason)
        k += 1
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks  # every block came back
    return done, engine


def same_on_both_paths(model, config, arrivals, **engine_kw) -> tuple[dict, LLMEngine]:
    general, slow = drive(model, config, arrivals, fast=False, **engine_kw)
    got, engine = drive(model, config, arrivals, fast=True, **engine_kw)
    assert not slow.runner.sampler.fast and engine.runner.sampler.fast
    assert slow.runner.fast_steps == 0
    assert set(got) == {rid for wave in arrivals.values() for rid, _, _ in wave}
    for rid in general:
        assert got[rid][0] == general[rid][0], f"request {rid}: tokens differ"
        assert got[rid][2] == general[rid][2], f"request {rid}: finish reason differs"
        if general[rid][1] is not None:
            assert [list(d) for d in got[rid][1]] == [list(d) for d in general[rid][1]]
            assert [v for d in got[rid][1] for v in d.values()] == pytest.approx(
                [v for d in general[rid][1] for v in d.values()], abs=1e-5)
    return got, engine


def test_requests_joining_and_leaving(tiny_llama):
    """Greedy requests arrive at steps 0, 3 and 8 and finish at different steps: the batch changes under the fast
    step (planned afresh) and stays put between changes (steady steps)."""
    model, config = tiny_llama
    arrivals = {0: [("a", prompt(0, 5), greedy(20)), ("b", prompt(1, 9), greedy(6))],
                3: [("c", prompt(2, 3), greedy(15))],
                8: [("d", prompt(3, 13), greedy(9)), ("e", prompt(4, 1), greedy(1))]}
    got, engine = same_on_both_paths(model, config, arrivals)
    assert all(len(got[r][0]) == n for r, n in zip("abcde", (20, 6, 15, 9, 1)))
    assert engine.runner.steady_steps >= 8 and engine.runner.fast_steps > engine.runner.steady_steps


def test_seeded_sampling_and_logprobs_mid_run(tiny_llama):
    """A seeded sampling request and a greedy one that wants logprobs join mid-run: their steps take the general
    path, the steps before and after them the fast one; a greedy request with a repetition penalty too."""
    model, config = tiny_llama
    arrivals = {0: [("a", prompt(0, 6), greedy(30))],
                4: [("s", prompt(1, 5), SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=5,
                                                       ignore_eos=True))],
                12: [("l", prompt(2, 7), greedy(4, logprobs=2))],
                20: [("p", prompt(3, 4), greedy(3, repetition_penalty=1.3))]}
    got, engine = same_on_both_paths(model, config, arrivals)
    assert got["l"][1] is not None and len(got["l"][1]) == 4
    assert engine.runner.steady_steps > 5


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Gemma3ForCausalLM"])
def test_rope_tables_grown_by_the_general_path(arch, tmp_path):
    """A request of 300 prompt tokens that wants logprobs runs on the general path between fast steps and grows the
    rope tables past 256 positions (the old tables freed): the fast steps after it point at the new tables. Each
    path on a model of its own (the tables are the model's). Gemma3: a table per rope base, each layer its own."""
    from tiny import save_tiny
    from zoo.build import build_model

    extra = dict(head_dim=32, sliding_window=8, layer_types=["sliding_attention", "full_attention"]) \
        if arch == "Gemma3ForCausalLM" else {}
    path = save_tiny(arch, tmp_path, vocab_size=256, max_position_embeddings=1024, randomize=True, **extra)
    arrivals = {0: [("a", prompt(0, 6), greedy(40))],
                6: [("long", prompt(1, 300), greedy(2, logprobs=1))]}
    runs = {fast: drive(*build_model(path)[:2], arrivals, fast=fast) for fast in (True, False)}  # (fast first:
    # builds of one config share their ropes, rotary.get_rope: the general run would grow them first)
    assert {r: v[0] for r, v in runs[True][0].items()} == {r: v[0] for r, v in runs[False][0].items()}
    fused, buffers = runs[True][1].runner.fused, runs[True][1].runner.buffers
    assert fused is not None and runs[True][1].runner.steady_steps > 20
    tables = fused._tables([1])  # each rope's table now (grown to 512 rows by the long prompt)
    assert tables[0][0].shape[0] == buffers.args.table_len == 512 and buffers.args.cos == tables[0][0].data_ptr()
    if len(tables) > 1:
        assert [layer.cos for layer in fused.layers] == [tables[i][0].data_ptr() for i in fused.meta["layer_rope"]]


@pytest.mark.parametrize("caching", [True, False])
def test_prefix_hits_chunked_prefill_and_preemption(tiny_llama, caching):
    """Prompts sharing a prefix (hits with caching), prefills in chunks of 6 tokens (steps where a chunk does not
    sample: the general path), and a pool of 14 blocks that preempts: requests recomputed and back in the batch
    with other blocks."""
    model, config = tiny_llama
    shared = prompt(9, 12)
    arrivals = {0: [("a", shared + [5, 6], greedy(24)), ("b", prompt(1, 10), greedy(18))],
                2: [("c", shared + [7], greedy(20))],
                5: [("d", shared + [8, 9, 10], greedy(16)), ("e", prompt(2, 3), greedy(12))]}
    got, engine = same_on_both_paths(model, config, arrivals, num_blocks=14, max_num_batched_tokens=6,
                                     enable_prefix_caching=caching)
    assert engine.scheduler.num_preemptions > 0
    assert engine.runner.steady_steps > 5
    if caching:
        assert engine.kv.prefix_hits > 0


def test_module_path_sampler_greedy(tiny_llama):
    """Without the fused driver, the Sampler's greedy path (one argmax into reused buffers) against its general
    draw: requests joining and leaving, a seeded sampling one and one with logprobs among them."""
    model, config = tiny_llama
    arrivals = {0: [("a", prompt(0, 5), greedy(12)), ("b", prompt(1, 9), greedy(5))],
                3: [("s", prompt(2, 4), SamplingParams(temperature=1.0, seed=5, max_tokens=4, ignore_eos=True))],
                9: [("l", prompt(3, 6), greedy(3, logprobs=1))]}
    same_on_both_paths(model, config, arrivals, modules=True)


@pytest.mark.parametrize("modules", [False, True], ids=["fused", "modules"])
def test_non_finite_logits_end_the_request_on_both_paths(tiny_llama, modules):
    """A NaN in the head: every logit NaN (the argmax's value is not finite), so the request ends with
    finish_reason 'error' and no token, on the fast paths as on the general path."""
    model, config = tiny_llama
    head = model.lm_head.weight
    saved = head.detach().clone()
    try:
        with torch.no_grad():
            head[:, 0] = float("nan")  # every logit NaN for a hidden state whose first feature is not 0
        got, _ = same_on_both_paths(model, config, {0: [("a", prompt(0, 5), greedy(4))]}, modules=modules)
    finally:
        with torch.no_grad():
            head.copy_(saved)
    assert got["a"][2] == "error" and got["a"][0] == []


def test_what_a_steady_step_rechecks(tiny_llama):
    """Between two steady steps (one block of 16 tokens: none crosses a block): a hook registered is called on the
    next step (the modules run it), and the fast step comes back once it is removed; a weight whose .data is
    replaced leaves the driver until it is put back; a request whose block list is another list is planned
    afresh."""
    model, config = tiny_llama
    engine = LLMEngine(model, config, block_size=16, num_blocks=16)
    runner = engine.runner
    rid = engine.add_request(prompt(0, 5), greedy(40))

    def step(fast: int, steady: int) -> None:  # one step: how many fast and steady steps it adds
        before = runner.fast_steps, runner.steady_steps
        engine.step()
        assert (runner.fast_steps - before[0], runner.steady_steps - before[1]) == (fast, steady)

    step(1, 0)
    step(1, 1)
    calls = []
    handle = model.model.layers[1].mlp.register_forward_hook(lambda *a: calls.append(1))
    try:
        step(0, 0)
        assert calls == [1]
    finally:
        handle.remove()
    step(1, 0)
    step(1, 1)
    weight = model.model.layers[0].mlp.down_proj.weight
    packed = weight.data  # (a reference more to the packed buffer: the next check reads every pointer)
    step(1, 1)
    try:
        weight.data = packed.clone()
        assert not runner.fused.usable()
        step(0, 0)
    finally:
        weight.data = packed
    step(1, 0)
    step(1, 1)
    engine.kv.req_blocks[rid] = list(engine.kv.req_blocks[rid])
    step(1, 0)
    step(1, 1)


@pytest.mark.parametrize("dtype", [None, "bfloat16"], ids=["gguf-quantized", "bfloat16"])
def test_embedded_model(dtype):
    """The embedded SmolLM2 as zoo run loads it (the GGUF's blocks kept quantized) and in bfloat16, on both paths:
    engine steps with a request joining late (equal greedy tokens), and LLM.generate, whose requests' text waits
    to be detokenised until they end on the fast path unless they have stop strings (equal outputs, every field)."""
    from zoo import LLM

    llm = LLM(dtype=dtype)
    runner, tok = llm.engine.runner, llm.get_tokenizer()
    arrivals = {0: [("a", tok.encode("The capital of France is"), greedy(12)),
                    ("b", tok.encode("def fibonacci(n):"), greedy(8))],
                3: [("c", tok.encode("Once upon a time"), greedy(10))]}
    prompts = ["Name three colours.", "Count to ten:", "Write a haiku about the sea."]
    params = [SamplingParams(temperature=0, max_tokens=24, stop=["answer is"]), SamplingParams(temperature=0,
              max_tokens=24), SamplingParams(temperature=0, max_tokens=6)]  # a stop string, EOS, the length
    got, outputs = {}, {}
    for fast in (False, True):
        runner.fast = fast
        done, k = {}, 0
        while llm.engine.has_unfinished_requests() or k <= max(arrivals):
            for rid, ids, sp in arrivals.get(k, ()):
                llm.engine.add_request(ids, sp, request_id=f"{rid}{fast}")
            for out in llm.engine.step():
                if out.finished:
                    done[out.request_id[:-len(str(fast))]] = out.token_ids
            k += 1
        got[fast] = done
        outputs[fast] = [{k: v for k, v in vars(o).items() if k != "request_id"}
                         for o in llm.generate(prompts, params)]
    assert got[True] == got[False] and len(got[True]) == 3
    assert outputs[True] == outputs[False]
    assert [(o["finish_reason"], o["stop_reason"]) for o in outputs[True]] == [("stop", "answer is"), ("stop", 2),
                                                                                ("length", None)]
    assert runner.steady_steps > 5
