"""The device path forced on the CPU (zoo.kernels.set_device_path; `ZOO_DEVICE_PATH=1`): the code a CUDA step
runs, with the Triton kernels' torch references, no native kernels, the step's metadata in one copy and no host
read inside the model's step (zoo.kernels.host_sync raises on one). Greedy tokens equal transformers' generate on
a representative set (dense with softcap and windows, MoE with a shared expert and biased experts with sinks,
MLA, hybrid SSM), through a ragged batch, chunked prefill and a prefix-cache hit."""
from __future__ import annotations

import pytest
import torch

from tiny import load_reference
from tiny_configs import save_arch
from zoo import kernels
from zoo.build import build_model
from zoo.kernels import host_sync
from zoo.runtime.engine import LLMEngine
from zoo.runtime.kv_cache import device_kv_budget
from zoo.runtime.model_runner import one_copy
from zoo.runtime.sampling_params import SamplingParams

STEPS = 8
PROMPTS = [
    [5, 17, 99, 3, 42, 8, 77, 12, 64, 31, 9, 100, 23],  # 13 tokens: chunked at 8, crosses blocks of 4
    [11, 22, 33],
    [7],
    [5, 17, 99, 3, 42, 8, 77, 12, 50],  # shares two blocks with the first: a prefix-cache hit when it comes later
]
ARCHS = ["LlamaForCausalLM", "Gemma2ForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM", "GptOssForCausalLM",
         "DeepseekV2ForCausalLM", "BambaForCausalLM"]


@pytest.fixture
def device_path():
    before = kernels.set_device_path(True)
    try:
        yield
    finally:
        kernels.set_device_path(before)


def generate(engine, prompts, *, wave=None):
    """Greedy STEPS tokens for each prompt; `wave`: add the prompts after index `wave` once the first ones ran."""
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    done = {}
    groups = [prompts] if wave is None else [prompts[:wave], prompts[wave:]]
    ids = []
    for group in groups:
        ids += [engine.add_request(p, params, request_id=str(len(ids) + i)) for i, p in enumerate(group)]
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[i].token_ids for i in ids], engine


def reference_tokens(path):
    """transformers' greedy tokens for each of PROMPTS, one prompt at a time."""
    ref = load_reference(path)
    ref.generation_config.eos_token_id = None
    with torch.no_grad():
        return [ref.generate(torch.tensor([p]), max_new_tokens=STEPS, do_sample=False, pad_token_id=0)[0, len(p):]
                .tolist() for p in PROMPTS]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_transformers_on_the_device_path(arch, tmp_path, device_path):
    path = save_arch(arch, tmp_path)
    expected = reference_tokens(path)
    model, config, _, _ = build_model(path)
    engine = LLMEngine(model, config, block_size=4, num_blocks=64, max_num_batched_tokens=8)
    assert engine.runner.device_path and engine.runner.fused is None and "device path" in engine.runner.step_path
    got, engine = generate(engine, PROMPTS, wave=3)
    assert got == expected
    assert engine.kv.prefix_hits >= 8 or engine.kv.state_snapshots is not None  # (hybrid: hits need snapshots)


def test_a_host_read_inside_a_step_is_refused(tmp_path, device_path):
    """The guard is live in the runner: a layer that reads a value back (a forward hook calling .tolist()) fails
    the step with HostSync naming the call; outside the step the same read is fine."""
    model, config, _, _ = build_model(save_arch("LlamaForCausalLM", tmp_path))
    model.model.layers[0].mlp.register_forward_hook(lambda m, args, out: out.sum().tolist())
    engine = LLMEngine(model, config, block_size=4, num_blocks=16)
    engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=2))
    with pytest.raises(host_sync.HostSync, match="Tensor.tolist inside a device-path step"):
        engine.step()
    assert torch.ones(2).tolist() == [1.0, 1.0]  # (the patches are gone after the step)
    assert torch.tensor([torch.tensor(-6)]).tolist() == [-6]  # (and Tensor's type is as it was: 0-d is no sequence)


def test_one_copy_splits_the_fields():
    a, b, c = one_copy(torch.device("cpu"), [1, 2], [], [3])
    assert a.tolist() == [1, 2] and b.numel() == 0 and c.tolist() == [3] and a.dtype == torch.int64


def test_the_default_cpu_path_is_unchanged(tmp_path):
    """Without the switch a float32 CPU model still takes the fused native step (when the kernels built)."""
    model, config, _, _ = build_model(save_arch("LlamaForCausalLM", tmp_path))
    runner = LLMEngine(model, config, block_size=4, num_blocks=16).runner
    assert not runner.device_path
    assert (runner.fused is not None) == kernels.enabled()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)")
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "MixtralForCausalLM"])
def test_greedy_on_the_gpu(arch, tmp_path):
    """The real thing: float32 on CUDA with the Triton kernels, greedy tokens equal transformers' on the CPU."""
    path = save_arch(arch, tmp_path)
    expected = reference_tokens(path)
    model, config, _, _ = build_model(path, device="cuda")
    engine = LLMEngine(model, config, block_size=4, num_blocks=64, max_num_batched_tokens=8, device="cuda")
    assert "Triton" in engine.runner.step_path
    assert generate(engine, PROMPTS, wave=3)[0] == expected


def test_the_kv_budget_is_what_the_memory_fraction_leaves():
    gib = 2 ** 30
    # 80 GiB device, 30 GiB free (50 in use: the weights and the rest): 0.9 of it leaves 22 GiB for the KV cache
    assert device_kv_budget("cuda", 0.9, mem_get_info=lambda d: (30 * gib, 80 * gib)) == int(0.9 * 80 * gib) - 50 * gib
    with pytest.raises(ValueError, match="--gpu-memory-utilization 0.5: 50.00 GiB of the device's 80.00 GiB"):
        device_kv_budget("cuda", 0.5, mem_get_info=lambda d: (30 * gib, 80 * gib))
    with pytest.raises(ValueError, match="gpu_memory_utilization=1.5 must be a fraction"):
        device_kv_budget("cuda", 1.5, mem_get_info=lambda d: (30 * gib, 80 * gib))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
@pytest.mark.parametrize("argv, words", [(["--device", "cuda"], "--device cuda: no CUDA device here"),
                                         (["--device", "tpu9"], "--device tpu9"),
                                         (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization 0.0")])
def test_zoo_run_refuses_a_device_it_cannot_use(tmp_path, capsys, argv, words):
    from zoo.cli import main

    assert main(["run", str(save_arch("LlamaForCausalLM", tmp_path)), "--prompt", "hi", *argv]) == 2
    assert words in capsys.readouterr().err
