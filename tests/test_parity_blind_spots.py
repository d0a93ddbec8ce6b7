"""The harness's blind spots (issue 12), each shown by a planted bug it once passed or misplaced: degenerate
prompts, prompts too short for the model's windows, ... Each mutant must fail with the right scenario, layer,
sub-block and first position, and the hints must name the true cause first."""
from __future__ import annotations

import json

import pytest

from mutants import BUG_LAYER, planted, planted_runtime
from parity.harness import run_parity
from tiny import save_tiny
from zoo.cli import main as zoo_main

L = f"model.layers.{BUG_LAYER}"
WIDE = dict(initializer_range=0.2, randomize=True)


def save_unk_tokenizer(path):
    """A word-level tokenizer that knows only its special tokens: every word of a text prompt is <unk>."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def unk_llama(tmp_path_factory):
    return save_unk_tokenizer(save_tiny("LlamaForCausalLM", tmp_path_factory.mktemp("unk"), **WIDE))


# -- 1. degenerate prompts ---------------------------------------------------------------------------------
def test_degenerate_default_prompts_are_replaced_and_said(unk_llama):
    """Every default prompt tokenises to <unk> repeated: a wrong rotary half once passed; now the prompts are
    random ids, the report says so, and the bug is found at its layer and position 1."""
    result = run_parity(unk_llama, scenarios=("prefill",))
    assert result.passed, result.scenarios["prefill"].failures
    notes = result.inputs["notes"]
    assert len(notes) == 4 and all("the unknown token 3" in n or "repeated" in n for n in notes), notes
    assert all(len(set(p)) > 1 for p in result.prompts)
    with planted("rotary_wrong_half"):
        result = run_parity(unk_llama, scenarios=("prefill",))
    s = result.scenarios["prefill"]
    assert not s.passed
    assert (s.first_divergence["tap"], s.first_divergence["position"]) == (f"{L}.self_attn", 1), s.first_divergence


def test_degenerate_user_prompts_are_refused(unk_llama, tmp_path, capsys):
    (tmp_path / "p.txt").write_text("hello there my friend\nthe quick brown fox\n")
    assert zoo_main(["parity", str(unk_llama), "--prompts", str(tmp_path / "p.txt"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "prompt 0: one id (3) repeated 4 times" in err and "rotary and attention bugs cannot show" in err, err
    (tmp_path / "p.json").write_text(json.dumps([[5, 5, 5, 5, 5, 6], [7, 8, 9]]))
    assert zoo_main(["parity", str(unk_llama), "--prompts", str(tmp_path / "p.json"), "--quiet"]) == 2
    assert "prompt 0: 2 distinct ids in 6 tokens" in capsys.readouterr().err


# -- 2. prompts too short for the model ----------------------------------------------------------------------
def test_prompts_are_sized_past_the_sliding_window(tmp_path):
    """A window of 40 is past every default prompt (<= 29 tokens): the harness adds a 42-token prompt and the
    one-too-wide window is found in prefill at position 40 of that prompt."""
    path = save_tiny("MistralForCausalLM", tmp_path, sliding_window=40, **WIDE)
    with planted("window_off_by_one"):
        result = run_parity(path, scenarios=("prefill",))
    assert any("added a prompt of 42 random token ids to reach the sliding window 40" in n
               for n in result.inputs["notes"]), result.inputs
    s = result.scenarios["prefill"]
    first = s.first_divergence
    assert not s.passed and (first["tap"], first["request"], first["position"]) == (f"{L}.self_attn", 4, 40), first
    assert "sliding window (40 tokens)" in s.localization.hints[0], s.localization.hints


def test_a_feature_over_the_budget_is_reported_not_exercised(tmp_path, capsys):
    path = save_tiny("MistralForCausalLM", tmp_path, sliding_window=4096, max_position_embeddings=8192, **WIDE)
    assert zoo_main(["parity", str(path), "--scenario", "prefill", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "NOT EXERCISED: sliding window 4096: needs a prompt of 4098 tokens, over the budget" in out, out


def test_longrope_is_reached_past_its_original_length(tmp_path):
    """Phi-3's long factors act past original_max_position_embeddings (32 here): a 33-token prompt is added."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
            "short_factor": [1.0] * 8, "long_factor": [1.0 + i for i in range(8)]}
    path = save_tiny("LlamaForCausalLM", tmp_path, rope_parameters=rope, **WIDE)
    result = run_parity(path, scenarios=("prefill", "decode"))
    assert result.passed, {n: s.failures for n, s in result.scenarios.items()}
    assert any("rope longrope past 32 positions" in n for n in result.inputs["notes"]), result.inputs
    assert max(len(p) for p in result.prompts) == 33


def test_longrope_decode_crossing_the_switch_is_compared_like_with_like(tmp_path):
    """Prompts of 14 and 15 tokens whose decode passes Phi-3's switch (16): the zoo sampled their first tokens with
    the short factors, as transformers' generate did, so each sampled row is compared with the reference's forward
    over the tokens it held then (one forward over every token rotates all of them long: KL 1.7 on a correct
    model). A runtime that does not recompute the request with the long factors at the switch still fails."""
    from tiny_configs import TINY_CONFIGS

    path = save_tiny("Phi3ForCausalLM", tmp_path, **{**WIDE, **TINY_CONFIGS["Phi3ForCausalLM"],
                                                     "original_max_position_embeddings": 16})
    prompts = [[(7 * i + 3 * r) % 120 + 3 for i in range(n)] for r, n in enumerate((14, 15, 6, 21))]
    result = run_parity(path, prompts=prompts, scenarios=("decode", "served"))
    assert result.passed, {n: s.failures for n, s in result.scenarios.items()}
    with planted_runtime("no_long_recompute"):
        result = run_parity(path, prompts=prompts, scenarios=("decode", "served"))
    first = result.scenarios["served"].first_divergence
    assert (first["tap"], first["request"], first["position"]) == ("sampled_logits", 0, 16), first
    first = result.scenarios["decode"].first_divergence  # (its taps: rows 14 and 15 were not recomputed long)
    assert (first["tap"], first["request"], first["position"]) == ("model.layers.0.self_attn", 0, 14), first


def test_a_model_of_few_positions_gets_default_prompts_that_fit(tmp_path, capsys):
    """GPT-2 with 16 learned positions: the default prompts (up to 29 tokens) are cut to fit with the tokens the
    scenarios generate (each said), the prefix scenario's extended prompt too, and every scenario passes (before:
    'prompt of 29 tokens does not fit max_model_len=16' in every scenario); prompts given that do not fit are a
    usage error before anything loads."""
    from tiny_configs import TINY_CONFIGS

    path = save_tiny("GPT2LMHeadModel", tmp_path / "gpt2", **{**WIDE, **TINY_CONFIGS["GPT2LMHeadModel"],
                                                              "max_position_embeddings": 16})
    result = run_parity(path)
    assert result.passed, {n: (s.failures, s.first_divergence) for n, s in result.scenarios.items() if not s.passed}
    assert max(len(p) for p in result.prompts) == 12  # 16 positions less the 4 generated tokens
    assert any(n.startswith("default prompt 1 cut from 29 to 12 tokens: the model holds 16 positions")
               for n in result.inputs["notes"]), result.inputs["notes"]
    (tmp_path / "p.json").write_text(json.dumps([list(range(3, 16)), list(range(20, 26))]))
    assert zoo_main(["parity", str(path), "--prompts", str(tmp_path / "p.json"), "--quiet"]) == 2
    assert ("prompt 0 has 13 tokens, and the scenarios generate 4 more: past the 16 positions the model holds"
            in capsys.readouterr().err)


def test_dynamic_rope_past_the_runtime_length_is_not_exercised(tmp_path):
    path = save_tiny("LlamaForCausalLM", tmp_path, max_position_embeddings=32,
                     rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}, **WIDE)
    result = run_parity(path, scenarios=("prefill",))
    assert result.passed
    assert result.inputs["not_exercised"] == ["rope dynamic past 32 positions: needs a prompt of 33 tokens and 4 "
                                              "generated past it, past the model's max_position_embeddings 32 (the "
                                              "runtime's longest request)"]


# -- 3, 4, 5. the runtime's bookkeeping, the sampled row, the served path ------------------------------------------
@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_tiny("LlamaForCausalLM", tmp_path_factory.mktemp("llama"), **WIDE)


def test_wrong_positions_are_a_finding_not_a_crash(llama):
    """Chunks restarting at position 0: rows stay where the scheduler put them, the positions are named."""
    with planted_runtime("chunk_positions_restart"):
        result = run_parity(llama, scenarios=("prefill", "chunked"))
    assert result.scenarios["prefill"].passed
    s = result.scenarios["chunked"]
    # budget 7: request 0 runs tokens 0-6, then 7-12 with request 1's token 0; request 1 goes on from token 1
    assert not s.passed and s.failures[0].startswith("positions: request 1 token 1 ran at position 0"), s.failures
    assert any(f.startswith("positions: request 0 token 7 ran at position 0") for f in s.failures)
    first = s.first_divergence
    assert (first["tap"], first["request"], first["position"]) == ("model.layers.0.self_attn", 1, 1), first
    assert (s.localization.culprit["tap"], s.localization.culprit["position"]) == ("model.layers.0.self_attn", 1)
    assert s.localization.hints[0].startswith("runtime bookkeeping, not the model: positions: request 1 token 1")


def test_sampling_from_the_wrong_row_is_caught(llama):
    with planted_runtime("sampled_wrong_row"):
        result = run_parity(llama, scenarios=("prefill", "served"))
    for name in ("prefill", "served"):
        s = result.scenarios[name]
        first = s.first_divergence
        assert not s.passed and (first["tap"], first["request"], first["position"]) == ("sampled_logits", 1, 28), \
            (name, first)
    for name in ("prefill", "served"):
        s = result.scenarios[name]
        assert s.failures[0].startswith("sampled row: step 0 sampled from row 40 (request 1's token 27)"), s.failures
    assert any(f.startswith("greedy token: request 1 output 0") for f in result.scenarios["served"].failures)


def test_a_step_mixing_decode_and_prefill_rows_is_checked(llama):
    """The mixed scenario: prompts arrive one a step while the earlier ones decode. A bug only in such steps (a
    decode row's k/v written one slot off beside prefill rows) passes every other scenario and fails this one at
    the first decode row of a request (the lowest such position: request 2's, a 6-token prompt)."""
    result = run_parity(llama, scenarios=("decode", "mixed", "chunked", "served"))
    assert result.passed, {n: s.failures for n, s in result.scenarios.items()}
    assert result.scenarios["mixed"].info["mixed_steps"] == 3  # prompts 1, 2 and 3 arrived beside decodes
    with planted_runtime("mixed_decode_slot_off"):
        result = run_parity(llama, scenarios=("decode", "mixed", "chunked", "served"))
    assert [n for n, s in result.scenarios.items() if not s.passed] == ["mixed"]
    first = result.scenarios["mixed"].first_divergence
    assert (first["request"], first["position"]) == (2, len(result.prompts[2])), first


def test_the_served_path_is_checked_without_hooks(llama):
    """A bug only in the fused native step: every hooked scenario passes, served does not."""
    from zoo import kernels

    if not kernels.enabled():
        pytest.skip("the native kernels are off: the served path runs the modules")
    result = run_parity(llama, scenarios=("prefill", "served"))
    assert result.passed and result.scenarios["served"].info["fused_steps"] == result.scenarios["served"].info["steps"]
    with planted_runtime("fused_logits_scaled"):
        result = run_parity(llama, scenarios=("prefill", "decode", "served"))
    assert result.scenarios["prefill"].passed and result.scenarios["decode"].passed
    s = result.scenarios["served"]
    assert not s.passed and s.first_divergence["tap"] == "sampled_logits"
    assert (s.first_divergence["request"], s.first_divergence["position"]) == (2, 5), s.first_divergence  # 6 tokens
    assert any(h.startswith("served diverges while prefill passes: the served path (no hooks): the fused native step")
               for h in result.hints), result.hints


# -- 7. config-level mistakes below the tolerance ------------------------------------------------------------------
def test_a_constant_below_the_tolerance_is_named(llama, capsys):
    with planted("norm_eps_slight"):
        result = run_parity(llama, scenarios=("prefill",))
        rc = zoo_main(["parity", str(llama), "--scenario", "prefill", "--quiet"])
    assert result.scenarios["prefill"].passed and not result.passed  # numerically within tolerance, still wrong
    assert result.constants["mismatches"] == [f"{L}.post_attention_layernorm eps: zoo 1e-05, reference 1e-06"]
    out = capsys.readouterr().out
    assert rc == 1 and f"CONSTANT DIFFERS: {L}.post_attention_layernorm eps: zoo 1e-05" in out, out
    assert "DIVERGES: built constants" in out


# -- 8. hints ranked by evidence -------------------------------------------------------------------------------------
def test_a_wrong_attention_scale_is_not_blamed_on_rotary(llama):
    """Position 0 attends only to itself, so it matches whatever the scale: the hint must name the scale."""
    with planted("attention_scale"):
        result = run_parity(llama, scenarios=("prefill",))
    s = result.scenarios["prefill"]
    first, culprit = s.first_divergence, s.localization.culprit
    assert (first["tap"], first["position"]) == (f"{L}.self_attn", 1), first
    assert (culprit["block"], culprit["tap"], culprit["position"]) == (L, f"{L}.self_attn", 1), culprit
    assert s.localization.hints[0].startswith(f"built with another constant than the reference: {L}.self_attn scale"), \
        s.localization.hints
    assert not any("rotary embedding (rotate-half" in h for h in s.localization.hints[:2]), s.localization.hints


# -- 9. a silent untie, said in every summary -----------------------------------------------------------------------
def test_an_untie_is_said_by_inspect_run_and_parity(tmp_path, capsys):
    import torch
    from safetensors.torch import load_file, save_file
    from test_cli_run import save_chat_model

    path = save_chat_model(tmp_path / "m", tie_word_embeddings=True, initializer_range=0.2)
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.weight"] = torch.randn_like(tensors["model.embed_tokens.weight"])  # a head of its own
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    untie = "lm_head.weight untied from model.embed_tokens.weight (the checkpoint holds its own lm_head.weight)"
    assert zoo_main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    ok = next(i for i, line in enumerate(lines) if line.startswith("ok: "))  # the summary, after the table
    assert lines[ok + 1] == f"note: {untie}: the config ties them, the model will use the checkpoint's own weights"
    assert zoo_main(["run", str(path), "--no-chat", "--prompt", "w1 w2 w3", "--max-tokens", "2"]) == 0
    assert f"zoo: note: {untie}" in capsys.readouterr().err
    zoo_main(["parity", str(path), "--scenario", "prefill", "--quiet"])
    assert f"NOTE: {untie}: the config ties them" in capsys.readouterr().out


def test_blame_goes_to_the_tap_that_adds_the_error(llama):
    """The attention residual scaled by 1 + 1e-4: the post-attention norm passes it on below tolerance, the MLP
    amplifies it over; the MLP's own error (fed the zoo's norm output) is nil, the residual adds are to blame."""
    with planted("residual_scaled"):
        result = run_parity(llama, scenarios=("prefill",))
    s = result.scenarios["prefill"]
    assert s.first_divergence["tap"] == f"{L}.mlp", s.first_divergence  # the first tap over tolerance
    culprit = s.localization.culprit
    assert (culprit["block"], culprit["tap"], culprit["inherits"], culprit["position"]) == (L, L, f"{L}.mlp", 0), culprit
    assert s.localization.hints[0].startswith(f"L{BUG_LAYER} at position") and "residual adds" in s.localization.hints[0]
    assert s.localization.hints[1].startswith(f"L{BUG_LAYER}.mlp is the first tap over tolerance but only by what it "
                                              f"inherits"), s.localization.hints


# -- 6. tiny checkpoints with transformers' initial constants ----------------------------------------------
def test_tiny_checkpoints_randomise_norm_weights_so_an_ignored_weight_shows(tmp_path):
    """A norm that never applies its weight passes on a checkpoint whose norm weights are transformers' initial
    ones (all 1); `--tiny` (save_tiny_checkpoint) randomises them, and the bug is found in its layer."""
    from parity.tiny import save_tiny_checkpoint

    plain = save_tiny("LlamaForCausalLM", tmp_path / "plain", initializer_range=0.2)
    with planted("norm_weight_ignored"):
        assert run_parity(plain, scenarios=("prefill",)).passed  # the blind spot, as it was
    plain_config = tmp_path / "plain" / "config.json"
    tiny = save_tiny_checkpoint(plain_config, tmp_path / "tiny")
    assert run_parity(tiny, scenarios=("prefill",)).passed  # unmutated: no false positive
    with planted("norm_weight_ignored"):
        s = run_parity(tiny, scenarios=("prefill",)).scenarios["prefill"]
    assert not s.passed
    assert (s.first_divergence["tap"], s.first_divergence["position"]) == (f"{L}.post_attention_layernorm", 0), \
        s.first_divergence
