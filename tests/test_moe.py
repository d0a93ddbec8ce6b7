"""Mixture-of-experts: the layer against transformers' MoE blocks, then each MoE model read from disk."""
from __future__ import annotations

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.overrides import TorchFunctionMode
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from batching import allocate_kv, assert_close, random_prompts, reference_chunks, run_schedule, run_step
from kernel_paths import ops  # noqa: F401
from loader import LoadError
from tiny import built_case, load_reference, save_tiny
from zoo import kernels
from zoo.build import build_model
from zoo.layers.mlp import GatedMLP
from zoo.layers.moe import SparseMoeBlock, StackedExperts, combine_in_expert_order

H, E, K = 64, 4, 2


# -- the layer alone, against transformers' blocks with the same weights ---------------------------------

def _reference_block(block_cls, config, seed=0):
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    ref = block_cls(config).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(std=0.2)
    return ref


def _ours_like(ref, **kwargs) -> SparseMoeBlock:
    num_experts, two_i, hidden = ref.experts.gate_up_proj.shape
    ours = SparseMoeBlock(hidden_size=hidden, num_experts=num_experts, top_k=ref.gate.top_k,
                          intermediate_size=two_i // 2, prefix="mlp", **kwargs)
    with torch.no_grad():
        ours.gate.weight.copy_(ref.gate.weight)
        ours.experts.gate_up_proj.weight.copy_(ref.experts.gate_up_proj)
        ours.experts.down_proj.weight.copy_(ref.experts.down_proj)
    return ours


BLOCKS = {
    "mixtral": (MixtralSparseMoeBlock,
                lambda: transformers.MixtralConfig(hidden_size=H, intermediate_size=48, num_local_experts=E,
                                                   num_experts_per_tok=K),
                dict(renormalize=True, weights_in_input_dtype=False)),
    "qwen3_moe": (Qwen3MoeSparseMoeBlock,
                  lambda: transformers.Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=32, num_experts=E,
                                                      num_experts_per_tok=K, norm_topk_prob=True),
                  dict(renormalize=True)),
    "olmoe": (OlmoeSparseMoeBlock,
              lambda: transformers.OlmoeConfig(hidden_size=H, intermediate_size=48, num_experts=E,
                                               num_experts_per_tok=K, norm_topk_prob=False),
              dict(renormalize=False)),
}


@pytest.mark.parametrize("name", sorted(BLOCKS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_block_matches_transformers(name, dtype):
    block_cls, make_config, kwargs = BLOCKS[name]
    ref = _reference_block(block_cls, make_config())
    ours = _ours_like(ref, **kwargs)
    ref, ours = ref.to(dtype), ours.to(dtype)
    x = torch.randn(3, 7, H, generator=torch.Generator().manual_seed(1)).to(dtype)  # [B, S, H]
    ref_logits, ref_weights, ref_ids = ref.gate(x.view(-1, H))
    logits, weights, ids = ours.gate(x.view(-1, H))  # [T, E], [T, K], [T, K]
    assert torch.equal(ids, ref_ids) and weights.dtype == ref_weights.dtype
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0)
    torch.testing.assert_close(weights, ref_weights)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(ours(x.view(-1, H)), ref(x).view(-1, H), **tol)


@torch.inference_mode()
def test_shared_expert_block_matches_transformers():
    config = transformers.Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                         num_experts=E, num_experts_per_tok=K, norm_topk_prob=False)
    ref = _reference_block(Qwen2MoeSparseMoeBlock, config)
    ours = _ours_like(ref, renormalize=False,
                      shared_expert=GatedMLP(hidden_size=H, intermediate_size=48, prefix="mlp.shared_expert"))
    s = ref.shared_expert
    ours.shared_expert.gate_up_proj.weight.copy_(torch.cat([s.gate_proj.weight, s.up_proj.weight]))
    ours.shared_expert.down_proj.weight.copy_(s.down_proj.weight)
    ours.shared_expert_gate.weight.copy_(ref.shared_expert_gate.weight)
    x = torch.randn(2, 9, H, generator=torch.Generator().manual_seed(1))  # [B, S, H]
    torch.testing.assert_close(ours(x.view(-1, H)), ref(x).view(-1, H), rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_dispatch_runs_each_expert_once_on_its_tokens(ops, monkeypatch):
    """Each expert's weight is called once, on exactly the tokens routed to it, in token order (through
    F.linear; with the kernels on the whole dispatch is one native call, kernels.moe_experts, whose sums are
    checked here and against transformers' blocks above)."""
    experts = StackedExperts(E, H, 16)
    for p in experts.parameters():
        torch.nn.init.normal_(p.data, std=0.2)
    x = torch.randn(5, H)
    ids = torch.tensor([[2, 0], [0, 2], [3, 0], [2, 3], [0, 2]])  # expert 1 gets no token
    weights = torch.rand(5, 2)
    seen = []  # (expert, rows it ran on), recorded from every linear call on an expert's weight

    def record(rows, w):
        for e in range(E):
            if w.data_ptr() == experts.gate_up_proj.weight[e].data_ptr():
                seen.append((e, rows.clone()))

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.nn.functional.linear:
                record(args[0], args[1])
            return func(*args, **(kwargs or {}))

    native = kernels.linear
    monkeypatch.setattr(kernels, "linear", lambda rows, w, b=None: (record(rows, w), native(rows, w, b))[1])
    with Spy():
        out = experts(x, ids, weights)
    assert [e for e, _ in seen] == ([] if ops == "kernels" else [0, 2, 3])
    for e, inp in seen:
        tokens = [t for t in range(5) if e in ids[t].tolist()]
        torch.testing.assert_close(inp, x[tokens])
    # the same sum written out per token
    want = torch.zeros_like(x)
    for t in range(5):
        for j in range(2):
            e = int(ids[t, j])
            g, u = (x[t] @ experts.gate_up_proj.weight[e].T).chunk(2)
            want[t] += weights[t, j] * ((torch.nn.functional.silu(g) * u) @ experts.down_proj.weight[e].T)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 6, 40])
@torch.inference_mode()
def test_native_experts_equal_the_torch_dispatch(rows):
    """kernels.moe_experts (one call: sort by expert, each expert's GEMMs on the path its row count picks, the
    experts with <= 4 rows as one grouped GEMV, the combine in expert order) against the torch dispatch with
    the kernels off; the result does not depend on the thread count; bad expert ids are an error."""
    from kernel_paths import twice

    g = torch.Generator().manual_seed(rows)
    experts = StackedExperts(8, H, 40, hidden_act="silu")
    for p in experts.parameters():
        p.data.normal_(std=0.2, generator=g)
    x = torch.randn(rows, H, generator=g)  # [T, H]
    ids = torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(rows)])  # [T, 3]
    weights = torch.rand(rows, 3, generator=g)
    w13, w2 = experts.gate_up_proj.weight, experts.down_proj.weight
    got = twice(lambda: kernels.moe_experts(x, ids, weights, w13, w2, "silu"))
    previous = kernels.set_enabled(False)
    try:
        want = experts(x, ids, weights)
    finally:
        kernels.set_enabled(previous)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(IndexError, match=r"expert ids must lie in \[0, 8\)"):
        kernels.moe_experts(x, ids + 8, weights, w13, w2, "silu")
    # bfloat16 experts (the fused bfloat16 step's): read widened, the float32 kernel's result on the same values
    # up to the order of the sums (on AVX2 the rows are read as even / odd halves, x permuted to match)
    half = twice(lambda: kernels.moe_experts(x, ids, weights, w13.bfloat16(), w2.bfloat16(), "silu"))
    rounded = kernels.moe_experts(x, ids, weights, w13.bfloat16().float(), w2.bfloat16().float(), "silu")
    torch.testing.assert_close(half, rounded, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_combine_in_expert_order_is_index_add_bit_for_bit(k):
    """The kernels-on combine (no index_add_) adds each token's k rows in the order index_add_ does."""
    g = torch.Generator().manual_seed(k)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(7)])  # [T, k], distinct per token
    order = torch.argsort(ids.reshape(-1), stable=True)  # [A]
    weighted = torch.randn(ids.numel(), H, generator=g) * 10 ** torch.randn(ids.numel(), 1, generator=g)  # [A, H]
    want = torch.zeros(7, H).index_add_(0, order // k, weighted)
    got = combine_in_expert_order(weighted, order, k)
    assert torch.equal(got, want)
    if k > 2:  # the order matters: another order of the same additions differs somewhere
        assert not torch.equal(got, weighted[torch.argsort(order).view(-1, k).flip(1)].sum(1))


@torch.inference_mode()
def test_sigmoid_router_and_empty_step():
    block = SparseMoeBlock(hidden_size=H, num_experts=E, top_k=K, intermediate_size=8, scoring="sigmoid",
                           renormalize=False, prefix="mlp")
    for p in block.parameters():
        torch.nn.init.normal_(p.data, std=0.2)
    x = torch.randn(6, H)
    logits, weights, ids = block.gate(x)  # [T, E], [T, K], [T, K]
    torch.testing.assert_close(weights, logits.sigmoid().gather(1, ids))
    assert torch.equal(ids, logits.topk(K).indices)
    assert block(x[:0]).shape == (0, H)  # a step with no tokens for this layer


def test_router_rejects_bad_top_k():
    with pytest.raises(ValueError, match="num_experts_per_tok=5"):
        SparseMoeBlock(hidden_size=H, num_experts=4, top_k=5, intermediate_size=8, prefix="model.layers.0.mlp")


# -- the models, read from disk through the registry and the strict loader ----------------------------

CASES = {
    # every layer sparse; a window shorter than the prompt
    "mixtral": ("MixtralForCausalLM", dict(num_local_experts=E, num_experts_per_tok=K, sliding_window=6)),
    # layer 0 dense (decoder_sparse_step=2), layer 1 sparse with the gated shared expert; q/k/v bias
    "qwen2_moe": ("Qwen2MoeForCausalLM", dict(num_experts=E, num_experts_per_tok=K, moe_intermediate_size=32,
                                              shared_expert_intermediate_size=48, decoder_sparse_step=2)),
    # layer 1 dense (mlp_only_layers), renormalised top-k, per-head q/k norm, a window on all layers
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(num_experts=E, num_experts_per_tok=K, moe_intermediate_size=32,
                                              mlp_only_layers=[1], norm_topk_prob=True, use_sliding_window=True,
                                              sliding_window=7, head_dim=32)),
    # whole-width q/k norm, q/k/v clipped
    "olmoe": ("OlmoeForCausalLM", dict(num_experts=E, num_experts_per_tok=K, clip_qkv=0.6)),
}


@pytest.fixture(params=list(CASES))
def case(request, tmp_path_factory):
    """(name, checkpoint dir, zoo model, transformers model), each built once per session."""
    arch, overrides = CASES[request.param]
    *built, spec = built_case(arch, overrides, request.param, tmp_path_factory)
    assert spec.architectures == (arch,) and spec.family == "moe"
    return tuple(built)


def test_sparse_layers_and_windows_follow_transformers(case):
    """The schedule of sparse / dense layers (and shared experts) is transformers'; windows are set."""
    name, _, model, ref = case
    kinds = lambda layers: [(hasattr(l.mlp, "experts"), hasattr(l.mlp, "shared_expert")) for l in layers]  # noqa: E731
    assert kinds(model.model.layers) == kinds(ref.model.layers), name
    assert any(k[0] for k in kinds(model.model.layers)), name
    window = CASES[name][1].get("sliding_window")
    assert {l.self_attn.attn.sliding_window for l in model.model.layers} == {window}, name


def test_prefill(case):
    name, _, model, ref = case
    [tokens] = random_prompts([20], vocab=128)
    [[got]] = run_schedule(model, [tokens], [[(0, 20)]])
    [want] = reference_chunks(ref, tokens, [20])
    assert_close(got, want, f"{name} prefill")


def test_decode_steps(case):
    name, _, model, ref = case
    [tokens] = random_prompts([20], vocab=128, seed=1)
    got = run_schedule(model, [tokens], [[(0, 12)]] + [[(0, 1)]] * 8)[0]
    want = reference_chunks(ref, tokens, list(range(12, 21)))
    for step, (g, w) in enumerate(zip(got, want)):
        assert_close(g, w, f"{name} decode step {step}")


def test_ragged_batch(case):
    """Three requests share each step (so the experts see tokens of several requests at once)."""
    name, _, model, ref = case
    requests = random_prompts([9, 15, 21], vocab=128, seed=2)
    steps = [[(0, 7), (1, 13), (2, 10)], [(0, 1), (2, 10), (1, 1)], [(2, 1), (1, 1), (0, 1)]]
    got = run_schedule(model, requests, steps, shuffle=True)
    for r, tokens in enumerate(requests):
        cuts = [sum(dict(s)[r] for s in steps[:i + 1]) for i in range(len(steps))]
        for step, (g, w) in enumerate(zip(got[r], reference_chunks(ref, tokens, cuts))):
            assert_close(g, w, f"{name} ragged request {r} step {step}")


@torch.no_grad()
def test_router_taps_join_by_name(case):
    """A forward hook on each `mlp.gate` sees the same router logits and the same chosen experts as the
    hook on transformers' module of the same name; every expert of every sparse layer gets tokens."""
    name, _, model, ref = case
    [tokens] = random_prompts([20], vocab=128, seed=5)
    taps = {"zoo": {}, "ref": {}}
    hooks = [m.register_forward_hook(lambda m, i, o, n=n, side=side: taps[side].__setitem__(n, o))
             for side, root in (("zoo", model), ("ref", ref)) for n, m in root.named_modules()
             if n.endswith("mlp.gate")]
    try:
        run_step(model, [(tokens, 0)], allocate_kv(model))
        ref(torch.tensor([tokens]))
    finally:
        for h in hooks:
            h.remove()
    assert taps["zoo"] and list(taps["zoo"]) == list(taps["ref"])
    for n, (logits, _, ids) in taps["zoo"].items():
        ref_logits, _, ref_ids = taps["ref"][n]
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} {n}: {m}")
        assert torch.equal(ids.sort(-1).values, ref_ids.sort(-1).values), f"{name} {n}: experts chosen differ"
        assert set(ids.flatten().tolist()) == set(range(E)), f"{name} {n}: some expert got no token"


def test_greedy_generation_matches_transformers(case):
    """32 greedy steps through the runtime (`zoo.LLM`, continuous batching of ragged prompts)."""
    from zoo import LLM, SamplingParams

    name, path, _, ref = case
    batch = random_prompts([19, 7, 3], vocab=128, seed=6)
    ref.generation_config.eos_token_id = None  # 32 tokens on both sides, whatever comes out
    llm = LLM(str(path), block_size=4)
    if kernels.enabled():  # Mixtral's, Qwen3-MoE's and Qwen2-MoE's experts run inside the fused native step
        fused = name in ("mixtral", "qwen3_moe", "qwen2_moe")
        assert llm.engine.runner.step_path.startswith("fused native step") == fused, llm.engine.runner.step_path
    outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for i, (prompt, out) in enumerate(zip(batch, outs)):
        with torch.no_grad():
            want = ref.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                                pad_token_id=0)[0, len(prompt):].tolist()
        assert list(out.token_ids) == want, f"{name} prompt {i}: greedy tokens differ from transformers"


@pytest.mark.parametrize("name", ["mixtral", "olmoe"])
def test_fused_layout_loads_the_same(name, tmp_path):
    """transformers v5's own layout (save_original_format=False: `mlp.experts.gate_up_proj` [E, 2I, H], no
    `.weight`) loads into the same parameters as the per-expert hub layout."""
    arch, overrides = CASES[name]
    hub = save_tiny(arch, tmp_path / "hub", **overrides)
    load_reference(hub).save_pretrained(tmp_path / "fused", save_original_format=False)
    with safe_open(tmp_path / "fused" / "model.safetensors", "pt") as f:
        assert "model.layers.0.mlp.experts.gate_up_proj" in f.keys()
    a, *_ = build_model(hub)
    b, *_ = build_model(tmp_path / "fused")
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert list(pa) == list(pb)
    for n in pa:
        assert torch.equal(pa[n], pb[n]), n


# -- broken expert checkpoints fail strictly, naming the expert's key and the destination ---------------

def _edit(path, edit):
    """Rewrite path/model.safetensors with edit(tensors) applied (the file on disk is what the loader reads)."""
    f = path / "model.safetensors"
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f, metadata={"format": "pt"})
    return path


def _load_error(path) -> str:
    with pytest.raises(LoadError) as e:
        build_model(path)
    return str(e.value)


TINY = {  # arch, overrides, the checkpoint spelling of layer 0's experts and of up/gate/down
    "mixtral": ("MixtralForCausalLM", dict(num_local_experts=E, num_experts_per_tok=K),
                "model.layers.0.block_sparse_moe.experts", ("w3", "w1", "w2")),
    "olmoe": ("OlmoeForCausalLM", dict(num_experts=E, num_experts_per_tok=K),
              "model.layers.0.mlp.experts", ("up_proj", "gate_proj", "down_proj")),
}


@pytest.mark.parametrize("name", sorted(TINY))
def test_missing_expert_names_key_and_slice(name, tmp_path):
    arch, overrides, experts, (up, _, _) = TINY[name]
    path = _edit(save_tiny(arch, tmp_path, **overrides), lambda t: t.pop(f"{experts}.3.{up}.weight"))
    text = _load_error(path)
    assert f"{experts}.3.{up}.weight" in text, text
    # the destination: expert 3's up rows (I..2I) of the stacked gate_up parameter
    assert "model.layers.0.mlp.experts.gate_up_proj.weight[3, rows 96:192]" in text, text
    assert "experts.2." not in text and ".gate_proj" not in text.replace("gate_up_proj", ""), text


def test_duplicated_expert_names_both_keys(tmp_path):
    """One expert's gate written twice, by the hub spelling and by the renamed spelling."""
    arch, overrides, experts, _ = TINY["mixtral"]
    dup = "model.layers.0.mlp.experts.2.gate_proj.weight"
    path = _edit(save_tiny(arch, tmp_path, **overrides),
                 lambda t: t.__setitem__(dup, t[f"{experts}.2.w1.weight"].clone()))
    text = _load_error(path)
    assert "duplicate" in text and dup in text and f"{experts}.2.w1.weight" in text, text
    assert "model.layers.0.mlp.experts.gate_up_proj.weight[2, rows 0:96]" in text, text


@pytest.mark.parametrize("name", sorted(TINY))
def test_wrong_shaped_expert_names_key_and_shape(name, tmp_path):
    arch, overrides, experts, (_, _, down) = TINY[name]
    key = f"{experts}.1.{down}.weight"
    path = _edit(save_tiny(arch, tmp_path, **overrides), lambda t: t.__setitem__(key, t[key][:, :-1].clone()))
    text = _load_error(path)
    assert key in text and "[64, 95]" in text and "model.layers.0.mlp.experts.down_proj.weight[1]" in text, text


def test_expert_beyond_num_experts_is_an_error(tmp_path):
    arch, overrides, experts, (up, gate, down) = TINY["olmoe"]

    def add_expert_4(t):
        for part in (up, gate, down):
            t[f"{experts}.4.{part}.weight"] = t[f"{experts}.0.{part}.weight"].clone()

    text = _load_error(_edit(save_tiny(arch, tmp_path, **overrides), add_expert_4))
    assert f"{experts}.4.{up}.weight" in text and "expert 4" in text, text


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_bfloat16_device_path_runs_close_to_transformers_bfloat16(name, tmp_path):
    """On the device path (CUDA's code, forced on the CPU) a bf16 build computes in bf16 and runs through the cache
    near transformers' own bf16 run (the dtype plumbing works: Mixtral combines with float32 weights, Qwen2-MoE
    with weights rounded to bf16). The CPU path's bfloat16 (float32 activations) is tests/test_bf16.py's."""
    arch, overrides = CASES[name]
    path = save_tiny(arch, tmp_path, initializer_range=0.2, **overrides)
    before = kernels.set_device_path(True)
    try:
        model, *_ = build_model(path, dtype=torch.bfloat16)
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        gate = next(m for n, m in model.named_modules() if n.endswith("mlp.gate"))
        [tokens] = random_prompts([10], vocab=128, seed=7)
        weights = []
        hook = gate.register_forward_hook(lambda m, i, o: weights.append(o[1]))
        got = run_step(model, [(tokens, 0)], allocate_kv(model)).float()
        hook.remove()
    finally:
        kernels.set_device_path(before)
    assert weights[0].dtype == (torch.float32 if name == "mixtral" else torch.bfloat16)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager")
    with torch.no_grad():
        want = ref(torch.tensor([tokens])).logits[0].float()
    assert (got - want).abs().max() < 0.05 * want.abs().max(), f"{name}: bf16 logits far from transformers' bf16"
