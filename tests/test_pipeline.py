"""Pipeline parallelism (zoo/runtime/pipeline.py): PP=2 generates the greedy tokens one process generates, on a dense,
a MoE, the three hybrids (recurrent states per stage, their prefix-hit snapshots sent with the step) and both
multimodal models (the vision tower on stage 0, images in the prompts); each stage reads only its tensors and
`zoo inspect --pipeline-parallel-size N` proves every tensor read by exactly one stage (or the stages sharing it)
for every registered architecture.

Each PP LLM spawns one interpreter (~8 s on this 2-core machine), so each family is one case; every case runs a
ragged batch under chunked prefill (8 tokens a step), then a prompt that extends an earlier one (a prefix hit).
"""
from __future__ import annotations

import os
import re
import signal
import socket

import pytest
import torch

import loader
from multimodal_tiny import drawn_image, random_image
from tiny import save_tiny
from tiny_configs import TINY_CONFIGS, WIDE, save_arch
from registry import get_registry
from zoo import LLM, SamplingParams
from zoo.build import build_model, rules_for
from zoo.runtime.distributed import TensorParallelError
from zoo.runtime.model_files import read_config
from zoo.runtime.pipeline import Stage, decoder_layers, micro_batches, plan_stages, stage_ranges
from zoo.runtime.request import Request
from zoo.runtime.scheduler import ScheduledRequest

STEPS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
IDS = [[5, 17, 99, 3, 42, 8, 77, 12, 64, 31, 9, 14, 27], [11, 22, 33, 44, 55]]
EXTENDS = IDS[0] + [61, 62, 63, 70]  # a prefix hit on IDS[0]'s blocks (block size 4)
QWEN_IMAGE = "<|vision_start|> <|image_pad|> <|vision_end|>"
IMAGES = [random_image(0), drawn_image(1)]


def _llama5(path):  # 5 layers: 3 + 2 over two stages
    return save_tiny("LlamaForCausalLM", path, randomize=True, initializer_range=0.2, num_hidden_layers=5)


def _bamba_attention_first(path):  # stage 0: attention only (no recurrent state); stage 1: Mamba2 only (no KV)
    return save_tiny("BambaForCausalLM", path, randomize=True, **{**WIDE, **TINY_CONFIGS["BambaForCausalLM"],
                                                                  "num_hidden_layers": 4, "attn_layer_indices": [0, 1]})


def _image(text, image):
    return {"prompt": text, "multi_modal_data": {"image": [image]}}


LLAVA = "user : w1 <image> w2 w3 assistant :"
QWEN = f"user : w1 {QWEN_IMAGE} w2 w3 assistant :"
CASES = {  # name -> (checkpoint builder, the requests of the first generate, a request extending one of them)
    "dense-llama-uneven": (_llama5, IDS, EXTENDS),
    "moe-mixtral": (lambda p: save_arch("MixtralForCausalLM", p), IDS, EXTENDS),
    "hybrid-mamba2": (lambda p: save_arch("Mamba2ForCausalLM", p), IDS, EXTENDS),
    "hybrid-bamba": (lambda p: save_arch("BambaForCausalLM", p), IDS, EXTENDS),  # attention on layer 1, stage 0
    "hybrid-jamba": (lambda p: save_arch("JambaForCausalLM", p), IDS, EXTENDS),  # Mamba1, attention, MoE per stage
    "hybrid-bamba-attention-first": (_bamba_attention_first, IDS, EXTENDS),  # the state slots from stage 1's layers
    "multimodal-llava": (lambda p: save_arch("LlavaForConditionalGeneration", p),
                         [_image(LLAVA, IMAGES[0]), "user : w7 w8 w9 w10 assistant :"],
                         _image(LLAVA + " w4 w5 w6 w7", IMAGES[0])),
    "multimodal-qwen2-vl": (lambda p: save_arch("Qwen2VLForConditionalGeneration", p),  # M-RoPE positions to stage 1
                            [_image(QWEN, IMAGES[1]), "user : w7 w8 w9 w10 assistant :"],
                            _image(QWEN + " w4 w5 w6 w7", IMAGES[1])),
}


def _generate(path, requests, extends, **kw) -> tuple[list[list[int]], torch.Tensor, int]:
    """(the greedy tokens of `requests`, then of `extends`; every sampled row's logits, in step order; the prompt
    tokens the second generate found cached)."""
    llm = LLM(str(path), num_blocks=64, block_size=4, max_num_batched_tokens=8, **kw)
    if llm.tp_group is not None:  # every step of 2 tokens or more in 2 micro-batches (a request cut in two)
        llm.tp_group.min_tokens = 1
    rows = []
    llm.engine.runner.logits_hook = lambda reqs, logits: rows.append(logits.clone())
    try:
        first = [o.token_ids for o in llm.generate(requests, GREEDY)]
        before = llm.engine.kv.prefix_hits
        second = [o.token_ids for o in llm.generate([extends], GREEDY)]
        return first + second, torch.cat(rows), llm.engine.kv.prefix_hits - before
    finally:
        llm.close()


@pytest.mark.parametrize("name", list(CASES))
def test_pp2_greedy_tokens_equal_one_process(name, tmp_path):
    build, requests, extends = CASES[name]
    path = build(tmp_path / name)
    one, one_logits, _ = _generate(path, requests, extends)
    two, two_logits, hit = _generate(path, requests, extends, pipeline_parallel_size=2)
    assert two == one, f"{name}: PP=2 {two} != PP=1 {one}"
    # the same sums in the same order but for the fused step's kernels in one process: float32 noise only
    torch.testing.assert_close(two_logits, one_logits, rtol=0, atol=1e-5 * one_logits.abs().max().item())
    assert all(len(set(t)) > 1 for t in one), f"{name}: a degenerate reply proves little: {one}"
    assert hit >= 8, f"{name}: the prompt extending an earlier one found {hit} cached tokens"


@pytest.mark.parametrize("name", ["dense-llama-uneven", "hybrid-jamba", "multimodal-qwen2-vl"])
def test_pp2_tp2_greedy_tokens_equal_one_process(name, tmp_path):
    """Pipeline x tensor parallelism, 2 stages of 2 ranks (4 processes): each stage's layers split by heads and
    width over its ranks (their all-reduces in the stage's group), the hidden states from rank to rank of the same
    tensor-parallel part, Qwen2-VL's tower split over stage 0's ranks; one process's tokens and logits."""
    build, requests, extends = CASES[name]
    path = build(tmp_path / name)
    one, one_logits, _ = _generate(path, requests, extends)
    four, four_logits, hit = _generate(path, requests, extends, pipeline_parallel_size=2, tensor_parallel_size=2)
    assert four == one, f"{name}: PP=2 x TP=2 {four} != PP=1 {one}"
    torch.testing.assert_close(four_logits, one_logits, rtol=0, atol=1e-4 * one_logits.abs().max().item())
    assert hit >= 8, f"{name}: the prompt extending an earlier one found {hit} cached tokens"


REGISTERED = sorted(a for a, s in get_registry().specs.items() if not s.plugin.startswith("mutant-"))


@pytest.mark.parametrize("arch", REGISTERED)
def test_every_architecture_splits_into_stages_that_read_only_their_tensors(arch, tmp_path):
    """plan_stages at 2 stages: no problem, every key read by exactly the stages that hold its parameter, each
    stage's layer keys its own layers', the bytes of all stages those of the checkpoint's read tensors (plus the
    replicated ones again)."""
    path = save_arch(arch, tmp_path / arch)
    spec = get_registry().resolve(read_config(str(path), str(path)))

    def build():
        with torch.device("meta"):
            model = spec.build(read_config(str(path), str(path)))
        return model, rules_for(spec, model)

    model, rules = build()
    whole = loader.plan(model, path, rules)
    sp = plan_stages(build, path, 2)
    assert not sp.problems, "\n".join(map(str, sp.problems[:10]))
    layers = decoder_layers(model)
    for s, p in enumerate(sp.plans):
        for e in p.entries:
            if e.param.startswith(layers + "."):
                assert int(e.param[len(layers) + 1:].split(".")[0]) in sp.ranges[s], (arch, s, e.key)
    replicated = sum(e.nbytes() for e in whole.entries if e.key in sp.replicated)
    assert sum(sp.bytes(s) for s in range(2)) == sum(e.nbytes() for e in whole.entries) + replicated
    assert sp.holds[0] and sp.holds[1], sp.holds  # the embeddings on stage 0; the final norm / head on stage 1


def test_a_stage_load_is_strict(tmp_path):
    """A tensor of stage 1's layers absent from the checkpoint: stage 0 loads, stage 1 is refused naming the key;
    a key of no module at all is refused by both."""
    from safetensors.torch import load_file, save_file

    path = _llama5(tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.4.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    build_model(path, stage=Stage(0, 2))
    with pytest.raises(loader.LoadError, match=r"model\.layers\.4\.mlp\.(up_proj|gate_up_proj)"):
        build_model(path, stage=Stage(1, 2))
    tensors = {**load_file(_llama5(tmp_path / "n") / "model.safetensors"), "model.extra.weight": torch.zeros(2)}
    save_file(tensors, tmp_path / "n" / "model.safetensors", metadata={"format": "pt"})
    for s in range(2):
        with pytest.raises(loader.LoadError, match=r"model\.extra\.weight"):
            build_model(tmp_path / "n", stage=Stage(s, 2))


def test_stage_ranges():
    assert stage_ranges(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_ranges(4, 4) == [range(i, i + 1) for i in range(4)]
    with pytest.raises(ValueError, match="pipeline parallel size 3: the model has 2 decoder layers"):
        stage_ranges(2, 3)


def test_micro_batches_cut_a_step_in_order():
    """Every scheduled span's tokens once, in order, in micro-batches whose sizes differ by one at most; a request
    cut in two samples in its last span only."""
    def req(i, n):
        return Request(f"r{i}", list(range(n)), SamplingParams(max_tokens=4))

    steps = [[(9, 0, 9), (1, 5, 6)], [(1, 3, 4)] * 5, [(7, 0, 7)], [(3, 0, 5), (2, 4, 6), (6, 0, 6)]]
    for spans in steps:  # (new tokens, computed before, prompt length)
        scheduled = [ScheduledRequest(req(i, n), new, done) for i, (new, done, n) in enumerate(spans)]
        total = sum(new for new, _, _ in spans)
        for count in (1, 2, 3, 4, 16):
            parts = micro_batches(scheduled, count)
            sizes = [sum(s.num_new_tokens for s in p) for p in parts]
            assert len(parts) == min(count, total) and max(sizes) - min(sizes) <= 1, (spans, count, sizes)
            flat = [s for p in parts for s in p]
            for s in scheduled:  # its spans: contiguous, from where it was, to where the step takes it
                mine = [x for x in flat if x.request is s.request]
                assert [x.num_computed_tokens for x in mine] == \
                    [s.num_computed_tokens + sum(x.num_new_tokens for x in mine[:i]) for i in range(len(mine))]
                assert sum(x.num_new_tokens for x in mine) == s.num_new_tokens
                assert [x.samples for x in mine] == [False] * (len(mine) - 1) + [s.samples], (spans, count)
            order = [x.request for i, x in enumerate(flat) if i == 0 or flat[i - 1].request is not x.request]
            assert order == [s.request for s in scheduled]  # each request's spans together, in the step's order


def test_micro_batches_give_one_process_logprobs(tmp_path):
    """A step of two prompts cut into 3 micro-batches (a request's sampled row in one, its prompt-logprob rows in
    others): the prompt logprobs, the sampled logprobs and the tokens of one process; each prefill step did run as
    3 micro-batches."""
    path = _llama5(tmp_path / "m")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=2)

    def run(**kw):
        llm = LLM(str(path), num_blocks=64, block_size=4, **kw)
        counts, runner = [], llm.engine.runner
        if kw:
            llm.tp_group.micro, llm.tp_group.min_tokens = 3, 1
            forward = runner.forward_logits

            def counted(*args):
                logits, timings = forward(*args)
                counts.append(timings["micro_batches"])
                return logits, timings

            runner.forward_logits = counted
        try:
            return llm.generate(IDS, params), counts
        finally:
            llm.close()

    one, _ = run()
    two, counts = run(pipeline_parallel_size=2)
    assert counts == [3, 2, 2, 2], counts  # the prompts' step, then a decode token of each request (2 tokens)
    for a, b in zip(one, two):
        assert b.token_ids == a.token_ids
        assert len(b.prompt_logprobs) == len(a.prompt_logprobs) == len(b.prompt_token_ids)
        for x, y in zip(a.prompt_logprobs[1:] + a.logprobs, b.prompt_logprobs[1:] + b.logprobs):
            assert x.keys() == y.keys()
            assert all(abs(x[t] - y[t]) < 1e-4 for t in x), (x, y)


def test_the_pools_are_sized_for_the_costliest_stage(tmp_path):
    """Attention on the last two of four layers (stage 1's), Mamba2 on the first two (stage 0's): the KV blocks a
    budget buys are those of stage 1's layers, the state slots those of stage 0's (each as one process sizes them)."""
    path = save_tiny("BambaForCausalLM", tmp_path / "m", randomize=True, **{
        **WIDE, **TINY_CONFIGS["BambaForCausalLM"], "num_hidden_layers": 4, "attn_layer_indices": [2, 3]})
    budget = 1 << 20
    one = LLM(str(path), kv_cache_memory=budget, max_num_seqs=4)
    try:
        want = (one.engine.kv.pool.num_blocks, one.engine.kv_bytes_per_token, one.engine.state_bytes_per_request)
    finally:
        one.close()
    two = LLM(str(path), kv_cache_memory=budget, max_num_seqs=4, pipeline_parallel_size=2)
    try:
        got = (two.engine.kv.pool.num_blocks, two.engine.kv_bytes_per_token, two.engine.state_bytes_per_request)
        assert not two.engine.runner.kv_caches and two.engine.kv.state_slots.num_slots == 4  # (stage 0's part)
    finally:
        two.close()
    assert got == want and want[0] < 1000, (got, want)


def test_zoo_run_and_inspect_pipeline_parallel(tmp_path, capsys):
    """`zoo run --pipeline-parallel-size 2` prints one process's reply; more stages than layers, or PP with TP, is
    one line and exit 2; `zoo inspect --pipeline-parallel-size 2` prints each stage's part and the proof."""
    from test_cli_run import save_chat_model, words
    from zoo.cli import main

    path = save_chat_model(tmp_path / "chat", initializer_range=0.2)
    argv = ["run", str(path), "--prompt", words(5), "--max-tokens", "8"]
    assert main(argv) == 0
    one = capsys.readouterr().out
    assert main(argv + ["--pipeline-parallel-size", "2"]) == 0
    out, err = capsys.readouterr()
    assert out == one and one.strip() and "pipeline parallel over 2 stages" in err
    assert main(argv + ["--pipeline-parallel-size", "3"]) == 2
    assert "pipeline parallel size 3: the model has 2 decoder layers, fewer than the stages" in capsys.readouterr().err
    assert main(argv + ["--pipeline-parallel-size", "2", "--tensor-parallel-size", "2"]) == 0  # 4 processes
    out, err = capsys.readouterr()
    assert out == one and "pipeline parallel over 2 stages of 2 tensor-parallel ranks each" in err
    assert main(["inspect", str(path), "--pipeline-parallel-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "0      0-0     model.embed_tokens" in out and "1      1-1     lm_head, model.norm" in out
    assert "ok: each checkpoint tensor is read by exactly one of the 2 stages" in out
    assert main(["inspect", str(path), "--pipeline-parallel-size", "2", "--tensor-parallel-size", "2"]) == 0
    out = capsys.readouterr().out
    ranks = re.findall(r"^([01])\s+([01])\s+(\d+)\s+([\d.]+)\s+", out, re.M)  # stage, rank, tensors, MB read
    stages = re.findall(r"^([01])\s+\d+-\d+\s+.*?\s(\d+)\s+([\d.]+)\s+[\d.]+$", out, re.M)
    assert len(ranks) == 4 and len(stages) == 2, out
    for s, _, mb in stages:  # each stage's bytes split over its two ranks (the replicated norms twice)
        mine = [float(r[3]) for r in ranks if r[0] == s]
        assert 0.5 * float(mb) <= mine[0] <= 0.6 * float(mb) and mine[0] == mine[1], (s, mb, mine)
    assert "ok: within each stage, its 2 ranks' slices cover every element of the tensors it reads exactly once" in out


def test_a_killed_stage_ends_the_run_naming_it(tmp_path):
    path = _llama5(tmp_path / "m")
    llm = LLM(str(path), num_blocks=32, block_size=4, pipeline_parallel_size=2)
    worker, steps = llm.tp_group.workers[0], []

    def kill_after_two(reqs, logits):  # mid-generation: stage 1 dies after the second step
        steps.append(1)
        if len(steps) == 2:
            os.kill(worker.pid, signal.SIGKILL)

    llm.engine.runner.logits_hook = kill_after_two
    host = re.escape(socket.gethostname())
    said = rf"pipeline parallel rank 1 \(host {host}\) was killed by signal 9; the run is over"
    with pytest.raises(TensorParallelError, match=said):
        llm.generate([IDS[0]], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    llm.close()
    assert len(steps) == 2 and not worker.is_alive()
