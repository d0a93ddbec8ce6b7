"""Hostile and careless input to the runtime: every bad SamplingParams field or prompt is a ValueError naming
it before any step runs; a failed generate leaves nothing behind; two threads on one LLM get their own
answers; NaN logits end a request with finish_reason "error" instead of sampling token 0 for ever."""
import math
import threading

import pytest
import torch

from tiny import save_tiny
from zoo import LLM
from zoo.build import build_model
from zoo.runtime.engine import LLMEngine
from zoo.runtime.sampling_params import SamplingParams

VOCAB = 128  # tests/tiny.py's BASE


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_tiny("LlamaForCausalLM", tmp_path_factory.mktemp("hostile-llama"))
    model, config, _, _ = build_model(path)
    return model, config


def make_llm(tiny, **kw):
    model, config = tiny
    return LLM.from_engine(LLMEngine(model, config, block_size=4, **kw))


def pool_is_empty(llm) -> bool:
    pool = llm.engine.kv.pool
    return (not llm.engine.scheduler.requests and not llm.engine.has_unfinished_requests()
            and pool.num_free_blocks == pool.num_blocks and all(b.ref_cnt == 0 for b in pool.blocks))


@pytest.mark.parametrize("field, value", [
    ("top_k", -5), ("top_k", 2.5), ("max_tokens", 2.5), ("max_tokens", 0), ("max_tokens", True),
    ("min_tokens", -1), ("logprobs", -1), ("logprobs", 1.5), ("seed", 10 ** 23), ("seed", 1.0),
    ("stop_token_ids", [2.0]), ("stop_token_ids", [-1]), ("stop_token_ids", 5), ("temperature", math.nan),
    ("temperature", math.inf), ("top_p", math.nan), ("min_p", math.nan), ("repetition_penalty", math.inf),
    ("presence_penalty", math.nan), ("frequency_penalty", -math.inf), ("frequency_penalty", "1"),
    ("ignore_eos", "no"), ("stop", [""]),
])
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^SamplingParams\.{field}="):
        SamplingParams(**{field: value})


def test_edge_values_that_are_fine_stay_fine():
    import numpy as np

    p = SamplingParams(top_k=-1, seed=2 ** 64 - 1, stop_token_ids=[np.int64(3)], max_tokens=np.int32(4),
                       temperature=0, presence_penalty=1)
    assert p.top_k == 0 and type(p.stop_token_ids[0]) is int and type(p.max_tokens) is int
    assert type(p.presence_penalty) is float
    SamplingParams(seed=-(2 ** 63))


@pytest.mark.parametrize("field, value", [("block_size", 0), ("block_size", 2.5), ("num_blocks", 0),
                                          ("max_model_len", -1), ("max_model_len", 0), ("kv_cache_memory", -5),
                                          ("max_num_seqs", 0), ("max_num_batched_tokens", True)])
def test_bad_engine_sizes_name_the_argument(tiny, field, value):
    model, config = tiny
    with pytest.raises(ValueError, match=rf"^LLMEngine: {field}={value!r} must be a positive integer"):
        LLMEngine(model, config, **{field: value})


@pytest.mark.parametrize("prompt, params, match", [
    ([1, VOCAB, 3], None, rf"prompt token 1 is {VOCAB}, outside the vocabulary of {VOCAB} tokens"),
    ([1, -1], None, "prompt token 1 is -1, outside"),
    ([1.0, 2.0], None, r"prompt token 0 is 1\.0: token ids must be integers"),
    ([1, True], None, "prompt token 1 is True"),
    ([], None, "the prompt has no tokens"),
    ({"ids": [1]}, None, "must be a string or a list of token ids"),
    ([1, 2], SamplingParams(stop_token_ids=[VOCAB]), rf"stop_token_ids=\[{VOCAB}\]: {VOCAB} is outside"),
    ([1, 2], SamplingParams(logprobs=VOCAB + 1), "logprobs=129: more than the vocabulary's 128"),
])
def test_bad_prompts_are_refused_at_add_request(tiny, prompt, params, match):
    llm = make_llm(tiny)
    with pytest.raises(ValueError, match=match):
        llm.engine.add_request(prompt, params)
    assert pool_is_empty(llm)


def test_a_refused_prompt_aborts_the_rest_of_its_generate_and_generate_returns_only_its_own(tiny):
    llm = make_llm(tiny, max_model_len=24)
    ok, too_long, greedy = [5, 6, 7], list(range(3, 40)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with pytest.raises(ValueError, match="does not fit max_model_len=24"):
        llm.generate([ok, too_long], greedy)
    assert pool_is_empty(llm)  # `ok` was not left queued
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([ok, [1, 999]], greedy)
    assert pool_is_empty(llm)
    alone = llm.generate([ok], greedy)[0].token_ids
    orphan = llm.engine.add_request([9, 9, 9], SamplingParams(max_tokens=2, ignore_eos=True))  # added directly
    outs = llm.generate([ok, [8, 9]], greedy)
    assert [o.request_id for o in outs] != [orphan] and len(outs) == 2 and outs[0].token_ids == alone
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert pool_is_empty(llm)


def test_a_failing_step_aborts_the_generate_and_frees_its_blocks(tiny):
    llm = make_llm(tiny)

    def boom(reqs, logits):
        raise RuntimeError("injected")

    llm.engine.runner.logits_hook = boom
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate([[1, 2, 3], [4, 5, 6, 7, 8]], SamplingParams(max_tokens=3))
    assert pool_is_empty(llm)
    llm.engine.runner.logits_hook = None
    stream = llm.stream([[1, 2, 3]], SamplingParams(max_tokens=5, ignore_eos=True))
    next(stream)
    with pytest.raises(RuntimeError, match="already running a generate or stream of this LLM"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=2))
    stream.close()
    assert pool_is_empty(llm)


def test_two_threads_on_one_llm_get_their_own_results(tiny):
    llm = make_llm(tiny)
    prompts = [[[1 + t, 2 + t, 3 + t, 4 + i] for i in range(3)] for t in range(4)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = [[o.token_ids for o in llm.generate(p, params)] for p in prompts]
    got, errors = {}, []

    def work(t):
        try:
            for _ in range(3):
                outs = llm.generate(prompts[t], params)
                got.setdefault(t, []).append([o.token_ids for o in outs])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors
    assert all(got[t] == [expected[t]] * 3 for t in range(4))
    assert pool_is_empty(llm)


def test_nan_logits_end_the_request_with_an_error_not_token_zero_for_ever(tiny):
    llm = make_llm(tiny)
    good = llm.generate([[4, 5, 6]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]

    def poison(reqs, logits):  # the raw logits of one request become NaN (as NaN weights would make them)
        for i, r in enumerate(reqs):
            if r.prompt_token_ids == [7, 8]:
                logits[i] = math.nan

    llm.engine.runner.logits_hook = poison
    for params in (SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                   SamplingParams(temperature=0.8, top_p=0.9, seed=1, ignore_eos=True)):
        ok, bad = llm.generate([[4, 5, 6], [7, 8]], params)
        assert bad.finish_reason == "error" and bad.token_ids == [] and "NaN" in bad.stop_reason
        assert ok.finish_reason == "length" and len(ok.token_ids) == params.max_tokens
        assert params.temperature or ok.token_ids[:3] == good.token_ids  # the other request went on undisturbed
    assert pool_is_empty(llm)
    inf_logits = torch.zeros(2, VOCAB)
    inf_logits[:, 7] = math.inf  # an overflow: softmax makes the sampled row NaN, argmax picks the infinity
    from zoo.runtime.request import Request
    reqs = [Request(str(i), [1], SamplingParams(temperature=t)) for i, t in enumerate((0.7, 0))]
    assert llm.engine.runner.sampler(inf_logits, reqs).token_ids == [None, None]


# -- the command line and the chat template --------------------------------------------------------------
LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{{ j }}{% endfor %}{% endfor %}"


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    from test_cli_run import save_chat_model

    return save_chat_model(tmp_path_factory.mktemp("hostile-chat"))


@pytest.mark.parametrize("template, match", [
    (LOOPS, r"did not finish rendering within 0\.3 s"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recurses without end"),
    ("{{ raise_exception('no system role') }}", "fails: TemplateError: no system role"),
    ("{% for %}", "fails: TemplateSyntaxError"),
])
def test_a_hostile_chat_template_is_a_value_error_in_bounded_time(chat_dir, template, match):
    import time

    from zoo.runtime.model_files import load_tokenizer, resolve_model

    llm = LLM.__new__(LLM)
    llm.files = resolve_model(str(chat_dir))
    llm.tokenizer = load_tokenizer(llm.files)
    assert llm.apply_chat_template([{"role": "user", "content": "w1"}]) == [4, 7, 9, 5, 7]
    llm.tokenizer.chat_template = template
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=match):
        llm.apply_chat_template([{"role": "user", "content": "w1"}], seconds=0.3)
    assert time.monotonic() - t0 < 5


def test_cli_empty_prompt_and_looping_template_are_usage_errors(chat_dir, tmp_path, capsys):
    import shutil
    import time

    from zoo.cli import main

    for argv in (["--prompt", ""], ["--prompt", "  \n"], ["--prompt", "", "--no-chat"]):
        assert main(["run", str(chat_dir), *argv]) == 2
        out, err = capsys.readouterr()
        assert err == "zoo run: error: the prompt is empty\n" and out == ""  # before anything loads
    looping = shutil.copytree(chat_dir, tmp_path / "looping")
    (looping / "chat_template.jinja").write_text(LOOPS)  # where transformers saved the template
    t0 = time.monotonic()
    assert main(["run", str(looping), "--prompt", "w1", "--max-tokens", "2"]) == 2
    out, err = capsys.readouterr()
    assert time.monotonic() - t0 < 30
    assert "zoo run: error: the chat template of" in err and "within 2 s" in err and "Traceback" not in err
    assert main(["run", str(looping), "--prompt", "w1", "--max-tokens", "2", "--no-chat"]) == 0  # the way out


# -- the native kernels' wrappers -------------------------------------------------------------------------
KERNEL_CASES = r'''
import json, torch
from zoo import kernels
from zoo.layers.linear import Linear
from zoo.layers.norm import RMSNorm
from zoo.runtime.batch import ForwardBatch
assert kernels.enabled(), "the native kernels did not build: this test would check nothing"
torch.set_grad_enabled(False)
f, i = torch.randn, torch.arange
batch = ForwardBatch(query_start_loc=torch.tensor([0, 2], dtype=torch.int32), seq_lens=torch.tensor([2], dtype=torch.int32),
                     positions=i(2), slot_mapping=i(2), block_tables=torch.zeros(1, 1, dtype=torch.int32),
                     logits_indices=i(1), kv_caches={}, block_size=4, query_start_loc_cpu=[0, 2], seq_lens_cpu=[2])
def attn(q, k, v, cache):
    return kernels.attention(q, k, v, cache, batch, scale=1.0, sliding_window=None, softcap=None)
lin, norm = Linear(4, 3, bias=True), RMSNorm(8, eps=1e-6)
torch.nn.init.normal_(lin.weight); torch.nn.init.normal_(lin.bias)
cases = {
    "linear in-features": lambda: kernels.linear(f(2, 5), f(3, 4)),
    "linear short bias": lambda: kernels.linear(f(2, 4), f(3, 4), f(2)),
    "linear 1-d weight": lambda: kernels.linear(f(2, 4), f(12)),
    "linear float64 weight": lambda: kernels.linear(f(2, 4), f(3, 4, dtype=torch.float64)),
    "linear float16 x": lambda: kernels.linear(f(2, 4, dtype=torch.float16), f(3, 4)),
    "Linear layer, wrong input": lambda: lin(f(2, 400)),
    "rms_norm short weight": lambda: kernels.rms_norm(f(2, 64), f(4), 1e-6),
    "rms_norm float16 weight": lambda: kernels.rms_norm(f(2, 8), f(8, dtype=torch.float16), 1e-6),
    "RMSNorm layer, wrong input": lambda: norm(f(3, 4096)),
    "rotary short positions": lambda: kernels.rotary(f(4, 2, 8), f(4, 1, 8), i(2), f(16, 4), f(16, 4)),
    "rotary float positions": lambda: kernels.rotary(f(4, 2, 8), f(4, 1, 8), i(4).float(), f(16, 4), f(16, 4)),
    "rotary wide table": lambda: kernels.rotary(f(4, 2, 8), f(4, 1, 8), i(4), f(16, 6), f(16, 6)),
    "rotary sin != cos": lambda: kernels.rotary(f(4, 2, 8), f(4, 1, 8), i(4), f(16, 4), f(8, 4)),
    "rotary k of other tokens": lambda: kernels.rotary(f(4, 2, 8), f(2, 1, 8), i(4), f(16, 4), f(16, 4)),
    "silu_mul odd": lambda: kernels.silu_mul(f(2, 7)),
    "gelu_tanh_mul float64": lambda: kernels.gelu_tanh_mul(f(2, 8, dtype=torch.float64)),
    "argmax 1-d": lambda: kernels.argmax(f(5)),
    "argmax empty vocabulary": lambda: kernels.argmax(f(2, 0)),
    "attention v != k": lambda: attn(f(2, 4, 8), f(2, 2, 8), f(2, 1, 8), None),
    "attention heads": lambda: attn(f(2, 3, 8), f(2, 2, 8), f(2, 2, 8), None),
    "attention cache shape": lambda: attn(f(2, 4, 8), f(2, 2, 8), f(2, 2, 8), f(4, 4, 2, 2, 4)),
    "attention float64 cache": lambda: attn(f(2, 4, 8), f(2, 2, 8), f(2, 2, 8), f(4, 4, 2, 2, 8, dtype=torch.float64)),
}
out = {}
for name, call in cases.items():
    try:
        call()
        out[name] = "no error"
    except ValueError as e:
        out[name] = "ValueError: " + str(e)
    except Exception as e:
        out[name] = f"{type(e).__name__}: {e}"
ok = [kernels.linear(f(2, 4), f(3, 4), f(3)).shape, kernels.rms_norm(f(2, 3, 8), f(8), 1e-6).shape,
      attn(f(2, 4, 8), f(2, 2, 8), f(2, 2, 8), torch.zeros(4, 4, 2, 2, 8)).shape]
print(json.dumps({"cases": out, "ok": [list(s) for s in ok]}))
'''


def test_kernel_wrappers_refuse_what_would_read_out_of_bounds():
    """In a subprocess: a wrapper that let one of these through could crash the process."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", KERNEL_CASES], capture_output=True, text=True, cwd=root,
                          timeout=300)
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["ok"] == [[2, 3], [2, 3, 8], [2, 32]]
    for name, got in result["cases"].items():
        fn = name.split()[0].lower().replace("layer,", "")
        assert got.startswith("ValueError: kernels."), (name, got)
        assert fn in got or name.endswith("layer, wrong input") or fn in ("silu_mul", "gelu_tanh_mul"), (name, got)
