"""Mutation tests: each planted bug (tests/mutants.py, served through the registry with override=True) makes
parity fail, and the report names the right layer, sub-block and first position, with the right hint."""
from __future__ import annotations

import pytest

from mutants import BUG_LAYER, MUTANTS, NAN_POSITION, planted
from parity.harness import run_parity
from registry import get_registry
from tiny import save_tiny
from zoo.cli import main as zoo_main

WINDOW = 8
L = f"model.layers.{BUG_LAYER}"
# mutant -> (first diverging tap, first position, words the hints must contain)
EXPECTED = {
    "rotary_wrong_half": (f"{L}.self_attn", 1, "position 0 matches and later positions do not: rotary"),
    "norm_eps": (f"{L}.post_attention_layernorm", 0, "one scale per token: the eps"),
    "gate_up_swapped": (f"{L}.mlp", 0, "gate/up order"),
    "kv_wrong_group": (f"{L}.self_attn", 0, "KV head -> query group"),
    "missing_attn_residual": (f"{L}.post_attention_layernorm", 0, "residual add after attention is missing"),
    "missing_mlp_residual": (L, 0, "residual add after the MLP is missing"),
    # NaN rows once read as "position not produced": now a failure at that very layer and position
    "nan_at_one_position": (L, NAN_POSITION, f"L{BUG_LAYER} at position {NAN_POSITION}: non-finite values"),
    "window_off_by_one": (f"{L}.self_attn", WINDOW, f"divergence starts at the sliding window ({WINDOW} tokens)"),
    "moe_no_renormalize": (f"{L}.mlp", 0, "same router logits and experts: the expert weights"),
    # the router's logits are right, its chosen experts are not: the router tap is the first to diverge,
    # and replaying the layer shows the logits right and the MoE block wrong
    "moe_off_by_one_expert": (f"{L}.mlp.gate", 0, "same router logits but other experts chosen"),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    wide = dict(initializer_range=0.2)
    return {"LlamaForCausalLM": save_tiny("LlamaForCausalLM", tmp_path_factory.mktemp("llama"), **wide),
            "MistralForCausalLM": save_tiny("MistralForCausalLM", tmp_path_factory.mktemp("mistral"),
                                            sliding_window=WINDOW, **wide),
            "MixtralForCausalLM": save_tiny("MixtralForCausalLM", tmp_path_factory.mktemp("mixtral"),
                                            num_local_experts=4, num_experts_per_tok=2, **wide)}


def test_every_mutant_has_an_expectation():
    assert set(EXPECTED) == set(MUTANTS)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM"])
def test_no_planted_bug_passes(checkpoints, arch):
    result = run_parity(checkpoints[arch], scenarios=("prefill", "decode"))
    assert result.passed, {n: s.failures for n, s in result.scenarios.items()}
    assert all(s.localization is None and s.first_divergence is None for s in result.scenarios.values())


@pytest.mark.parametrize("name", list(MUTANTS))
def test_planted_bug_is_found_and_named(checkpoints, name):
    arch = MUTANTS[name][0]
    tap, position, hint = EXPECTED[name]
    with planted(name) as spec:
        assert spec.plugin == f"mutant-{name}"
        result = run_parity(checkpoints[arch], scenarios=("prefill",))
    assert get_registry().get(arch).plugin.startswith("plugins."), "the mutant was not unregistered"
    s = result.scenarios["prefill"]
    assert not s.passed and not result.passed
    first = s.first_divergence
    assert (first["tap"], first["layer"], first["position"]) == (tap, BUG_LAYER, position), first
    culprit = s.localization.culprit
    assert (culprit["block"], culprit["tap"], culprit["position"]) == (L, tap, position), culprit
    blocks = {b.name: b for b in s.localization.blocks}
    assert blocks["model.layers.0"].local < 1e-4 and blocks[L].local > 1e-3  # layer 0 adds nothing, layer 1 does
    assert blocks[L].inherited < 1e-4  # layer 1's input is right: the error is its own
    assert any(hint in h for h in s.localization.hints), s.localization.hints


def test_nan_output_fails_with_every_position_compared(checkpoints):
    """The NaN rows are compared (inf error, cosine -1), not skipped; every computed position counts."""
    with planted("nan_at_one_position"):
        result = run_parity(checkpoints["LlamaForCausalLM"], scenarios=("prefill",))
    s = result.scenarios["prefill"]
    first = s.first_divergence
    assert first["rel_l2"] == float("inf") and first["cosine"] == -1.0
    cmp = s.comparison
    assert [int(c.sum()) for c in cmp.compared] == s.lengths  # the NaN positions were compared
    logits = cmp.logits.summary(s.tol)
    assert logits["kl_max"] == logits["kl_p99"] == float("inf") and logits["positions"] == sum(s.lengths)
    assert any(f.startswith(f"{L}: rel_l2 inf") for f in s.failures), s.failures


def test_cli_exits_1_and_names_the_layer(checkpoints, capsys):
    with planted("gate_up_swapped"):
        rc = zoo_main(["parity", str(checkpoints["LlamaForCausalLM"]), "--scenario", "prefill", "--quiet"])
    out = capsys.readouterr().out
    assert rc == 1, out
    assert f"first divergence: {L}.mlp (request 0, position 0)" in out
    assert f"culprit: {L} -> {L}.mlp at position 0" in out and "DIVERGES: prefill" in out


def test_decode_only_bug_is_a_decode_divergence(checkpoints):
    """A window bug on a prompt shorter than the window shows only once decoding crosses the window."""
    prompts = [list(range(3, 3 + WINDOW - 1)), list(range(20, 25))]
    with planted("window_off_by_one"):
        result = run_parity(checkpoints["MistralForCausalLM"], prompts=prompts, scenarios=("prefill", "decode"),
                            max_new_tokens=4)
    assert result.scenarios["prefill"].passed and not result.scenarios["decode"].passed
    first = result.scenarios["decode"].first_divergence
    assert (first["tap"], first["request"], first["position"]) == (f"{L}.self_attn", 0, WINDOW)
    assert any("decode diverges while prefill passes" in h for h in result.hints)


def test_a_crash_in_one_scenario_is_a_finding_of_that_scenario(checkpoints, capsys):
    with planted("decode_raises"):
        rc = zoo_main(["parity", str(checkpoints["LlamaForCausalLM"]), "--scenario", "prefill", "--scenario",
                       "decode", "--quiet"])
    out = capsys.readouterr().out
    assert rc == 1, out
    assert "prefill   pass" in out and "decode    DIVERGES" in out
    assert "NotImplementedError: model.layers.0.self_attn: attention to cached context" in out
