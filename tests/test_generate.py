"""Greedy generation through the runtime equals transformers' `generate` on the same files, token for
token and logits at every step (float32), whatever way the runtime schedules the work: a request
alone, a ragged batch, chunked prefill, after a prefix-cache hit, and under preemption."""
import pytest
import torch

from tiny import load_reference, save_tiny
from zoo.build import build_model
from zoo import LLM
from zoo.runtime.engine import LLMEngine
from zoo.runtime.sampling_params import SamplingParams

STEPS = 32
BS = 4
PROMPTS = [
    [5, 17, 99, 3, 42, 8, 77, 12, 64, 31, 9, 100, 23, 54, 6, 88, 19, 71, 40],  # 19 tokens
    [11, 22, 33, 44, 55, 66, 77],
    [7, 3, 120],
    [5, 17, 99, 3, 42, 8, 77, 12, 64, 31, 2, 90],  # shares 2 blocks with the first
]
ARCHS = {
    "LlamaForCausalLM": dict(),
    "MistralForCausalLM": dict(sliding_window=8),
    "Qwen2ForCausalLM": dict(),
    "Qwen3ForCausalLM": dict(head_dim=16),
    "Gemma3ForCausalLM": dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                              layer_types=["sliding_attention", "full_attention"]),
}


@pytest.fixture(scope="module", params=list(ARCHS))
def case(request, tmp_path_factory):
    arch = request.param
    path = save_tiny(arch, tmp_path_factory.mktemp(arch), **ARCHS[arch])
    ref = load_reference(path)
    ref.generation_config.eos_token_id = None  # 32 tokens whatever comes out
    expected = []
    for prompt in PROMPTS:
        with torch.no_grad():
            g = ref.generate(torch.tensor([prompt]), max_new_tokens=STEPS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
        expected.append((g.sequences[0, len(prompt):].tolist(), torch.cat(g.logits)))  # [STEPS], [STEPS, V]
    model, config, _, _ = build_model(path)
    return model, config, expected, path


def run(model, config, prompts, *, repeat=1, **engine_kw):
    """Run the prompts (all added at once, `repeat` rounds) -> per round, per prompt: (tokens, logits)."""
    engine = LLMEngine(model, config, block_size=BS, **engine_kw)
    rows = {}
    engine.runner.logits_hook = lambda reqs, logits: [rows.setdefault(r.request_id, []).append(l)
                                                       for r, l in zip(reqs, logits)]
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    rounds = []
    for k in range(repeat):
        ids = [engine.add_request(p, params, request_id=f"{k}-{i}") for i, p in enumerate(prompts)]
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        rounds.append([(done[i].token_ids, torch.stack(rows[i]), done[i]) for i in ids])
    return engine, rounds


def check(got, expected, which):
    for i, ((tokens, logits, _), (ref_tokens, ref_logits)) in enumerate(zip(got, expected)):
        assert tokens == ref_tokens, f"{which}: prompt {i}: tokens differ from transformers"
        torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4, msg=lambda m: f"{which} prompt {i}: {m}")


def test_alone(case):
    model, config, expected, _ = case
    for i, prompt in enumerate(PROMPTS):
        _, (got,) = run(model, config, [prompt], max_num_seqs=1)
        check(got, expected[i:i + 1], f"alone {i}")


def test_ragged_batch(case):
    model, config, expected, _ = case
    _, (got,) = run(model, config, PROMPTS)
    check(got, expected, "ragged batch")


def test_chunked_prefill(case):
    model, config, expected, _ = case
    engine, (got,) = run(model, config, PROMPTS, max_num_batched_tokens=5, enable_prefix_caching=False)
    check(got, expected, "chunked prefill")


def test_prefix_cache_hit(case):
    model, config, expected, _ = case
    engine, (first, second) = run(model, config, PROMPTS, repeat=2)
    check(first, expected, "first round")
    check(second, expected, "second round (prefix-cache hit)")
    assert [o.num_cached_tokens for _, _, o in first] == [0, 0, 0, 0]  # admitted together: nothing published yet
    assert second[0][2].num_cached_tokens == 16  # (19 - 1) // 4 whole blocks: one token left to compute
    assert engine.kv.prefix_hits > 0


def test_preemption_small_pool(case):
    model, config, expected, _ = case
    engine, (got,) = run(model, config, PROMPTS, num_blocks=16)  # 52 tokens = 13 blocks for the longest
    check(got, expected, "preemption")
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv.num_free_blocks == 16


def test_llm_api_on_the_directory(case):
    _, _, expected, path = case
    llm = LLM(str(path), num_blocks=64, block_size=BS)
    outs = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=2))
    for out, (ref_tokens, ref_logits) in zip(outs, expected):
        assert out.token_ids == ref_tokens and out.finish_reason == "length"
        ref_lp = ref_logits.log_softmax(-1)  # [STEPS, V]
        for step, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
            assert len(lp) == 2 and next(iter(lp)) == token  # greedy: the sampled token is the top one
            assert abs(lp[token] - ref_lp[step, token].item()) < 1e-4


def test_seeded_sampling_alone_equals_in_a_batch(case):
    model, config, _, _ = case
    seeded = SamplingParams(temperature=1.0, top_k=20, seed=1234, max_tokens=16, ignore_eos=True)
    other = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True)

    def tokens(prompts_and_params, want):
        engine = LLMEngine(model, config, block_size=BS)
        ids = [engine.add_request(p, sp) for p, sp in prompts_and_params]
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        return done[ids[want]]

    alone = tokens([(PROMPTS[1], seeded)], 0)
    packed = tokens([(PROMPTS[0], other), (PROMPTS[2], seeded), (PROMPTS[1], seeded), (PROMPTS[3], other)], 2)
    assert packed == alone


def test_min_tokens_equals_transformers_min_new_tokens(tmp_path):
    """A stop token that greedy decoding meets early (the first output token that comes back later): min_tokens
    holds it back, masked, as transformers' min_new_tokens does with its EOS; the outputs are equal."""
    path = save_tiny("LlamaForCausalLM", tmp_path)
    ref = load_reference(path)
    llm = LLM(str(path), num_blocks=64, block_size=BS)
    prompt = PROMPTS[0]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True))[0].token_ids
    first = next((i for i, t in enumerate(free) if t in free[i + 1:]), 2)  # (no repeat: the third token)
    stop = free[first]
    for min_tokens in (0, first + 2):
        (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True,
                                                       stop_token_ids=[stop], min_tokens=min_tokens))
        with torch.no_grad():
            g = ref.generate(torch.tensor([prompt]), max_new_tokens=STEPS, min_new_tokens=min_tokens,
                             eos_token_id=stop, do_sample=False, pad_token_id=0)
        want = g[0, len(prompt):].tolist()
        assert out.token_ids == want, f"min_tokens={min_tokens}"
        assert (out.finish_reason, out.token_ids[-1]) == ("stop", stop) or len(want) == STEPS
        assert (len(want) == first + 1) == (min_tokens == 0)  # stopped at its first chance only without min_tokens
