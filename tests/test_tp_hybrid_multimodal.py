"""Tensor parallelism for the hybrid SSM architectures (issue 36, part 2), over 2 gloo ranks.

Hybrids: the Mamba2 / SSD mixers (Mamba2, Bamba) split by heads, B and C by groups (a group shared by the ranks
when they outnumber the groups: its gated norm then sums their squares), Jamba's Mamba1 mixers by inner channels
(x_proj's dt / B / C all-reduced); each rank's recurrent state slots hold its part of the conv and SSM states, and
the snapshot saves / restores rank 0 schedules run on every rank (the prefix scenario restores one into a slot of
another index).

One spawned rank 1 serves the whole module (shared_workers): the added time is the spawn and tiny models' steps.
"""
from __future__ import annotations

import pytest
import transformers

from parity.taps import role_of
from registry import get_registry
from tiny import save_tiny
from tiny_configs import TINY_CONFIGS, WIDE, save_arch
from zoo import LLM, SamplingParams
from zoo.build import tensor_parallel_model
from zoo.cli import main
from zoo.runtime.distributed import shared_workers
from zoo.runtime.state_pool import bytes_per_request, state_specs

HYBRIDS = {
    "Mamba2ForCausalLM": ("mixer",),  # 8 heads, 2 groups: one group per rank
    "BambaForCausalLM": ("mixer",),  # Mamba2 mixers beside attention (rotary on half the head)
    "JambaForCausalLM": ("mixer", "mixer_conv"),  # Mamba1 by channels (x_proj all-reduced), MoE, attention
}
PROMPTS = [[5, 17, 99, 3, 42, 8, 77, 12, 64, 31, 9], [11, 22, 33, 44, 55]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def shared():
    with shared_workers():
        yield


def _passes(result, roles=()) -> None:
    for name, s in result.scenarios.items():
        assert s.passed, f"{name}: {s.failures} first divergence {s.first_divergence}"
        got = {role_of(t.name) for t in s.comparison.taps}
        assert set(roles) <= got, f"{name}: compared {sorted(got)}, not {roles}"


@pytest.mark.parametrize("arch", list(HYBRIDS))
def test_tp2_parity_of_each_hybrid(arch, tmp_path, shared):
    """`zoo parity --tensor-parallel-size 2` (prefill, decode, prefix) on the tiny checkpoint: the mixers' outputs
    (after out_proj's all-reduce) compared, and the prefix hit restores a state snapshot on every rank."""
    from parity.harness import run_parity

    result = run_parity(str(save_arch(arch, tmp_path / arch)), scenarios=("prefill", "decode", "prefix"),
                        tensor_parallel_size=2)
    _passes(result, HYBRIDS[arch])
    assert result.scenarios["prefix"].info.get("state_restores"), result.scenarios["prefix"].info


def test_tp2_parity_of_one_group_shared_by_both_ranks(tmp_path, shared):
    """Mamba2 with n_groups=1: both ranks hold the group's B and C, and the gated norm's mean square is the sum of
    both ranks' parts (GroupRMSOverRanks); the mixers take the torch path (the native kernel normalises locally)."""
    from parity.harness import run_parity

    path = save_tiny("Mamba2ForCausalLM", tmp_path / "g1", randomize=True,
                     **{**WIDE, **TINY_CONFIGS["Mamba2ForCausalLM"], "n_groups": 1})
    _passes(run_parity(str(path), scenarios=("prefill", "prefix"), tensor_parallel_size=2), ("mixer",))


def test_rank_local_state_pool_holds_each_ranks_part(tmp_path):
    """A rank's StateSpecs come from its rank-local model: its heads' (Mamba2) or channels' (Jamba) conv and SSM
    states, half of one process's per request over 2 ranks; B and C's conv channels are each rank's groups, or the
    whole of the one group both ranks share (n_groups=1: more than half)."""
    for arch, groups in (("Mamba2ForCausalLM", 2), ("Mamba2ForCausalLM", 1), ("JambaForCausalLM", None)):
        path = save_tiny(arch, tmp_path / f"{arch}-{groups}",
                         **{**WIDE, **TINY_CONFIGS[arch], **({"n_groups": groups} if groups else {})})
        config = transformers.AutoConfig.from_pretrained(path)
        spec = get_registry().resolve(config)
        one = bytes_per_request(state_specs(spec.build(config)))
        two = state_specs(tensor_parallel_model(spec, config, 2)[0])
        if groups is None:  # Jamba: conv (K-1, I/2), ssm (I/2, N)
            i, k, n = config.mamba_expand * config.hidden_size, config.mamba_d_conv, config.mamba_d_state
            assert {tuple(shape for _, shape, _ in s.tensors) for s in two.values()} == {((k - 1, i // 2), (i // 2, n))}
            assert bytes_per_request(two) * 2 == one
            continue
        k, n, h, p = config.conv_kernel, config.state_size, config.num_heads, config.head_dim
        bc = 2 * max(groups // 2, 1) * n  # this rank's B and C channels
        assert {tuple(shape for _, shape, _ in s.tensors) for s in two.values()} == {((k - 1, h * p // 2 + bc),
                                                                                      (h // 2, p, n))}
        assert (bytes_per_request(two) * 2 == one) == (groups == 2)


@pytest.mark.parametrize("config, size, said", [
    (lambda: transformers.Mamba2Config(num_heads=6, n_groups=3, head_dim=32, hidden_size=96), 2,
     "config.n_groups=3 and tensor parallel size 2: neither divides the other"),
    (lambda: transformers.Mamba2Config(num_heads=6, n_groups=2, head_dim=32, hidden_size=96), 4,
     "config.num_heads=6 does not split over tensor parallel size 4"),
    (lambda: transformers.BambaConfig(mamba_n_heads=6, mamba_n_groups=2, mamba_d_head=32, hidden_size=96,
                                      num_attention_heads=4, num_key_value_heads=4), 4,
     "config.mamba_n_heads=6 does not split over tensor parallel size 4"),
    (lambda: transformers.JambaConfig(hidden_size=64, mamba_expand=2), 3,
     "config.mamba_expand x hidden_size = 128 Mamba channels do not split over tensor parallel size 3"),
], ids=["mamba2-groups", "mamba2-heads", "bamba-heads", "jamba-channels"])
def test_a_config_that_does_not_split_is_refused_naming_the_field(config, size, said):
    config = config()
    with pytest.raises(ValueError) as e:
        tensor_parallel_model(get_registry().resolve(config), config, size)
    assert said in str(e.value), str(e.value)


def test_zoo_inspect_proves_the_split_and_refuses_one_that_does_not(tmp_path, capsys):
    path = save_arch("BambaForCausalLM", tmp_path / "bamba")
    assert main(["inspect", str(path), "--tensor-parallel-size", "4"]) == 0  # 2 groups for 4 ranks: shared
    capsys.readouterr()
    assert main(["inspect", str(path), "--tensor-parallel-size", "3"]) == 2
    out = capsys.readouterr()
    text = out.out + out.err
    assert "config.num_attention_heads=4 does not split over tensor parallel size 3" in text, text
    assert "Traceback" not in text


def _greedy(path, prompts, *, twice=False, **kw):
    """Greedy outputs of one LLM (run twice over the prompts with `twice`: the second run from the prefix cache), its
    encoder runs, its cached tokens."""
    llm = LLM(str(path), block_size=4, **kw)
    try:
        runs = [llm.generate(prompts, GREEDY) for _ in range(2 if twice else 1)]
        mm = llm.engine.mm
        return [[o.token_ids for o in outs] for outs in runs], mm.encoder_runs if mm else 0, \
            [o.num_cached_tokens for o in runs[-1]]
    finally:
        llm.close()


def test_tp2_greedy_tokens_equal_one_process_on_a_hybrid(tmp_path, shared):
    """Issue 36's acceptance on a hybrid: Jamba (Mamba1 mixers, attention, MoE) generates what one process generates,
    the second time from the prefix cache (a state snapshot restored on both ranks)."""
    path = save_arch("JambaForCausalLM", tmp_path / "jamba")
    one, _, _ = _greedy(path, PROMPTS, twice=True)
    two, _, cached = _greedy(path, PROMPTS, twice=True, tensor_parallel_size=2)
    assert two == one and all(len(set(t)) > 1 for t in one[0]), (two, one)
    assert cached[0] > 0, cached
