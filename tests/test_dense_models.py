"""Dense / GQA models: the zoo's logits equal transformers' on tiny checkpoints read from disk.

Every case is saved with save_pretrained, built through zoo.build (registry + strict loader), and run
through the paged cache in three schedules, each compared, token by token, with transformers (fp32,
eager) fed the same chunks of the same requests through its own cache:
    prefill  one prompt of 20 tokens in one step
    decode   12 tokens, then 8 teacher-forced steps of one token
    ragged   three requests in one batch: ragged prefill, then decode mixed with a chunked prefill,
             then decode; blocks assigned out of order
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from batching import (allocate_kv, assert_close, make_batch, random_prompts, reference_chunks, run_schedule,
                      run_step)
from kernel_paths import ops  # noqa: F401  (fixture)
from tiny import built_case, load_reference, save_tiny
from loader import LoadError
from zoo.build import build_model
from zoo.runtime.batch import MissingCache

PROMPT = 20

CASES = {
    "llama": ("LlamaForCausalLM", {}),
    "llama-tied-bias-headdim": ("LlamaForCausalLM", dict(tie_word_embeddings=True, attention_bias=True,
                                                         mlp_bias=True, head_dim=8)),
    "llama-mha": ("LlamaForCausalLM", dict(num_key_value_heads=4)),
    "llama-rope-llama3": ("LlamaForCausalLM", dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32))),
    "llama-rope-yarn": ("LlamaForCausalLM", dict(max_position_embeddings=64, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16))),
    "llama-rope-linear": ("LlamaForCausalLM", dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0,
                                                                         factor=2.0))),
    # max_position_embeddings < the prompt, so the NTK base is recomputed as the context grows
    "llama-rope-dynamic": ("LlamaForCausalLM", dict(max_position_embeddings=16, rope_parameters=dict(
        rope_type="dynamic", rope_theta=10000.0, factor=2.0))),
    "mistral-sliding": ("MistralForCausalLM", dict(sliding_window=5)),
    # layer 0 full, layer 1 sliding (window 5 < prompt), tied head, q/k/v bias
    "qwen2-bias-sliding-tied": ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=5,
                                                         max_window_layers=1, tie_word_embeddings=True)),
    "qwen3-qknorm": ("Qwen3ForCausalLM", dict(head_dim=32, attention_bias=True)),
    "gemma3": ("Gemma3ForCausalLM", dict(
        head_dim=16, query_pre_attn_scalar=24, sliding_window=5, num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                         "full_attention": dict(rope_type="linear", rope_theta=1000000.0, factor=8.0)})),
    # final logits capped; attn_logit_softcapping is set but, as in transformers' Gemma3, not applied
    "gemma3-softcap": ("Gemma3ForCausalLM", dict(
        head_dim=16, query_pre_attn_scalar=16, sliding_window=4, attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0, layer_types=["full_attention", "sliding_attention"])),
}


@pytest.fixture(autouse=True)
def both_paths(ops):
    """Every test here runs with zoo's native kernels (the runtime's path) and with torch ops."""
    return ops


@pytest.fixture(params=list(CASES))
def case(request, tmp_path_factory):
    """(name, checkpoint dir, zoo model, transformers model), each built once per session."""
    arch, overrides = CASES[request.param]
    *built, spec = built_case(arch, overrides, request.param, tmp_path_factory)
    assert spec.architectures == (arch,)
    return tuple(built)


def fresh(name, path, ref):
    """The reference to feed a new sequence: a dynamic-rope model's rotary state grows with the longest
    sequence it has seen, so that one starts afresh."""
    if CASES[name][1].get("rope_parameters", {}).get("rope_type") == "dynamic":
        return load_reference(path)
    return ref


def test_prefill(case):
    name, path, model, ref = case
    [tokens] = random_prompts([PROMPT], vocab=model.config.vocab_size)
    [[got]] = run_schedule(model, [tokens], [[(0, PROMPT)]])
    [want] = reference_chunks(fresh(name, path, ref), tokens, [PROMPT])
    assert_close(got, want, f"{name} prefill")


def test_decode(case):
    name, path, model, ref = case
    [tokens] = random_prompts([PROMPT], vocab=model.config.vocab_size, seed=1)
    got = run_schedule(model, [tokens], [[(0, 12)]] + [[(0, 1)]] * (PROMPT - 12))[0]
    want = reference_chunks(fresh(name, path, ref), tokens, list(range(12, PROMPT + 1)))
    for step, (g, w) in enumerate(zip(got, want)):
        assert_close(g, w, f"{name} decode step {step} (position {12 + step - 1 if step else '0..11'})")


def test_ragged(case):
    name, path, model, ref = case
    requests = random_prompts([9, 15, 21], vocab=model.config.vocab_size, seed=2)
    steps = [
        [(0, 7), (1, 13), (2, 10)],  # ragged prefill
        [(0, 1), (2, 10), (1, 1)],  # decode, a chunk of 10 after 10 cached, decode
        [(2, 1), (1, 1), (0, 1)],  # decode, in another order
    ]
    got = run_schedule(model, requests, steps, shuffle=True)
    for r, tokens in enumerate(requests):
        cuts, n = [], 0
        for step in steps:
            n += dict(step)[r]
            cuts.append(n)
        want = reference_chunks(fresh(name, path, ref), tokens, cuts)
        for step, (g, w) in enumerate(zip(got[r], want)):
            assert_close(g, w, f"{name} ragged request {r} step {step}")


def test_sampled_rows_only(case):
    """logits_indices picks each request's last token; the rows equal those of the all-rows run."""
    name, _, model, _ = case
    requests = random_prompts([6, 11], vocab=model.config.vocab_size, seed=3)
    seqs = [(t, 0) for t in requests]
    full = run_step(model, seqs, allocate_kv(model), all_logits=True)
    last = run_step(model, seqs, allocate_kv(model), all_logits=False)
    assert last.shape == (2, model.config.vocab_size)
    assert_close(last, full[[5, 16]], f"{name} last rows")


def test_prompt_without_cache_equals_paged(case):
    """A batch with no KV caches at all attends within its own tokens (whole prompts)."""
    name, _, model, _ = case
    requests = random_prompts([8, 13], vocab=model.config.vocab_size, seed=4)
    seqs = [(t, 0) for t in requests]
    paged = run_step(model, seqs, allocate_kv(model))
    ids, batch = make_batch(seqs, {})
    with torch.no_grad():
        bare = model.compute_logits(model(ids, batch.positions, batch))
    assert_close(bare, paged, f"{name} without cache")


def test_a_layer_without_its_cache_is_named(case):
    """A batch with caches, but none for one attention layer: MissingCache (a LookupError) names the layer."""
    name, _, model, _ = case
    kv = allocate_kv(model)
    layer = next(k for k in kv if k.startswith("model.layers.1."))
    del kv[layer]
    with pytest.raises(MissingCache, match=rf"no cache for '{layer}'"), torch.no_grad():
        run_step(model, [(random_prompts([4], vocab=model.config.vocab_size)[0], 0)], kv)
    assert issubclass(MissingCache, LookupError) and not issubclass(MissingCache, KeyError)


def test_tied_head_is_one_parameter(tmp_path):
    path = save_tiny("Qwen2ForCausalLM", tmp_path, tie_word_embeddings=True)
    model, _, _, report = build_model(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    assert "lm_head.weight" in names and "model.embed_tokens.weight" in names
    assert any(t.param == "lm_head.weight" and t.tied for t in report.ties), str(report)


def test_untied_head_is_its_own_parameter(tmp_path):
    path = save_tiny("LlamaForCausalLM", tmp_path, tie_word_embeddings=False)
    model, *_ = build_model(path)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_untied_head_missing_from_the_checkpoint_fails(tmp_path):
    path = save_tiny("LlamaForCausalLM", tmp_path, tie_word_embeddings=False)
    tensors = load_file(path / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(LoadError) as err:
        build_model(path)
    assert "missing: lm_head.weight: the checkpoint has no tensor for it" in str(err.value)


def test_tied_config_with_a_real_head_in_the_checkpoint_loads_it(tmp_path):
    path = save_tiny("LlamaForCausalLM", tmp_path, tie_word_embeddings=True)
    tensors = load_file(path / "model.safetensors")
    head = torch.randn_like(tensors["model.embed_tokens.weight"])
    tensors["lm_head.weight"] = head
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    model, _, _, report = build_model(path)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, head)
    assert any(t.param == "lm_head.weight" and not t.tied for t in report.ties), str(report)


def test_cache_specs_follow_layers(tmp_path):
    """One cache per attention layer, keyed by its checkpoint prefix; windows only on sliding layers."""
    path = save_tiny("Gemma3ForCausalLM", tmp_path, head_dim=16, sliding_window=5, num_hidden_layers=3,
                     layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    model, *_ = build_model(path, dtype=torch.bfloat16)
    specs = {m.prefix: m.cache_spec() for m in model.modules() if hasattr(m, "cache_spec")}
    assert list(specs) == [f"model.layers.{i}.self_attn" for i in range(3)]
    assert [s.sliding_window for s in specs.values()] == [5, None, 5]
    assert all(s.per_token == (2, 2, 16) and s.dtype == torch.bfloat16 for s in specs.values())


def test_bfloat16_runs_close_to_reference(tmp_path):
    """A bf16 build runs through the cache and stays near the fp32 reference (the dtype plumbing works)."""
    path = save_tiny("Gemma3ForCausalLM", tmp_path, head_dim=16, sliding_window=5, initializer_range=0.2)
    model, *_ = build_model(path, dtype=torch.bfloat16)
    [tokens] = random_prompts([10], vocab=128)
    got = run_step(model, [(tokens, 0)], allocate_kv(model)).float()
    with torch.no_grad():
        want = load_reference(path)(torch.tensor([tokens])).logits[0]
    assert got.dtype == torch.float32 and (got - want).abs().max() < 0.1 * want.abs().max()


def test_unsupported_config_names_the_field(tmp_path):
    path = save_tiny("LlamaForCausalLM", tmp_path, hidden_act="quick_gelu")
    with pytest.raises(ValueError, match="hidden_act='quick_gelu'"):
        build_model(path)


def test_saved_rotary_buffers_are_ignored_with_a_reason(tmp_path):
    """Old checkpoints carry `rotary_emb.inv_freq`; the rules drop it on purpose and the report says why."""
    path = save_tiny("LlamaForCausalLM", tmp_path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    _, _, _, report = build_model(path)
    [(key, _, reason)] = report.ignored
    assert key == "model.layers.0.self_attn.rotary_emb.inv_freq" and "recomputed" in reason
