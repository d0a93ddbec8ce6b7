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
