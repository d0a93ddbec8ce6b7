"""The architectures of issue 16, one parametrised module, on their tiny checkpoints of tests/tiny_configs.py
(saved by transformers, every parameter random: norm weights and biases too; tests/test_parity_registry.py runs
every parity scenario on them): each generates transformers' greedy tokens, and `zoo parity --tiny` works on
each one's real config.json (tests/arch_configs.py holds their values: nothing downloads).

Each checkpoint is built once per session and shared by the tests of its architecture.
"""
from __future__ import annotations

import json

import pytest
import torch

from arch_configs import PHI3_LONG, PHI3_SHORT, REAL_CONFIGS
from parity.harness import run_parity
from parity.tiny import save_tiny_checkpoint
from tiny import load_reference, save_tiny
from tiny_configs import TINY_CONFIGS, WIDE, save_arch
from loader import LoadError
from safetensors.torch import load_file, save_file
from zoo.build import build_model
from zoo.runtime.engine import LLMEngine
from zoo.runtime.sampling_params import SamplingParams

ISSUE16 = list(REAL_CONFIGS)
# second configurations of an architecture whose other structure the tiny_configs entry does not take
VARIANTS = {
    "stablelm-parallel-residual": ("StableLmForCausalLM", dict(use_parallel_residual=True, qk_layernorm=False)),
}
PROMPTS = [[5, 17, 99, 3, 42, 8, 77, 12, 64, 31, 9, 100, 23, 54], [11, 22, 33, 44, 55], [7, 3, 120]]
STEPS = 12
_built: dict[str, tuple] = {}


@pytest.fixture(params=ISSUE16)
def built(request, tmp_path_factory):
    """(architecture, checkpoint dir, zoo model, transformers model), built once per session."""
    arch = request.param
    if arch not in _built:
        path = save_arch(arch, tmp_path_factory.mktemp(arch))
        zoo_model, _, spec, _ = build_model(path)
        assert spec.architectures == (arch,) and spec.plugin.startswith("plugins.")
        _built[arch] = (arch, path, zoo_model, load_reference(path))
    return _built[arch]


def test_greedy_tokens_equal_transformers(built):
    arch, _, model, ref = built
    greedy_equal(arch, model, ref, PROMPTS)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_passes_parity_and_greedy(name, tmp_path):
    arch, overrides = VARIANTS[name]
    path = save_tiny(arch, tmp_path, randomize=True, **{**WIDE, **overrides})
    result = run_parity(path)
    assert result.passed, {n: (s.failures, s.first_divergence) for n, s in result.scenarios.items()}
    model, *_ = build_model(path)
    greedy_equal(arch, model, load_reference(path), PROMPTS)


def greedy_equal(arch, model, ref, prompts):
    """The runtime's greedy tokens (the prompts batched, paged, block size 4) equal transformers' generate."""
    ref.generation_config.eos_token_id = None
    engine = LLMEngine(model, model.config, block_size=4)
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    for rid, prompt in zip(ids, prompts):
        with torch.no_grad():
            want = ref.generate(torch.tensor([prompt]), max_new_tokens=STEPS, do_sample=False, pad_token_id=0)
        assert done[rid].token_ids == want[0, len(prompt):].tolist(), f"{arch} prompt {prompt}"


@pytest.mark.parametrize("arch", list(REAL_CONFIGS))
def test_tiny_from_the_real_config(arch, tmp_path):
    """`zoo parity --tiny` on the published config.json: shrunk (longrope factors and NoPE layers too), built,
    passing."""
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "config.json").write_text(json.dumps({"architectures": [arch], **REAL_CONFIGS[arch]}))
    path = save_tiny_checkpoint(tmp_path / "full", tmp_path / "tiny")
    config = json.loads((path / "config.json").read_text())
    if arch == "SmolLM3ForCausalLM":
        assert 0 in config["no_rope_layers"] and len(config["no_rope_layers"]) == config["num_hidden_layers"]
    if arch == "Phi3ForCausalLM":
        rope = config["rope_parameters"]
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        assert len(rope["short_factor"]) == len(rope["long_factor"]) == head_dim // 2
        assert rope["long_factor"][-1] == PHI3_LONG[-1] and rope["short_factor"][0] == PHI3_SHORT[0]
    result = run_parity(path, scenarios=("prefill", "decode"))
    assert result.passed, {n: (s.failures, s.first_divergence) for n, s in result.scenarios.items()}


@pytest.mark.parametrize("path", ["fused", "modules", "torch"])
def test_longrope_switch_per_request(path, tmp_path):
    """Phi-3's two factor sets (original_max_position_embeddings 16 here), per request, as transformers'
    generate: a prompt past the switch rotates every token with the long factors however it is chunked; a
    prompt short of it starts short, and when its decode passes 16 tokens the request is recomputed whole
    with the long ones (transformers' generate drops its cache there). One batch of both kinds, prefill
    chunked at 8 tokens a step, on the fused native step, the per-module native kernels and plain torch."""
    from zoo import kernels

    save_tiny("Phi3ForCausalLM", tmp_path, seed=1, randomize=True,
              **{**WIDE, **TINY_CONFIGS["Phi3ForCausalLM"], "original_max_position_embeddings": 16})
    previous = kernels.set_enabled(path != "torch")
    try:
        with torch.no_grad():
            zoo_model, *_ = build_model(tmp_path)
            rope = zoo_model.model.layers[0].self_attn.rotary_emb
            assert rope.long_past == 16 and rope.grows_past is None and rope.native
            long_prompts = [list(range(3, 23)), [9] + PROMPTS[0] + [1, 2]]  # 20 and 17 tokens
            crossing = [PROMPTS[0][:10], [4] + PROMPTS[0] + [6]]  # 10 and 16 tokens: decode crosses 16
            engine = LLMEngine(zoo_model, zoo_model.config, block_size=4, max_num_batched_tokens=8)
            if path == "modules":
                engine.runner.fused = None
            assert (engine.runner.fused is not None) == (path == "fused"), engine.runner.step_path
            ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True))
                   for p in long_prompts + crossing]
            done, steps = {}, 0
            while engine.has_unfinished_requests():
                done.update({o.request_id: o for o in engine.step() if o.finished})
                steps += 1
            assert steps > STEPS + 2  # the prompts took several chunked steps
            ref = load_reference(tmp_path)
            ref.generation_config.eos_token_id = None
            for rid, prompt in zip(ids, long_prompts + crossing):
                want = ref.generate(torch.tensor([prompt]), max_new_tokens=STEPS, do_sample=False, pad_token_id=0)
                assert done[rid].token_ids == want[0, len(prompt):].tolist(), f"prompt {prompt}"
    finally:
        kernels.set_enabled(previous)


def test_transformed_keys_are_checked_in_the_checkpoint_layout(tmp_path):
    """A Transform rule is as strict as a Fuse: GPT-2's Conv1D weight saved untransposed, and a GPT-NeoX
    query_key_value with rows missing, are each one named shape problem, in the checkpoint's layout."""
    gpt2 = save_arch("GPT2LMHeadModel", tmp_path / "gpt2")
    tensors = load_file(gpt2 / "model.safetensors")
    key = "transformer.h.1.attn.c_attn.weight"
    tensors[key] = tensors[key].t().contiguous()  # [3H, H]: the parameter's layout, not Conv1D's
    save_file(tensors, gpt2 / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(LoadError) as err:
        build_model(gpt2)
    assert [p.key for p in err.value.problems] == [key]
    assert "has shape [192, 64] but model.layers.1.self_attn.qkv_proj.weight (transposed) expects [64, 192]" \
        in str(err.value)
    neox = save_arch("GPTNeoXForCausalLM", tmp_path / "neox")
    tensors = load_file(neox / "model.safetensors")
    key = "gpt_neox.layers.0.attention.query_key_value.bias"
    tensors[key] = tensors[key][:-16].contiguous()  # one head's value rows short
    save_file(tensors, neox / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(LoadError, match=r"query_key_value.bias in model.safetensors has shape \[176\] but "
                                        r"model.layers.0.self_attn.qkv_proj.bias \(interleaved\) expects \[192\]"):
        build_model(neox)


def test_interleaved_heads_land_in_q_k_v_order(tmp_path):
    """GPT-NeoX's rows [heads, (q, k, v), D] become the parameter's [(q, k, v), heads, D]: q of head h is rows
    h * 3D .. h * 3D + D of the checkpoint."""
    path = save_arch("GPTNeoXForCausalLM", tmp_path)
    model, *_ = build_model(path)
    held = load_file(path / "model.safetensors")["gpt_neox.layers.1.attention.query_key_value.weight"]
    ours = model.model.layers[1].self_attn.qkv_proj.weight  # [3 * heads * D, H]
    heads, d = model.config.num_attention_heads, model.config.hidden_size // model.config.num_attention_heads
    for h in range(heads):
        for part in range(3):
            want = held[(3 * h + part) * d:(3 * h + part + 1) * d]
            assert torch.equal(ours[(part * heads + h) * d:(part * heads + h + 1) * d], want), (h, part)


def test_run_and_inspect_say_which_path_a_step_takes(tmp_path, capsys):
    """Gemma overrides only construction hooks (make_mlp, norm_class, embed_scale): it keeps the fused native
    step. Granite overrides embed (its multiplier) and still runs, on the module path, and both commands say why."""
    from zoo import kernels
    from zoo.cli import main as zoo_main

    if not kernels.enabled():
        pytest.skip("native kernels are not built here")
    paths = {arch: save_arch(arch, tmp_path / arch) for arch in ("GemmaForCausalLM", "GraniteForCausalLM")}
    said = {}
    for arch, path in paths.items():
        model, config, *_ = build_model(path)
        said[arch] = LLMEngine(model, config, block_size=4).runner.step_path
        assert zoo_main(["inspect", str(path)]) == 0
        said[f"inspect {arch}"] = capsys.readouterr().out.strip().splitlines()[-1]
    assert said["GemmaForCausalLM"].startswith("fused native step")
    assert said["inspect GemmaForCausalLM"].startswith("step: the fused native step")
    why = "GraniteForCausalLM or GraniteModel overrides forward, compute_logits or embed"
    assert said["GraniteForCausalLM"].startswith("module path (native kernels per module)") and why in said[
        "GraniteForCausalLM"]
    assert said["inspect GraniteForCausalLM"] == f"step: the module path: the fused step does not apply: {why} " \
                                                 f"(the driver reproduces plugins.llama's)"


def test_configs_without_architectures_resolve_through_model_type():
    """GGUF configs carry no `architectures`: the model_type finds the plugin (Gemma3's GGUF says gemma3_text)."""
    from registry import get_registry

    reg = get_registry()
    for model_type, arch in [("gemma3_text", "Gemma3ForCausalLM"), ("gpt2", "GPT2LMHeadModel"),
                             ("gpt_neox", "GPTNeoXForCausalLM"), ("gpt_oss", "GptOssForCausalLM"),
                             ("granitemoe", "GraniteMoeForCausalLM"), ("smollm3", "SmolLM3ForCausalLM")]:
        assert reg.resolve({"model_type": model_type}).architectures == (arch,), model_type


def test_gpt2_hub_keys_without_the_transformer_prefix(tmp_path):
    """The hub's GPT-2 checkpoints store h.{i}..., wte, wpe, ln_f without `transformer.` (transformers loads
    both): that layout passes parity and greedy equality; a checkpoint holding both layouts, or a key of
    neither, is refused naming the keys."""
    path = save_arch("GPT2LMHeadModel", tmp_path / "hub")
    tensors = load_file(path / "model.safetensors")
    assert any(k.startswith("transformer.h.") for k in tensors)
    hub = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    save_file(hub, path / "model.safetensors", metadata={"format": "pt"})
    result = run_parity(path, scenarios=("prefill", "decode"))
    assert result.passed, {n: (s.failures, s.first_divergence) for n, s in result.scenarios.items()}
    zoo_model, *_ = build_model(path)
    greedy_equal("GPT2LMHeadModel", zoo_model, load_reference(path), PROMPTS[:2])

    both = {**tensors, **{k: v.clone() for k, v in hub.items()}}
    save_file(both, path / "model.safetensors", metadata={"format": "pt"})  # both layouts
    with pytest.raises(LoadError) as err:
        build_model(path)
    assert {p.kind for p in err.value.problems} == {"duplicate"}
    assert "h.0.attn.c_attn.weight" in str(err.value) and "transformer.h.0.attn.c_attn.weight" in str(err.value)

    save_file({("gpt." + k if k.startswith("h.0.") else k): v for k, v in hub.items()}, path / "model.safetensors",
              metadata={"format": "pt"})  # layer 0 under a prefix of neither layout
    with pytest.raises(LoadError) as err:
        build_model(path)
    assert {p.kind for p in err.value.problems} == {"missing", "unexpected"}
    assert "gpt.h.0.attn.c_attn.weight" in str(err.value)
