"""Latent attention and the DeepSeek-V2/V3 models: routers against transformers', then tiny V2/V3
checkpoints written by transformers and read back through build_model and the loader."""
from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
import transformers
from batching import allocate_kv, make_batch, run_step
from kernel_paths import ops  # noqa: F401
from safetensors import safe_open
from safetensors.torch import save_file
from tiny import load_reference, tiny_config
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from zoo.build import build_model
from zoo.layers.deepseek_moe import GroupLimitedRouter
from zoo.layers.mla import MLAttention
from zoo.runtime.kv_cache import bytes_per_token, cache_specs, num_blocks_for

V2, V3 = "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64, mscale=1.0,
            mscale_all_dim=0.8, beta_fast=32, beta_slow=1)
COMMON = dict(num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, n_group=4,
              moe_intermediate_size=32,
              kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10, num_key_value_heads=4,
              initializer_range=0.2)  # weights large enough that a wrong term shows in the logits
CASES = {
    "v2": dict(arch=V2, q_lora_rank=24, topk_method="group_limited_greedy", topk_group=1,
               num_experts_per_tok=2),
    "v2_no_q_lora_yarn_tied": dict(arch=V2, q_lora_rank=None, topk_method="greedy", num_experts_per_tok=2,
                                   rope_parameters=YARN, tie_word_embeddings=True, n_shared_experts=1),
    "v3": dict(arch=V3, q_lora_rank=24, topk_group=2, num_experts_per_tok=3, norm_topk_prob=True),
    "v3_yarn_halves": dict(arch=V3, q_lora_rank=24, topk_group=2, num_experts_per_tok=2, norm_topk_prob=False,
                           rope_interleave=False, rope_parameters=YARN, routed_scaling_factor=1.5),
}
TOL = 1e-4  # float32, logits of magnitude ~5


def save_deepseek(arch: str, path, **overrides):
    """save_tiny, with V3's e_score_correction_bias made nonzero (transformers initialises it to zeros)."""
    config = tiny_config(arch, **{**COMMON, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config).eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(std=0.1)
    model.save_pretrained(path)
    return path


_MODELS: dict = {}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(name, checkpoint path, transformers reference, our model) per case, built once per module."""
    name = request.param
    if name not in _MODELS:
        kw = dict(CASES[name])
        path = save_deepseek(kw.pop("arch"), tmp_path_factory.mktemp(name), **kw)
        model, config, spec, report = build_model(path)
        assert spec.family == "mla" and type(model).__name__ == config.architectures[0]
        _MODELS[name] = (name, path, load_reference(path), model)
    return _MODELS[name]


def ref_logits(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0]  # [S, V]


def mla_layers(model) -> list[MLAttention]:
    return [m for m in model.modules() if isinstance(m, MLAttention)]


def set_mode(model, mode: str) -> None:
    for m in mla_layers(model):
        m.mode = mode
        m.path_counts.clear()


def path_counts(model) -> dict[str, int]:
    total: dict[str, int] = {}
    for m in mla_layers(model):
        for k, v in m.path_counts.items():
            total[k] = total.get(k, 0) + v
    return total


def prompts(lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in lengths]


def assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str, tol: float = TOL) -> None:
    err = (ours.double() - ref.double()).abs().max().item()
    assert err <= tol, f"{what}: max |zoo - transformers| = {err:.3g} > {tol} (|ref| max {ref.abs().max():.3g})"


# -- routing alone ----------------------------------------------------------------------------------------

ROUTERS = {
    "v2_greedy": (V2, DeepseekV2TopkRouter,
                  dict(topk_method="greedy", num_experts_per_tok=3, routed_scaling_factor=1.7)),
    "v2_group": (V2, DeepseekV2TopkRouter,
                 dict(topk_method="group_limited_greedy", topk_group=2, num_experts_per_tok=3)),
    "v3_norm": (V3, DeepseekV3TopkRouter, dict(topk_group=2, num_experts_per_tok=3, norm_topk_prob=True)),
    "v3_no_norm": (V3, DeepseekV3TopkRouter, dict(topk_group=1, num_experts_per_tok=2, norm_topk_prob=False)),
}


@pytest.mark.parametrize("name", list(ROUTERS))
def test_router_matches_transformers(name):
    arch, ref_cls, kw = ROUTERS[name]
    config = tiny_config(arch, **{**COMMON, **kw})
    torch.manual_seed(1)
    ref = ref_cls(config)
    with torch.no_grad():
        ref.weight.normal_()
        if hasattr(ref, "e_score_correction_bias"):
            ref.e_score_correction_bias.normal_(std=0.3)
    method = "noaux_tc" if arch == V3 else config.topk_method
    ours = GroupLimitedRouter(config.hidden_size, config.n_routed_experts, config.num_experts_per_tok,
                              topk_method=method, n_group=config.n_group, topk_group=config.topk_group,
                              norm_topk_prob=bool(config.norm_topk_prob) and arch == V3,
                              routed_scaling_factor=config.routed_scaling_factor, prefix="mlp.gate")
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(200, config.hidden_size)
    r_logits, r_w, r_ids = ref(x)
    o_logits, o_w, o_ids = ours(x)
    torch.testing.assert_close(o_logits, r_logits)
    r_ids, r_order = r_ids.sort(-1)
    o_ids, o_order = o_ids.sort(-1)
    differ = int((o_ids != r_ids).any(-1).sum())
    assert differ == 0, f"{name}: chosen experts differ for {differ} tokens"
    torch.testing.assert_close(o_w.gather(1, o_order), r_w.gather(1, r_order))
    if method != "greedy":  # the groups must change some token's choice, or they were not tested
        choice = r_logits.sigmoid() + ref.e_score_correction_bias if arch == V3 else r_logits.softmax(-1)
        plain = torch.topk(choice, config.num_experts_per_tok).indices.sort(-1).values
        assert (plain != r_ids).any(), f"{name}: group limiting changed no token's experts"


# -- whole models from disk ---------------------------------------------------------------------------------

def test_prefill_matches_transformers(case):
    name, _, ref, model = case
    ids = prompts([13])[0]
    kv = allocate_kv(model, num_blocks=16, block_size=4)
    logits = run_step(model, [(ids, 0)], kv, blocks_per_seq=4, shuffle=True)  # [13, V]
    assert_close(logits, ref_logits(ref, ids), f"{name} prefill")


def test_ragged_batch_matches_transformers(case):
    """Three prompts in one step, one of them a single token (absorbed path), no cache at all."""
    name, _, ref, model = case
    seqs = prompts([9, 1, 14], seed=1)
    set_mode(model, "auto")
    logits = run_step(model, [(s, 0) for s in seqs], {})  # [24, V]
    want = torch.cat([ref_logits(ref, s) for s in seqs])
    assert_close(logits, want, f"{name} ragged batch")
    assert path_counts(model) == {"expand": 2 * 3, "absorbed": 1 * 3}


def schedule(seed: int = 2):
    """Teacher-forced steps over three requests: A and B prefill then decode; C prefills in two chunks
    (the second reads its first chunk back from the cache) while A and B decode, then decodes."""
    full = prompts([13, 16, 14], seed=seed)
    steps = [[(full[0][:7], 0), (full[1][:10], 0), (full[2][:5], 0)],
             [(full[0][:8], 7), (full[1][:11], 10), (full[2][:9], 5)]]
    for k in range(1, 6):
        steps.append([(full[0][:8 + k], 7 + k), (full[1][:11 + k], 10 + k), (full[2][:9 + k], 8 + k)])
    return full, steps


def run_schedule(model, steps, *, mode: str = "auto") -> list[torch.Tensor]:
    set_mode(model, mode)
    kv = allocate_kv(model, num_blocks=24, block_size=4)  # NaN-filled: a read of an unwritten slot shows
    return [run_step(model, step, kv, blocks_per_seq=8, shuffle=True) for step in steps]


def test_decode_steps_through_paged_cache_match_transformers(case):
    name, _, ref, model = case
    full, steps = schedule()
    outs = run_schedule(model, steps)
    want = [ref_logits(ref, s) for s in full]  # [S, V] per request
    for k, (step, got) in enumerate(zip(steps, outs)):
        rows = torch.cat([want[i][computed:len(tokens)] for i, (tokens, computed) in enumerate(step)])
        assert_close(got, rows, f"{name} step {k}")
    layers = len(mla_layers(model))
    # step 0: 3 prefills; step 1: 2 decodes + 1 chunk; steps 2..6: 3 decodes each
    assert path_counts(model) == {"expand": 4 * layers, "absorbed": 17 * layers}


def test_native_absorbed_decode_matches_transformers(case, ops, monkeypatch):
    """The decode schedule with the kernels on (every one-token request's absorbed attention in one
    kernels.mla_decode call per layer) and off (the torch einsums), each against transformers."""
    from zoo import kernels

    name, _, ref, model = case
    calls = []
    native = kernels.mla_decode
    monkeypatch.setattr(kernels, "mla_decode", lambda *a, **kw: (calls.append(len(a[5])), native(*a, **kw))[1])
    full, steps = schedule(seed=5)
    outs = run_schedule(model, steps)
    want = [ref_logits(ref, s) for s in full]
    for k, (step, got) in enumerate(zip(steps, outs)):
        rows = torch.cat([want[i][computed:len(tokens)] for i, (tokens, computed) in enumerate(step)])
        assert_close(got, rows, f"{name} step {k} ({ops})")
    layers = len(mla_layers(model))
    assert sum(calls) == (17 * layers if ops == "kernels" else 0), calls


@pytest.mark.parametrize("r", [16, 20])
def test_native_absorbed_decode_reads_bfloat16_widened(r):
    """kernels.mla_decode on a bfloat16 latent cache and kv_b_proj (zoo's bfloat16 storage) equals, to the bit, the
    float32 kernel on the same values widened: the same float32 arithmetic (latent widths with and without a tail
    past the 16 lanes)."""
    from zoo import kernels

    if not kernels.enabled():
        pytest.skip("native kernels are not built here")
    g = torch.Generator().manual_seed(r)
    nh, dn, dr, dv, bs = 4, 12, 8, 10, 4
    q_nope, q_rope = torch.randn(3, nh, dn, generator=g), torch.randn(3, nh, dr, generator=g)
    cache = torch.randn(12, bs, r + dr, generator=g).bfloat16()  # [NB, BS, R + DR]
    kv_b = torch.randn(nh * (dn + dv), r, generator=g).bfloat16()
    tables = torch.tensor([[3, 7, 1], [0, 11, 5], [2, 9, 4]], dtype=torch.int32)
    outs = []
    for c, w in ((cache, kv_b), (cache.float(), kv_b.float())):
        outs.append(torch.zeros(3, nh, dv))
        kernels.mla_decode(q_nope, q_rope, c, w, tables, [0, 1, 2], [0, 1, 2], [9, 1, 12], v_dim=dv, scale=0.3,
                           out=outs[-1])
    assert outs[0].abs().sum() > 0 and torch.equal(outs[0], outs[1])


def test_expanded_and_absorbed_paths_agree(case):
    name, _, _, model = case
    _, steps = schedule(seed=3)
    expand = run_schedule(model, steps, mode="expand")
    absorbed = run_schedule(model, steps, mode="absorbed")
    set_mode(model, "auto")
    for k, (a, b) in enumerate(zip(expand, absorbed)):
        assert_close(b, a, f"{name} step {k}: absorbed vs expanded", tol=2e-5)


def test_greedy_generation_matches_transformers(case):
    """32 greedy tokens through the runtime (scheduler, block pool, sampler) vs transformers' argmax."""
    from zoo import LLM, LLMEngine, SamplingParams

    name, _, ref, model = case
    engine = LLMEngine(model, model.config, None, num_blocks=32, block_size=4)
    llm = LLM.from_engine(engine)
    seqs = prompts([6, 11], seed=4)
    set_mode(model, "auto")
    outs = llm.generate(seqs, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert path_counts(model).get("absorbed", 0) > 0
    for seq, out in zip(seqs, outs):
        ids = list(seq)
        with torch.no_grad():
            for _ in range(32):
                ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
        assert out.token_ids == ids[len(seq):], f"{name}: greedy tokens differ from transformers"


def test_kv_cache_bytes_per_token(case):
    """The pool holds the latent and the rope key per token and layer, not K and V per head."""
    name, path, _, model = case
    config = model.config
    row = config.kv_lora_rank + config.qk_rope_head_dim
    specs = cache_specs(model)
    assert list(specs) == [f"model.layers.{i}.self_attn" for i in range(config.num_hidden_layers)]
    assert all(s.per_token == (row,) for s in specs.values())
    assert bytes_per_token(specs) == config.num_hidden_layers * row * 4
    bf16, *_ = build_model(path, dtype=torch.bfloat16)
    assert bytes_per_token(cache_specs(bf16)) == config.num_hidden_layers * row * 2
    per_head_kv = 2 * config.num_attention_heads * (config.qk_nope_head_dim + config.qk_rope_head_dim)
    assert row < per_head_kv  # what MLA saves: 24 vs 160 elements per token and layer here

    from zoo import LLMEngine

    budget, block_size = 1 << 20, 16
    engine = LLMEngine(model, config, None, kv_cache_memory=budget, block_size=block_size, max_num_seqs=1024)
    blocks = budget // (block_size * config.num_hidden_layers * row * 4)
    assert num_blocks_for(specs, block_size, budget) == blocks
    assert engine.kv.pool.num_blocks == blocks
    assert engine.kv_bytes_per_token == config.num_hidden_layers * row * 4
    assert all(t.shape == (blocks, block_size, row) for t in engine.runner.kv_caches.values())


def test_v3_rules_ignore_the_mtp_layer(tmp_path):
    """DeepSeek-V3 checkpoints carry a multi-token-prediction layer (model.layers.61.*): ignored, with a
    reason."""
    src = save_deepseek(V3, tmp_path / "v3", q_lora_rank=24, topk_group=2, num_experts_per_tok=2)
    save_file({"model.layers.61.eh_proj.weight": torch.zeros(64, 128)}, src / "mtp.safetensors")
    index = {"metadata": {}, "weight_map": {}}
    for f in ("model.safetensors", "mtp.safetensors"):
        with safe_open(src / f, "pt") as h:
            index["weight_map"].update({k: f for k in h.keys()})
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    _, _, _, report = build_model(src)
    ignored = {key: reason for key, _, reason in report.ignored}
    assert list(ignored) == ["model.layers.61.eh_proj.weight"], report.ignored
    assert "multi-token-prediction" in ignored["model.layers.61.eh_proj.weight"]


@pytest.mark.parametrize("name", list(CASES))
def test_parity_harness_passes_every_scenario_with_the_absorbed_decode(name, tmp_path, monkeypatch):
    """The release-day check on each tiny MLA checkpoint: every scenario of `zoo parity` passes, and the
    decode steps through the paged latent cache really took the absorbed path."""
    from parity import SCENARIOS
    from parity.harness import run_parity
    from zoo.layers.mla import MLAttention

    served = Counter()
    absorbed = MLAttention._absorbed_decode

    def counting(self, reqs, *args):
        served["absorbed"] += len(reqs)
        return absorbed(self, reqs, *args)

    monkeypatch.setattr(MLAttention, "_absorbed_decode", counting)  # a spy: the real path still runs
    case = dict(CASES[name])
    path = save_deepseek(case.pop("arch"), tmp_path, **case)
    result = run_parity(path)
    assert list(result.scenarios) == list(SCENARIOS)
    for scenario, s in result.scenarios.items():
        assert s.passed, f"{name} {scenario}: {s.failures} first divergence {s.first_divergence}"
    assert served["absorbed"] > 0
