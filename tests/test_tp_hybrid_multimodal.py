"""Tensor parallelism for the hybrid SSM and multimodal architectures (issue 36, part 2), over 2 gloo ranks.

Hybrids: the Mamba2 / SSD mixers (Mamba2, Bamba) split by heads, B and C by groups (a group shared by the ranks
when they outnumber the groups: its gated norm then sums their squares), Jamba's Mamba1 mixers by inner channels
(x_proj's dt / B / C all-reduced); each rank's recurrent state slots hold its part of the conv and SSM states, and
the snapshot saves / restores rank 0 schedules run on every rank (the prefix scenario restores one into a slot of
another index).

Multimodal (LLaVA, Qwen2-VL): the language model keeps its text architecture's layout; the vision tower is split by
heads (q / k / v and fc1 column-parallel, the output projection and fc2 row-parallel) and so is the projector /
patch merger, so every vision layer's output and the image features are whole on every rank. Every encoder run on
rank 0 (its encoder cache missed) is one on rank 1, which keeps no encoder cache.

One spawned rank 1 serves the whole module (shared_workers): the added time is the spawn and tiny models' steps.
"""
from __future__ import annotations

from functools import partial

import pytest
import transformers

from multimodal_tiny import drawn_image, random_image, save_tiny_llava, save_tiny_qwen2_vl
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


QWEN_IMAGE = "<|vision_start|> <|image_pad|> <|vision_end|>"
MULTIMODAL = {  # architecture -> (its tiny checkpoint, the placeholder one image takes in a prompt)
    "LlavaForConditionalGeneration": (save_tiny_llava, "<image>"),
    # wide vision weights (as parity --tiny's): with transformers' 0.02 the tower's attention barely moves the tokens
    "Qwen2VLForConditionalGeneration": (partial(save_tiny_qwen2_vl, vision={"initializer_range": 0.2}), QWEN_IMAGE),
}
IMAGES = [random_image(0), drawn_image(1), drawn_image(2, (20, 60))]


def _image_requests(placeholder: str) -> list:
    return [{"prompt": f"user : {placeholder} w4 w5 {placeholder} w6 assistant :",
             "multi_modal_data": {"image": IMAGES[:2]}},
            {"prompt": f"user : w1 {placeholder} w2 w3 assistant :", "multi_modal_data": {"image": [IMAGES[2]]}},
            "user : w7 w8 w9 w10 assistant :"]


@pytest.mark.parametrize("arch", list(MULTIMODAL))
def test_tp2_greedy_tokens_equal_one_process_on_a_multimodal_model(arch, tmp_path, shared):
    """Issue 36's acceptance on a multimodal model: two image prompts and a text one generate over 2 ranks what one
    process generates (the vision tower split by heads), with as many encoder runs, and again from the prefix
    cache."""
    save, placeholder = MULTIMODAL[arch]
    path = save(tmp_path / arch)
    requests = _image_requests(placeholder)
    one, runs, _ = _greedy(path, requests, twice=True)
    two, tp_runs, cached = _greedy(path, requests, twice=True, tensor_parallel_size=2)
    assert two == one and all(len(set(t)) > 1 for t in one[0]), (two, one)
    assert tp_runs == runs > 0 and cached[0] > 0, (tp_runs, runs, cached)


@pytest.mark.parametrize("arch", list(MULTIMODAL))
def test_tp2_image_parity(arch, tmp_path, shared, capsys):
    """`zoo parity --tensor-parallel-size 2 --image`: every built vision layer, the projector (merger) and the merged
    embeddings compared with transformers (whole after their all-reduces), and the image scenarios through the
    runtime over 2 ranks."""
    save, _ = MULTIMODAL[arch]
    path = save(tmp_path / arch)
    IMAGES[0].save(tmp_path / "a.png")
    IMAGES[1].save(tmp_path / "b.png")
    status = main(["parity", str(path), "--quiet", "--scenario", "prefill", "--tensor-parallel-size", "2",
                   "--image", str(tmp_path / "a.png"), "--image", str(tmp_path / "b.png")])
    out = capsys.readouterr().out
    assert status == 0, out
    assert f"image parity ({arch}, tensor parallel size 2): pass" in out, out
    assert sum(" vision " in line for line in out.splitlines()) >= 2 and " projector " in out, out
    assert all(f"image scenario {name:<10} pass" in out for name in ("chunked", "prefix", "decode", "processors"))


@pytest.mark.parametrize("arch", list(MULTIMODAL))
def test_the_vision_tower_is_split_by_heads(arch, tmp_path, capsys):
    """Each rank builds half the vision heads, MLP width and projector width; `zoo inspect` proves 2 ranks cover every
    element, and a size the vision heads do not split into is refused naming the field."""
    save, _ = MULTIMODAL[arch]
    path = save(tmp_path / arch, randomize=False)
    config = transformers.AutoConfig.from_pretrained(path)
    spec = get_registry().resolve(config)
    whole, half = spec.build(config), tensor_parallel_model(spec, config, 2)[0]
    attn = {"LlavaForConditionalGeneration": "self_attn", "Qwen2VLForConditionalGeneration": "attn"}[arch]
    for (name, a), (_, b) in zip(whole.named_modules(), half.named_modules()):
        if name.endswith(f".{attn}") and ("vision_tower" in name or "visual" in name):
            assert b.num_heads * 2 == a.num_heads and b.head_dim == a.head_dim, name
    sizes = {n: p.numel() for n, p in whole.named_parameters()}
    split = {n: sizes[n] / p.numel() for n, p in half.named_parameters() if "vision_tower" in n or "visual" in n
             or "multi_modal_projector" in n}
    assert {round(r) for r in split.values()} == {1, 2}, split  # halves (heads, MLP widths) and whole (norms)
    assert main(["inspect", str(path), "--tensor-parallel-size", "2"]) == 0
    capsys.readouterr()
    field = "num_attention_heads" if arch.startswith("Llava") else "num_heads"
    with pytest.raises(ValueError, match=rf"config\.vision_config\.{field}=4 does not split over tensor parallel "
                                         rf"size 3"):
        tensor_parallel_model(spec, config, 3)
