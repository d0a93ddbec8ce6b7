"""Tensor parallelism, loader side: every rank reads only its slice of each checkpoint tensor, the dry run
proves the ranks' union covers every element exactly once, and a checkpoint lacking a rank's slice is refused.

The expected slices are written out by hand here (heads, rows, cols) and cut from the files with safetensors
itself, independently of loader/shard.py.
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

import importlib

from loader import LoadError, load
from loader.plan import plan_ranks
from loader.shard import Parallel
from registry import get_registry
from tiny import save_tiny
from zoo.build import tensor_parallel_model
from zoo.cli import main
from zoo.runtime.model_files import read_config

D = 16  # head dim of every case: hidden 64 / 4 query heads


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    out = {f"llama-kv{kv}": save_tiny("LlamaForCausalLM", root / f"llama-kv{kv}", num_key_value_heads=kv)
           for kv in (1, 2, 4)}
    out["qwen2-bias"] = save_tiny("Qwen2ForCausalLM", root / "qwen2", randomize=True)  # q/k/v biases
    out["qwen3-qk-norms"] = save_tiny("Qwen3ForCausalLM", root / "qwen3", num_key_value_heads=1, head_dim=16,
                                      randomize=True)  # per-head q/k norms, shared by the heads: replicated
    out["tied-odd-vocab"] = save_tiny("LlamaForCausalLM", root / "tied", vocab_size=131, tie_word_embeddings=True)
    return out


def _model(path, size):
    config = read_config(str(path), str(path))
    return (*tensor_parallel_model(get_registry().resolve(config), config, size), config)


def _expected(full: dict, config, rank: int, n: int) -> dict[str, torch.Tensor]:
    """The rank-local parameters, cut by hand from the full tensors."""
    hq, kv, inter, vocab = 4, config.num_key_value_heads, config.intermediate_size, config.vocab_size
    rows = lambda t, a, b: t[a:b]
    kv_heads = list(range(rank * kv // n, (rank + 1) * kv // n)) if kv >= n else [rank // (n // kv)]
    out = {}
    for i in range(config.num_hidden_layers):
        a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        q_rows = (rank * hq // n * D, (rank + 1) * hq // n * D)
        k_rows = (kv_heads[0] * D, (kv_heads[-1] + 1) * D)
        for leaf in ("weight", "bias"):
            if f"{a}.q_proj.{leaf}" in full:
                out[f"{a}.qkv_proj.{leaf}"] = torch.cat([rows(full[f"{a}.q_proj.{leaf}"], *q_rows),
                                                         rows(full[f"{a}.k_proj.{leaf}"], *k_rows),
                                                         rows(full[f"{a}.v_proj.{leaf}"], *k_rows)])
        out[f"{a}.o_proj.weight"] = full[f"{a}.o_proj.weight"][:, q_rows[0]:q_rows[1]]
        i_part = (rank * inter // n, (rank + 1) * inter // n)
        out[f"{m}.gate_up_proj.weight"] = torch.cat([rows(full[f"{m}.gate_proj.weight"], *i_part),
                                                     rows(full[f"{m}.up_proj.weight"], *i_part)])
        out[f"{m}.down_proj.weight"] = full[f"{m}.down_proj.weight"][:, i_part[0]:i_part[1]]
        for norm in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
            if f"model.layers.{i}.{norm}.weight" in full:
                out[f"model.layers.{i}.{norm}.weight"] = full[f"model.layers.{i}.{norm}.weight"]
    local = -(-vocab // 64) * 64 // n
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        src = full.get(name, full["model.embed_tokens.weight"])
        part = torch.zeros(local, src.shape[1])
        held = src[rank * local:(rank + 1) * local]
        part[:len(held)] = held
        out[name] = part
    out["model.norm.weight"] = full["model.norm.weight"]
    return out


@pytest.mark.parametrize("name", ["llama-kv1", "llama-kv2", "llama-kv4", "qwen2-bias", "qwen3-qk-norms",
                                  "tied-odd-vocab"])
@pytest.mark.parametrize("n", [2, 4])
def test_each_rank_loads_exactly_its_slice(cases, name, n):
    path = cases[name]
    full = load_file(path / "model.safetensors")
    model, rules, config = _model(path, n)
    rp = plan_ranks(model, path, rules, n)
    assert rp.ok, rp.problems
    for rank in range(n):
        with torch.device("meta"):
            local, _, _ = _model(path, n)
        report = load(local, path, rules, tp=Parallel(rank, n))
        expected = _expected(full, config, rank, n)
        params = dict(local.named_parameters(remove_duplicate=False))
        assert set(params) == set(expected)
        for pname, want in expected.items():
            assert torch.equal(params[pname].detach(), want), f"rank {rank} of {n}: {pname}"
        assert report.bytes == rp.bytes(rank)  # the dry run's bytes are what the load reads
        assert report.tensors == len({e.key for e in rp.plans[rank].entries})
    if config.tie_word_embeddings:
        assert local.lm_head.weight is local.model.embed_tokens.weight


def test_column_parallel_reads_one_nth(cases):
    """Bytes per rank: the column-parallel q/gate/up weights are read 1/N each; replicated norms whole."""
    path = cases["llama-kv4"]
    model, rules, _ = _model(path, 2)
    rp = plan_ranks(model, path, rules, 2)
    full = load_file(path / "model.safetensors")
    total = sum(t.numel() * t.element_size() for t in full.values())
    norms = sum(t.numel() * 4 for k, t in full.items() if "norm" in k)
    for rank in range(2):
        assert rp.bytes(rank) == (total - norms) // 2 + norms  # kv 4 over 2 ranks: nothing replicated but norms
        q = [e for e in rp.plans[rank].entries if e.key == "model.layers.0.self_attn.q_proj.weight"][0]
        assert q.slice.start == rank * 32 and q.nbytes() == 32 * 64 * 4


def test_kv_replication_shares_heads_and_the_union_counts_them(cases):
    path = cases["llama-kv1"]
    model, rules, _ = _model(path, 4)
    rp = plan_ranks(model, path, rules, 4)
    assert rp.ok
    k = [[e for e in p.entries if e.key == "model.layers.1.self_attn.k_proj.weight"][0].slice for p in rp.plans]
    assert [(s.start, s.stop, s.copies) for s in k] == [(0, 16, 4)] * 4  # the one KV head on every rank


def test_union_proof_catches_every_rank_reading_shard_zero(cases, monkeypatch):
    """The trap of vllm-gguf-plugin #103: each rank narrowing shard 0. Every rank's own plan is clean; only the
    union shows it."""
    path = cases["llama-kv2"]
    model, rules, _ = _model(path, 2)
    planning = importlib.import_module("loader.plan")  # (the module; `loader.plan` is also the function)
    real = planning.slice_of
    monkeypatch.setattr(planning, "slice_of", lambda shard, full, tp: real(shard, full, Parallel(0, tp.size)))
    rp = plan_ranks(model, path, rules, 2)
    assert all(p.ok for p in rp.plans)
    text = "\n".join(map(str, rp.problems))
    assert "model.layers.0.self_attn.q_proj.weight in model.safetensors: [0:32, 0:64] is read by ranks [0, 1], " \
           "expected 1 of them" in text
    assert "model.layers.0.self_attn.q_proj.weight in model.safetensors: 2048 of 4096 elements are read by no " \
           "rank of 2" in text


def test_checkpoint_missing_a_ranks_slice_is_refused(cases, tmp_path, capsys):
    """A q_proj that holds only rank 0's rows: refused, naming the rank, the key and the range it lacks."""
    src = cases["llama-kv2"]
    tensors = load_file(src / "model.safetensors")
    key = "model.layers.1.self_attn.q_proj.weight"
    tensors[key] = tensors[key][:32].clone()
    bad = tmp_path / "half"
    bad.mkdir()
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    (bad / "config.json").write_text((src / "config.json").read_text())
    model, rules, _ = _model(bad, 2)
    rp = plan_ranks(model, bad, rules, 2)
    text = "\n".join(map(str, rp.problems))
    assert ("shape: rank 1 of 2: model.layers.1.self_attn.q_proj.weight in model.safetensors has shape [32, 64] "
            "but model.layers.1.self_attn.qkv_proj.weight[rows 0:32] expects [64, 64]: rank 1's slice, rows 32:64, "
            "is not in the checkpoint") in text
    with torch.device("meta"):
        local, _, _ = _model(bad, 2)
    with pytest.raises(LoadError, match="rank 1 of 2: model.layers.1.self_attn.q_proj.weight .* rows 32:64"):
        load(local, bad, rules, tp=Parallel(1, 2))
    assert main(["inspect", str(bad), "--tensor-parallel-size", "2"]) == 1
    assert "rank 1's slice, rows 32:64, is not in the checkpoint" in capsys.readouterr().out


def test_inspect_tensor_parallel_dry_run(cases, capsys):
    assert main(["inspect", str(cases["tied-odd-vocab"]), "--tensor-parallel-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "tensor parallel size 4" in out
    assert out.rstrip().endswith("ok: the 4 ranks' slices cover every element of every checkpoint tensor exactly "
                                 "once (replicated tensors and KV heads by exactly the ranks that share them)")
    rows = [line.split() for line in out.splitlines() if line[:1].isdigit()]
    assert [r[0] for r in rows] == ["0", "1", "2", "3"]
    assert rows[3][1] == "19"  # vocab 131 padded to 192: rank 3's rows 144:192 are all padding, its embedding unread


def test_unsplittable_config_is_named(cases, capsys):
    assert main(["inspect", str(cases["llama-kv2"]), "--tensor-parallel-size", "3"]) == 2
    assert "config.num_attention_heads=4 does not split over tensor parallel size 3" in capsys.readouterr().out


@pytest.fixture(scope="module")
def moe_cases(tmp_path_factory):
    from tiny_configs import save_arch

    root = tmp_path_factory.mktemp("tp-moe")
    return {arch: save_arch(arch, root / arch) for arch in
            ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")}


def _part(n: int, rank: int, size: int) -> slice:
    return slice(rank * n // size, (rank + 1) * n // size)


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "Qwen2MoeForCausalLM", "DeepseekV2ForCausalLM",
                                  "DeepseekV3ForCausalLM"])
def test_moe_and_mla_ranks_load_their_expert_and_head_slices(moe_cases, arch):
    """Per-expert keys: gate/up rows and down cols of each expert's intermediate part; a shared expert split the
    same way; the router (and V3's correction bias) whole. MLA: q_b_proj / kv_b_proj rows of the rank's heads,
    o_proj its cols, the latent projection and its norm whole. Cut by hand from the files."""
    path = moe_cases[arch]
    full = load_file(path / "model.safetensors")
    n = 2
    model, rules, config = _model(path, n)
    rp = plan_ranks(model, path, rules, n)
    assert rp.ok, rp.problems
    mla = arch.startswith("Deepseek")
    w1, w3, w2 = ("w1", "w3", "w2") if arch == "MixtralForCausalLM" else ("gate_proj", "up_proj", "down_proj")
    moe = "block_sparse_moe" if arch == "MixtralForCausalLM" else "mlp"
    layer = 1  # sparse in every case (Qwen2-MoE: decoder_sparse_step 2; DeepSeek: first_k_dense_replace 1)
    for rank in range(n):
        with torch.device("meta"):
            local, _, _ = _model(path, n)
        report = load(local, path, rules, tp=Parallel(rank, n))
        assert report.bytes == rp.bytes(rank) and report.tp == Parallel(rank, n)
        params = dict(local.named_parameters())
        pre, mp = f"model.layers.{layer}", f"model.layers.{layer}.mlp"
        e = 3
        k = lambda leaf: full[f"{pre}.{moe}.experts.{e}.{leaf}.weight"]
        inter = k(w1).shape[0]
        mine = _part(inter, rank, n)
        assert torch.equal(params[f"{mp}.experts.gate_up_proj.weight"][e], torch.cat([k(w1)[mine], k(w3)[mine]]))
        assert torch.equal(params[f"{mp}.experts.down_proj.weight"][e], k(w2)[:, mine])
        assert torch.equal(params[f"{mp}.gate.weight"], full[f"{pre}.{moe}.gate.weight"])  # the router, whole
        shared = {"Qwen2MoeForCausalLM": "shared_expert"}.get(arch, "shared_experts" if mla else None)
        if shared:
            g, u, d = (full[f"{mp}.{shared}.{x}.weight"] for x in ("gate_proj", "up_proj", "down_proj"))
            s = _part(g.shape[0], rank, n)
            assert torch.equal(params[f"{mp}.{shared}.gate_up_proj.weight"], torch.cat([g[s], u[s]]))
            assert torch.equal(params[f"{mp}.{shared}.down_proj.weight"], d[:, s])
        if arch == "DeepseekV3ForCausalLM":
            assert torch.equal(params[f"{mp}.gate.e_score_correction_bias"], full[f"{mp}.gate.e_score_correction_bias"])
        if mla:
            a = f"{pre}.self_attn"
            heads = _part(config.num_attention_heads, rank, n)
            per_head = lambda t, d: t.view(config.num_attention_heads, d, *t.shape[1:])[heads].flatten(0, 1)
            qk = config.qk_nope_head_dim + config.qk_rope_head_dim
            assert torch.equal(params[f"{a}.q_b_proj.weight"], per_head(full[f"{a}.q_b_proj.weight"], qk))
            assert torch.equal(params[f"{a}.kv_b_proj.weight"],
                               per_head(full[f"{a}.kv_b_proj.weight"], config.qk_nope_head_dim + config.v_head_dim))
            o = full[f"{a}.o_proj.weight"]
            assert torch.equal(params[f"{a}.o_proj.weight"], o[:, _part(o.shape[1], rank, n)])
            for whole in ("kv_a_proj_with_mqa", "kv_a_layernorm", "q_a_proj", "q_a_layernorm"):
                assert torch.equal(params[f"{a}.{whole}.weight"], full[f"{a}.{whole}.weight"])  # the latent


def test_checkpoint_missing_a_ranks_expert_slice_is_refused(moe_cases, tmp_path):
    src = moe_cases["MixtralForCausalLM"]
    tensors = load_file(src / "model.safetensors")
    key = "model.layers.0.block_sparse_moe.experts.2.w2.weight"  # row-parallel: rank 1 reads cols 48:96
    tensors[key] = tensors[key][:, :48].clone()
    bad = tmp_path / "half-expert"
    bad.mkdir()
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    (bad / "config.json").write_text((src / "config.json").read_text())
    model, rules, _ = _model(bad, 2)
    text = "\n".join(map(str, plan_ranks(model, bad, rules, 2).problems))
    assert (f"rank 1 of 2: {key} in model.safetensors has shape [64, 48] but "
            f"model.layers.0.mlp.experts.down_proj.weight[2] expects [64, 96]: rank 1's slice, cols 48:96, is not in "
            f"the checkpoint") in text


# issue 36's Shard kinds, each case cut by hand from the files for rank r of 2 (layer 0): what the named rank-local
# parameters must hold. KV 1 where KV heads are involved, so that both ranks hold the one KV head.
def _fused(t: torch.Tensor, sizes: list[int], pick, dim: int = 0) -> torch.Tensor:
    """The parts of `t` along `dim` (`sizes` of the full tensor), each cut by pick(part index, part), concatenated."""
    return torch.cat([pick(i, p) for i, p in enumerate(t.split(sizes, dim=dim))], dim=dim)


def _half(t: torch.Tensor, r: int, dim: int = 0) -> torch.Tensor:
    return t.chunk(2, dim=dim)[r]


NEW_KINDS = {
    # Shard "fused": qkv_proj's q rows by heads, k / v rows (one KV head) on both ranks; gate_up_proj's halves
    "Phi3ForCausalLM": (dict(num_key_value_heads=1), lambda f, r, a, m: {
        f"{a}.qkv_proj.weight": _fused(f[f"{a}.qkv_proj.weight"], [64, 16, 16],
                                       lambda i, p: _half(p, r) if i == 0 else p),
        f"{m}.gate_up_proj.weight": _fused(f[f"{m}.gate_up_proj.weight"], [96, 96], lambda i, p: _half(p, r))}),
    # a transposed (Conv1D [in, out]) key: column-parallel on its cols, row-parallel on its rows; c_attn "fused"
    "GPT2LMHeadModel": ({}, lambda f, r, a, m: {
        f"{a}.qkv_proj.weight": _fused(f["transformer.h.0.attn.c_attn.weight"], [64] * 3,
                                       lambda i, p: _half(p, r, 1), dim=1).t(),
        f"{a}.qkv_proj.bias": _fused(f["transformer.h.0.attn.c_attn.bias"], [64] * 3, lambda i, p: _half(p, r)),
        f"{a}.o_proj.weight": _half(f["transformer.h.0.attn.c_proj.weight"], r).t(),
        f"{a}.o_proj.bias": f["transformer.h.0.attn.c_proj.bias"],
        f"{m}.c_fc.weight": _half(f["transformer.h.0.mlp.c_fc.weight"], r, 1).t(),
        f"{m}.c_fc.bias": _half(f["transformer.h.0.mlp.c_fc.bias"], r),
        f"{m}.c_proj.weight": _half(f["transformer.h.0.mlp.c_proj.weight"], r).t()}),
    # heads interleaved [heads, (q, k, v), D]: a rank's 2 heads, rearranged to [(q, k, v), heads, D]
    "GPTNeoXForCausalLM": ({}, lambda f, r, a, m: {
        f"{a}.qkv_proj.weight": f["gpt_neox.layers.0.attention.query_key_value.weight"]
        .view(4, 3, 16, 64)[2 * r:2 * r + 2].transpose(0, 1).reshape(96, 64)}),
    # a stack Shard: the keys norms.{h} of the rank's query heads; the one KV head's on both ranks
    "StableLmForCausalLM": (dict(num_key_value_heads=1), lambda f, r, a, m: {
        f"{a}.q_layernorm.norms.weight": torch.stack([f[f"{a}.q_layernorm.norms.{h}.weight"]
                                                      for h in (2 * r, 2 * r + 1)]),
        f"{a}.k_layernorm.norms.weight": f[f"{a}.k_layernorm.norms.0.weight"][None]}),
    # checkpoint-stacked experts: input_linear [E, 2I, H] "fused" on dim 1, output_linear [E, H, I] by dim 2
    "GraniteMoeForCausalLM": ({}, lambda f, r, a, m: {
        f"{m}.experts.gate_up_proj.weight": _fused(f["model.layers.0.block_sparse_moe.input_linear.weight"], [96, 96],
                                                   lambda i, p: _half(p, r, 1), dim=1),
        f"{m}.experts.down_proj.weight": _half(f["model.layers.0.block_sparse_moe.output_linear.weight"], r, 2)}),
    # [E, in, out] experts by another dim than the kind's, down_proj_bias "once" (rank 0; zeros on rank 1), sinks
    "GptOssForCausalLM": (dict(num_key_value_heads=1), lambda f, r, a, m: {
        f"{m}.experts.gate_up_proj": _half(f[f"{m}.experts.gate_up_proj"], r, 2),
        f"{m}.experts.gate_up_proj_bias": _half(f[f"{m}.experts.gate_up_proj_bias"], r, 1),
        f"{m}.experts.down_proj": _half(f[f"{m}.experts.down_proj"], r, 1),
        f"{m}.experts.down_proj_bias": f[f"{m}.experts.down_proj_bias"] * (r == 0),
        f"{m}.router.bias": f[f"{m}.router.bias"], f"{a}.sinks": _half(f[f"{a}.sinks"], r)}),
    # whole-width q / k norms split with the heads; Cohere's per-head rows likewise
    "Olmo2ForCausalLM": ({}, lambda f, r, a, m: {f"{a}.q_norm.weight": _half(f[f"{a}.q_norm.weight"], r),
                                                 f"{a}.k_norm.weight": _half(f[f"{a}.k_norm.weight"], r)}),
    "CohereForCausalLM": ({}, lambda f, r, a, m: {f"{a}.q_norm.weight": _half(f[f"{a}.q_norm.weight"], r),
                                                  f"{a}.k_norm.weight": _half(f[f"{a}.k_norm.weight"], r)}),
}


@pytest.mark.parametrize("arch", list(NEW_KINDS))
def test_new_shard_kinds_load_the_slices_cut_by_hand(arch, tmp_path):
    from tiny import save_tiny
    from tiny_configs import TINY_CONFIGS, WIDE

    overrides, cut = NEW_KINDS[arch]
    path = save_tiny(arch, tmp_path / arch, randomize=True, **{**WIDE, **TINY_CONFIGS[arch], **overrides})
    full = load_file(path / "model.safetensors")
    model, rules, _ = _model(path, 2)
    rp = plan_ranks(model, path, rules, 2)
    assert rp.ok, rp.problems
    for rank in range(2):
        with torch.device("meta"):
            local, _, _ = _model(path, 2)
        report = load(local, path, rules, tp=Parallel(rank, 2))
        assert report.bytes == rp.bytes(rank)
        params = dict(local.named_parameters())
        for name, want in cut(full, rank, "model.layers.0.self_attn", "model.layers.0.mlp").items():
            assert torch.equal(params[name].detach(), want), f"{arch} rank {rank}: {name}"


def test_shard_rules_that_cannot_apply_are_named(tmp_path):
    """A Shard that cannot describe a split is refused when it is made; one that does not fit its key is a problem
    naming the key, the parameter and why."""
    from loader.rules import Rules, Shard
    from tiny import save_tiny

    with pytest.raises(ValueError, match="a 'fused' shard, and only it, has parts"):
        Shard(r"\.qkv_proj\.weight$", "fused")
    with pytest.raises(ValueError, match="'kv' shard needs heads > 0"):
        Shard(r"\.qkv_proj\.weight$", "fused", parts=("column", "kv", "kv"))
    with pytest.raises(ValueError, match="a stack shard splits by 'column' or 'kv', not 'row'"):
        Shard(r"\.norms\.\d+\.weight$", "row", stack=True)
    path = save_tiny("GPTNeoXForCausalLM", tmp_path / "neox")
    model, rules, _ = _model(path, 2)
    wrong = Rules(shards=(Shard(r"\.query_key_value\.weight$", "row"), Shard(r"\.dense_h_to_4h\.weight$", "column",
                                                                             stack=True))) + rules
    text = "\n".join(map(str, plan_ranks(model, path, wrong, 2).problems))
    assert ("gpt_neox.layers.0.attention.query_key_value.weight in model.safetensors -> "
            "model.layers.0.self_attn.qkv_proj.weight: a key held in another layout (interleave) cannot be "
            "row-parallel on dim 1") in text
    assert ("gpt_neox.layers.0.mlp.dense_h_to_4h.weight in model.safetensors -> "
            "model.layers.0.mlp.dense_h_to_4h.weight: a stack shard needs a key that a Stack rule maps to a row of its "
            "parameter") in text


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "OlmoeForCausalLM"])
def test_experts_saved_fused_by_transformers_v5_split_by_intermediate_size(arch, tmp_path):
    """save_pretrained(save_original_format=False) stacks and fuses the experts: experts.gate_up_proj [E, 2I, H]
    (gate | up), experts.down_proj [E, H, I]. Each rank reads its part of the gate half and of the up half, and its
    cols of down_proj; cut by hand."""
    import transformers

    from tiny import tiny_config
    from tiny_configs import TINY_CONFIGS

    torch.manual_seed(0)
    ref = getattr(transformers, arch)(tiny_config(arch, **TINY_CONFIGS[arch]))
    ref.save_pretrained(tmp_path / arch, save_original_format=False)
    path = tmp_path / arch
    full = load_file(path / "model.safetensors")
    gate_up, down = full["model.layers.0.mlp.experts.gate_up_proj"], full["model.layers.0.mlp.experts.down_proj"]
    model, rules, _ = _model(path, 2)
    assert plan_ranks(model, path, rules, 2).ok
    inter = down.shape[2]
    for rank in range(2):
        with torch.device("meta"):
            local, _, _ = _model(path, 2)
        load(local, path, rules, tp=Parallel(rank, 2))
        params = dict(local.named_parameters())
        mine = _part(inter, rank, 2)
        assert torch.equal(params["model.layers.0.mlp.experts.gate_up_proj.weight"],
                           torch.cat([gate_up[:, :inter][:, mine], gate_up[:, inter:][:, mine]], dim=1))
        assert torch.equal(params["model.layers.0.mlp.experts.down_proj.weight"], down[:, :, mine])
