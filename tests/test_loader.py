"""The strict loader on real files: transformers' own Llama loaded with identity rules, every way a
checkpoint can be broken on disk, and fused / stacked / tied parameters in a small module of our own."""
from __future__ import annotations

import re
import shutil

import pytest
import torch
import transformers
from accelerate import init_empty_weights
from safetensors.torch import load_file, save_file
from torch import nn

from loader import Fuse, Ignore, LoadError, Rename, Rules, Stack, Tie, load, materialize, on_meta, open_source, plan
from tiny import load_reference, save_tiny

IDS = torch.tensor([[1, 5, 9, 3, 7, 11]])


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny("LlamaForCausalLM", tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture
def ckpt(tiny_dir, tmp_path):
    """A fresh copy of the tiny checkpoint, to break on disk."""
    return shutil.copytree(tiny_dir, tmp_path / "m")


def rewrite(path, change):
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def hf_meta(path, dtype=None):
    config = transformers.AutoConfig.from_pretrained(path, attn_implementation="eager")  # as load_reference
    with init_empty_weights():  # parameters on meta; transformers' rotary buffers stay real
        model = transformers.LlamaForCausalLM(config)
    model.tie_weights()  # (init_empty_weights re-creates Parameters on assignment, which undid the tie)
    return model.to(dtype) if dtype else model


def problems_of(excinfo) -> list[str]:
    return [str(p) for p in excinfo.value.problems]


# -- transformers' model, identity rules ------------------------------------------------------------------

@pytest.mark.parametrize("shard", [None, "20KB"])
@pytest.mark.parametrize("tied", [False, True])
def test_transformers_llama_same_logits(tmp_path, shard, tied):
    path = save_tiny("LlamaForCausalLM", tmp_path / "m", max_shard_size=shard, tie_word_embeddings=tied)
    model = hf_meta(path)
    report = load(model, path)
    assert report.tensors == len(open_source(path).keys())
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert [str(t) for t in report.ties] == (
        ["lm_head.weight tied to model.embed_tokens.weight (the checkpoint has no lm_head.weight)"] if tied else [])
    torch.testing.assert_close(model(IDS).logits, load_reference(path)(IDS).logits, rtol=0, atol=0)


def test_meta_module_with_meta_rotary_buffers_loads(tiny_dir):
    config = transformers.AutoConfig.from_pretrained(tiny_dir)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    load(model, tiny_dir)  # inv_freq is non-persistent: left to the model, not an error
    assert all(p.device.type == "cpu" for p in model.parameters())


@pytest.mark.parametrize("how", ["rebuild", "init_weights"])
def test_meta_rotary_buffers_reported_then_materialized(tiny_dir, how):
    """transformers' own Llama built wholly on meta: the load says which buffers it left there (the rotary
    inv_freq / original_inv_freq, non-persistent), the first forward fails on them, and materialize() computes
    them (from the module's constructor, or transformers' own _init_weights): logits equal from_pretrained's."""
    config = transformers.AutoConfig.from_pretrained(tiny_dir, attn_implementation="eager")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    report = load(model, tiny_dir)
    assert report.on_meta == ["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"]
    assert "left on meta" in str(report)
    with pytest.raises((RuntimeError, NotImplementedError)):
        model(IDS)
    done = materialize(model, init=model._init_weights if how == "init_weights" else None)
    assert done == report.on_meta and on_meta(model) == []
    ref = load_reference(tiny_dir)
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq, rtol=0, atol=0)
    torch.testing.assert_close(model(IDS).logits, ref(IDS).logits, rtol=0, atol=0)


def test_materialize_refuses_what_it_cannot_compute():
    class Plain(nn.Module):  # a derived buffer and no config to rebuild it from
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.arange(4.0), persistent=False)

    with torch.device("meta"):
        m = nn.Sequential(Plain(), nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"parameters are on the meta device \(1\.weight, 1\.bias\)"):
        materialize(m)  # weights are the checkpoint's to fill
    m[1] = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"0\.table on the meta device, and Plain has no `config`.*pass init="):
        materialize(m)
    assert materialize(m, init=lambda mod: mod.table.copy_(torch.arange(4.0) * 2)) == ["0.table"]
    assert m[0].table.tolist() == [0.0, 2.0, 4.0, 6.0]
    with torch.device("meta"):
        m[0] = Plain()
    with pytest.raises(ValueError, match=r"init\(Plain\) left 0\.table on the meta device"):
        materialize(m, init=lambda mod: mod.register_buffer("table", torch.empty(4, device="meta")))


def test_fuse_takes_grouped_query_sizes_from_the_checkpoint(tiny_dir):
    """A GQA checkpoint (4 query heads, 2 KV heads: q 64 rows, k and v 32) fused into one qkv_proj that declares
    no shard sizes: 128 rows do not split equally in 3, and the checkpoint's shapes give the only split."""
    config = transformers.AutoConfig.from_pretrained(tiny_dir)
    assert config.num_key_value_heads < config.num_attention_heads
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
        for layer in model.model.layers:
            a = layer.self_attn
            rows = a.q_proj.out_features + a.k_proj.out_features + a.v_proj.out_features
            a.qkv_proj = nn.Linear(config.hidden_size, rows, bias=False)
            del a.q_proj, a.k_proj, a.v_proj
    rules = Rules(fuses=(Fuse(("q_proj", "k_proj", "v_proj"), "qkv_proj"),))
    assert plan(model, tiny_dir, rules).problems == []
    report = load(model, tiny_dir, rules)
    ref = load_reference(tiny_dir)
    for i, layer in enumerate(model.model.layers):
        r = ref.model.layers[i].self_attn
        assert torch.equal(layer.self_attn.qkv_proj.weight,
                           torch.cat([r.q_proj.weight, r.k_proj.weight, r.v_proj.weight]))
    prov = report.provenance["model.layers.0.self_attn.qkv_proj.weight"]
    assert sorted((k.split(".")[-2], str(r)) for k, _, r in prov) == [
        ("k_proj", "[rows 64:96]"), ("q_proj", "[rows 0:64]"), ("v_proj", "[rows 96:128]")]


def test_a_prefix_renamed_away_still_maps_back_to_the_checkpoint_keys(tiny_dir):
    """Another engine's modules without transformers' `model.` prefix (Rename("^model.", "")): the checkpoint's
    q/k/v shapes still give the fused split, and a missing key is named as the checkpoint spells it."""
    config = transformers.AutoConfig.from_pretrained(tiny_dir)

    def build():
        with torch.device("meta"):
            m = nn.Module()
            m.layers = nn.ModuleList(nn.Module() for _ in range(config.num_hidden_layers))
            for layer in m.layers:
                layer.self_attn = nn.Module()
                layer.self_attn.qkv_proj = nn.Linear(config.hidden_size, 128, bias=False)  # 64 + 32 + 32 rows
        return m

    rules = Rules(renames=(Rename("^model.", ""),), fuses=(Fuse(("q_proj", "k_proj", "v_proj"), "qkv_proj"),),
                  ignores=(Ignore(r"(mlp|norm|layernorm|embed_tokens|lm_head|o_proj)", "not in this module"),))
    model = build()
    load(model, tiny_dir, rules)
    ref = load_reference(tiny_dir)
    r = ref.model.layers[1].self_attn
    assert torch.equal(model.layers[1].self_attn.qkv_proj.weight,
                       torch.cat([r.q_proj.weight, r.k_proj.weight, r.v_proj.weight]))
    model.layers[1].self_attn.extra = nn.Linear(2, 2, bias=False).to("meta")
    assert "missing: model.layers.1.self_attn.extra.weight" in str(plan(model, tiny_dir, rules).problems[0])


def test_fuse_checkpoint_sizes_beat_an_equal_split(tmp_path):
    """q 64 + k 16 + v 16 = 96 rows would split equally (32 each), wrongly: the checkpoint's shapes win."""
    g = torch.Generator().manual_seed(0)
    t = {f"attn.{p}_proj.weight": torch.randn(n, 8, generator=g) for p, n in (("q", 64), ("k", 16), ("v", 16))}
    with torch.device("meta"):
        m = nn.Module()
        m.attn = nn.Module()
        m.attn.qkv_proj = nn.Linear(8, 96, bias=False)
    load(m, write(tmp_path, t), Rules(fuses=(Fuse(("q_proj", "k_proj", "v_proj"), "qkv_proj"),)))
    assert torch.equal(m.attn.qkv_proj.weight, torch.cat([t[f"attn.{p}_proj.weight"] for p in "qkv"]))
    del t["attn.k_proj.weight"]  # a part missing: no split from the checkpoint; the equal one, and k is missing
    with torch.device("meta"):
        m.attn.qkv_proj = nn.Linear(8, 96, bias=False)
    with pytest.raises(LoadError) as e:
        load(m, write(tmp_path, t), Rules(fuses=(Fuse(("q_proj", "k_proj", "v_proj"), "qkv_proj"),)))
    assert any("attn.k_proj.weight" in p and "missing" in p for p in problems_of(e))


def test_plan_is_clean_and_reads_headers_only(ckpt):
    f = ckpt / "model.safetensors"
    size = f.stat().st_size
    header = 8 + int.from_bytes(f.read_bytes()[:8], "little")
    with open(f, "r+b") as fh:  # keep the header, make every tensor byte 0xff (NaN): a plan does not notice
        fh.seek(header)
        fh.write(b"\xff" * (size - header))
    p = plan(hf_meta(ckpt), ckpt)
    assert p.ok and len(p.entries) == 21
    assert {e.param for e in p.entries} == {n for n, _ in hf_meta(ckpt).named_parameters()}


# -- broken on disk ------------------------------------------------------------------------------------

def test_missing_tensor(ckpt):
    rewrite(ckpt / "model.safetensors", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(LoadError) as e:
        load(hf_meta(ckpt), ckpt)
    assert problems_of(e) == ["missing: model.layers.1.mlp.up_proj.weight: the checkpoint has no tensor for it"]
    assert e.value.problems[0].param == "model.layers.1.mlp.up_proj.weight"


def test_unexpected_key(ckpt):
    rewrite(ckpt / "model.safetensors", lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.ones(3)}))
    with pytest.raises(LoadError) as e:
        load(hf_meta(ckpt), ckpt)
    assert problems_of(e) == ["unexpected: model.layers.0.mlp.extra.weight in model.safetensors: "
                              "no parameter of the module has that name"]


def test_wrong_shape_checked_before_narrowing(ckpt):
    rewrite(ckpt / "model.safetensors", lambda t: t.update({"model.norm.weight": torch.ones(65)}))
    with pytest.raises(LoadError) as e:
        load(hf_meta(ckpt), ckpt)
    assert problems_of(e) == ["shape: model.norm.weight in model.safetensors has shape [65] "
                              "but model.norm.weight expects [64]"]


def test_all_problems_at_once(ckpt):
    def break_(t):
        t.pop("model.layers.0.self_attn.k_proj.weight")
        t["model.layers.1.self_attn.q_proj.weight"] = torch.ones(64, 65)
        t["lm_head.bias"] = torch.zeros(128)
    rewrite(ckpt / "model.safetensors", break_)
    with pytest.raises(LoadError) as e:
        load(hf_meta(ckpt), ckpt)
    assert sorted(p.kind for p in e.value.problems) == ["missing", "shape", "unexpected"]
    text = str(e.value)
    assert len(text.splitlines()) == 4  # a header, then one line per problem
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.self_attn.q_proj.weight", "lm_head.bias"):
        assert name in text


def test_key_in_two_shards(tmp_path):
    path = save_tiny("LlamaForCausalLM", tmp_path / "m", max_shard_size="20KB")
    shards = sorted(path.glob("model-*.safetensors"))
    first = load_file(shards[0])
    key = next(iter(first))
    rewrite(shards[-1], lambda t: t.update({key: first[key]}))
    with pytest.raises(LoadError) as e:
        load(hf_meta(path), path)
    assert problems_of(e) == [f"duplicate: {key} is in 2 files: {shards[0].name} and {shards[-1].name}"]


def test_shard_listed_but_missing(tmp_path):
    path = save_tiny("LlamaForCausalLM", tmp_path / "m", max_shard_size="20KB")
    gone = sorted(path.glob("model-*.safetensors"))[0]
    gone.unlink()
    with pytest.raises(LoadError) as e:
        open_source(path)
    assert problems_of(e) == [f"file: {gone.name} is listed in model.safetensors.index.json "
                              f"(for 1 keys: model.embed_tokens.weight) but is not in {path}"]
    with pytest.raises(LoadError) as e:  # load() names the parameters it leaves empty too
        load(hf_meta(path), path)
    assert [p.kind for p in e.value.problems] == ["file", "missing"]
    assert "model.embed_tokens.weight" in str(e.value.problems[1])


def test_shard_not_in_index(tmp_path):
    path = save_tiny("LlamaForCausalLM", tmp_path / "m", max_shard_size="20KB")
    save_file({"stray.weight": torch.ones(2)}, path / "model-00099-of-00099.safetensors")
    save_file({"other.weight": torch.ones(2)}, path / "consolidated.safetensors")  # not a shard: not read
    with pytest.raises(LoadError) as e:
        open_source(path)
    assert problems_of(e) == [f"file: model-00099-of-00099.safetensors is in {path} but not listed in "
                              f"model.safetensors.index.json; its 1 tensors (stray.weight) would be ignored"]


def test_pickles_refused_unless_allowed(tiny_dir, tmp_path):
    shutil.copy(tiny_dir / "config.json", tmp_path / "config.json")
    torch.save(load_file(tiny_dir / "model.safetensors"), tmp_path / "pytorch_model.bin")
    with pytest.raises(LoadError, match=r"pickle weights \(pytorch_model.bin\).*allow_bin=True"):
        open_source(tmp_path)
    model = hf_meta(tmp_path)
    load(model, open_source(tmp_path, allow_bin=True))
    torch.testing.assert_close(model(IDS).logits, load_reference(tiny_dir)(IDS).logits, rtol=0, atol=0)


def test_lossy_dtype_refused_unless_asked(tiny_dir):
    with pytest.raises(LoadError) as e:
        load(hf_meta(tiny_dir, torch.bfloat16), tiny_dir)
    assert len(e.value.problems) == 21 and {p.kind for p in e.value.problems} == {"dtype"}
    assert "dtype: model.norm.weight in model.safetensors is float32 but model.norm.weight is bfloat16: " \
           "a lossy cast (pass dtype= to load() to cast on purpose)" in problems_of(e)
    model = hf_meta(tiny_dir, torch.bfloat16)
    load(model, tiny_dir, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_dtype_per_parameter(tiny_dir):
    """dtype= as a mapping casts the named parameters on purpose (bfloat16 matrices beside float32 norms, as zoo
    stores a bfloat16 model on the CPU); a parameter it does not name keeps the module's dtype, and a lossy cast
    into it is still refused, by name."""
    matrices = {n: torch.bfloat16 for n, p in hf_meta(tiny_dir).named_parameters() if p.dim() == 2}
    model = hf_meta(tiny_dir)
    load(model, tiny_dir, dtype=matrices)
    assert {n: p.dtype for n, p in model.named_parameters()} == {
        n: matrices.get(n, torch.float32) for n, _ in model.named_parameters()}
    want = load_reference(tiny_dir)
    assert torch.equal(model.model.norm.weight, want.model.norm.weight)
    assert torch.equal(model.lm_head.weight, want.lm_head.weight.bfloat16())
    model = hf_meta(tiny_dir, torch.bfloat16)
    with pytest.raises(LoadError) as e:
        load(model, tiny_dir, dtype=matrices)
    assert {p.param for p in e.value.problems} == {n for n, _ in model.named_parameters() if n not in matrices}
    assert "dtype: model.norm.weight in model.safetensors is float32 but model.norm.weight is bfloat16: " \
           "a lossy cast (pass dtype= to load() to cast on purpose)" in problems_of(e)


def test_widening_is_fine(ckpt):
    rewrite(ckpt / "model.safetensors", lambda t: t.update({k: v.bfloat16() for k, v in t.items()}))
    model = hf_meta(ckpt)
    load(model, ckpt)
    assert model.model.norm.weight.dtype == torch.float32


def test_nonfinite_opt_in_and_nothing_half_loaded(ckpt):
    def poison(t):
        t["model.norm.weight"][5] = float("nan")
    rewrite(ckpt / "model.safetensors", poison)
    load(hf_meta(ckpt), ckpt)  # not checked unless asked
    model = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(ckpt))
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    with pytest.raises(LoadError) as e:
        load(model, ckpt, check_finite=True)
    assert problems_of(e) == ["nonfinite: model.norm.weight in model.safetensors has 1 NaN/Inf values "
                              "(-> model.norm.weight)"]
    for n, p in model.named_parameters():  # the same Parameters, with the same values
        assert p is before[n][0] and torch.equal(p, before[n][1]), n


def test_nonfinite_in_bfloat16_found_and_counted(ckpt):
    # bfloat16 is checked through row sums (a GEMV with ones, not a float32 reduction): NaN, Inf and -Inf in a
    # matrix, a vector and a 1-row tensor are each found, and counted exactly
    def poison(t):
        t.update({k: v.bfloat16() for k, v in t.items()})
        t["model.layers.0.mlp.down_proj.weight"][1, 2:4] = torch.tensor([float("inf"), float("-inf")])
        t["model.layers.1.self_attn.q_proj.weight"][0, 0] = float("nan")
        t["model.norm.weight"][-1] = float("-inf")
    rewrite(ckpt / "model.safetensors", poison)
    with pytest.raises(LoadError) as e:
        load(hf_meta(ckpt, torch.bfloat16), ckpt, check_finite=True)
    assert sorted(problems_of(e)) == [
        f"nonfinite: {k} in model.safetensors has {n} NaN/Inf values (-> {p})" for k, n, p in sorted([
            ("model.layers.0.mlp.down_proj.weight", 2, "model.layers.0.mlp.down_proj.weight"),
            ("model.layers.1.self_attn.q_proj.weight", 1, "model.layers.1.self_attn.q_proj.weight"),
            ("model.norm.weight", 1, "model.norm.weight")])]


def test_pieces_read_the_same_bits_and_find_every_nonfinite(ckpt, monkeypatch):
    # the pread path reads (and checks) blocks of rows of about sources.PIECE bytes: with pieces of a row or two,
    # the bfloat16 parameters equal, bit for bit, the file's tensors and a load read in one piece per tensor, and
    # NaN/Inf in the first and the last row of a matrix are each found and counted
    import loader.sources

    rewrite(ckpt / "model.safetensors", lambda t: t.update({k: v.bfloat16() for k, v in t.items()}))
    on_disk = load_file(ckpt / "model.safetensors")
    loaded = {}
    for piece in (1 << 62, 100):  # one piece per tensor; a row (or the part of one) per piece
        monkeypatch.setattr(loader.sources, "PIECE", piece)
        model = hf_meta(ckpt, torch.bfloat16)
        load(model, ckpt, check_finite=True)
        loaded[piece] = {n: p.detach().clone() for n, p in model.named_parameters()}
    for n, t in loaded[100].items():
        assert t.view(torch.int16).equal(loaded[1 << 62][n].view(torch.int16)), n
        if n in on_disk:
            assert t.view(torch.int16).equal(on_disk[n].view(torch.int16)), n

    def poison(t):
        t["model.layers.0.mlp.down_proj.weight"][0, 0] = float("nan")
        t["model.layers.0.mlp.down_proj.weight"][-1, -3:] = float("inf")
    rewrite(ckpt / "model.safetensors", poison)
    with pytest.raises(LoadError) as e:
        load(hf_meta(ckpt, torch.bfloat16), ckpt, check_finite=True)
    assert problems_of(e) == ["nonfinite: model.layers.0.mlp.down_proj.weight in model.safetensors has 4 NaN/Inf "
                              "values (-> model.layers.0.mlp.down_proj.weight)"]


def test_huge_finite_bfloat16_is_not_nonfinite(ckpt):
    # finite values whose row sum overflows are not NaN/Inf: the exact count decides
    rewrite(ckpt / "model.safetensors", lambda t: t.update(
        {k: (torch.full_like(v, 3e38) if k == "model.layers.0.mlp.up_proj.weight" else v).bfloat16()
         for k, v in t.items()}))
    model = hf_meta(ckpt, torch.bfloat16)
    load(model, ckpt, check_finite=True)
    assert torch.isfinite(model.model.layers[0].mlp.up_proj.weight).all()


def test_failed_load_leaves_meta_module_alone(ckpt):
    rewrite(ckpt / "model.safetensors", lambda t: t.pop("lm_head.weight"))
    model = hf_meta(ckpt)
    with pytest.raises(LoadError):
        load(model, ckpt)
    assert all(p.is_meta for p in model.parameters())


# -- fused, stacked, tied: a module of our own ----------------------------------------------------------

H, HQ, HKV, E, I, V = 16, 16, 8, 4, 8, 32


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Module()
        self.gate_up_proj.weight = nn.Parameter(torch.empty(E, 2 * I, H))  # [E, 2I, H]
        self.down_proj = nn.Module()
        self.down_proj.weight = nn.Parameter(torch.empty(E, H, I))  # [E, H, I]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = nn.Module()
        self.self_attn.qkv_proj = nn.Linear(H, HQ + 2 * HKV, bias=False)
        self.self_attn.qkv_proj.weight.shard_sizes = (HQ, HKV, HKV)
        self.mlp = nn.Module()
        self.mlp.experts = Experts()


class TinyMoE(nn.Module):
    def __init__(self, tied=True):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(V, H)
        self.model.layers = nn.ModuleList([Block() for _ in range(2)])
        self.lm_head = nn.Linear(H, V, bias=False)
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight


RULES = Rules(
    fuses=(Fuse(("q_proj", "k_proj", "v_proj"), "qkv_proj"), Fuse(("gate_proj", "up_proj"), "gate_up_proj")),
    stacks=(Stack("experts"),),
    ignores=(Ignore(r"rotary_emb\.inv_freq$", "recomputed from the config"),),
    ties=(Tie("lm_head.weight", "model.embed_tokens.weight"),),
)


def moe_tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)
    t = {"model.embed_tokens.weight": r(V, H)}
    for layer in range(2):
        a = f"model.layers.{layer}.self_attn"
        t |= {f"{a}.q_proj.weight": r(HQ, H), f"{a}.k_proj.weight": r(HKV, H), f"{a}.v_proj.weight": r(HKV, H),
              f"{a}.rotary_emb.inv_freq": r(4)}
        for e in range(E):
            x = f"model.layers.{layer}.mlp.experts.{e}"
            t |= {f"{x}.gate_proj.weight": r(I, H), f"{x}.up_proj.weight": r(I, H), f"{x}.down_proj.weight": r(H, I)}
    return t


def write(tmp_path, tensors):
    save_file(tensors, tmp_path / "model.safetensors")
    return tmp_path


def meta_moe(tied=True):
    with torch.device("meta"):
        return TinyMoE(tied)


def test_fused_stacked_clean(tmp_path):
    t = moe_tensors()
    model = meta_moe()
    report = load(model, write(tmp_path, t), RULES)
    a, x = model.model.layers[1].self_attn, model.model.layers[1].mlp.experts
    assert torch.equal(a.qkv_proj.weight, torch.cat([t[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"]))
    assert a.qkv_proj.weight.shard_sizes == (HQ, HKV, HKV)  # layer attributes survive the swap
    for e in range(E):
        p = f"model.layers.1.mlp.experts.{e}"
        assert torch.equal(x.gate_up_proj.weight[e], torch.cat([t[f"{p}.gate_proj.weight"], t[f"{p}.up_proj.weight"]]))
        assert torch.equal(x.down_proj.weight[e], t[f"{p}.down_proj.weight"])
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert report.tensors == len(t) - 2 and report.parameters == 1 + 2 * 3
    assert [k for k, _, _ in report.ignored] == [f"model.layers.{i}.self_attn.rotary_emb.inv_freq" for i in (0, 1)]
    prov = report.provenance["model.layers.0.mlp.experts.gate_up_proj.weight"]
    assert [(k, str(r)) for k, _, r in prov][:2] == [("model.layers.0.mlp.experts.0.gate_proj.weight", "[0, rows 0:8]"),
                                                     ("model.layers.0.mlp.experts.0.up_proj.weight", "[0, rows 8:16]")]


def test_missing_fused_shard_names_the_key_and_rows(tmp_path):
    t = moe_tensors()
    del t["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(LoadError) as e:
        load(meta_moe(), write(tmp_path, t), RULES)
    assert problems_of(e) == ["missing: model.layers.1.self_attn.k_proj.weight -> "
                              "model.layers.1.self_attn.qkv_proj.weight[rows 16:24]"]


def test_missing_expert_names_the_expert(tmp_path):
    t = moe_tensors()
    del t["model.layers.0.mlp.experts.3.up_proj.weight"]
    del t["model.layers.1.mlp.experts.2.down_proj.weight"]
    with pytest.raises(LoadError) as e:
        load(meta_moe(), write(tmp_path, t), RULES)
    assert problems_of(e) == [
        "missing: model.layers.0.mlp.experts.3.up_proj.weight -> model.layers.0.mlp.experts.gate_up_proj.weight[3, rows 8:16]",
        "missing: model.layers.1.mlp.experts.2.down_proj.weight -> model.layers.1.mlp.experts.down_proj.weight[2]"]


def test_two_keys_one_region_is_duplicate(tmp_path):
    t = moe_tensors()
    t["model.layers.0.self_attn.qkv_proj.weight"] = torch.zeros(HQ + 2 * HKV, H)  # also already fused
    with pytest.raises(LoadError) as e:
        load(meta_moe(), write(tmp_path, t), RULES)
    assert [p.kind for p in e.value.problems] == ["duplicate"] * 3
    assert str(e.value.problems[0]) == (
        "duplicate: model.layers.0.self_attn.qkv_proj.weight[rows 16:24] is written twice: by "
        "model.layers.0.self_attn.k_proj.weight in model.safetensors and by "
        "model.layers.0.self_attn.qkv_proj.weight in model.safetensors")


def test_fused_shard_of_wrong_shape(tmp_path):
    t = moe_tensors()
    t["model.layers.0.mlp.experts.1.gate_proj.weight"] = torch.zeros(I + 1, H)
    with pytest.raises(LoadError) as e:
        load(meta_moe(), write(tmp_path, t), RULES)
    assert problems_of(e) == ["shape: model.layers.0.mlp.experts.1.gate_proj.weight in model.safetensors has shape "
                              "[9, 16] but model.layers.0.mlp.experts.gate_up_proj.weight[1, rows 0:8] expects [8, 16]"]


def test_tied_config_with_a_real_head_unties(tmp_path):
    t = moe_tensors()
    t["lm_head.weight"] = torch.randn(V, H)
    model = meta_moe(tied=True)
    report = load(model, write(tmp_path, t), RULES)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, t["lm_head.weight"])
    assert torch.equal(model.model.embed_tokens.weight, t["model.embed_tokens.weight"])
    assert [str(d) for d in report.ties] == [
        "lm_head.weight untied from model.embed_tokens.weight (the checkpoint holds its own lm_head.weight)"]


def test_tie_rule_ties_an_untied_module(tmp_path):
    model = meta_moe(tied=False)
    report = load(model, write(tmp_path, moe_tensors()), RULES)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert [d.tied for d in report.ties] == [True]


def test_untied_module_without_rule_misses_head(tmp_path):
    rules = Rules(fuses=RULES.fuses, stacks=RULES.stacks, ignores=RULES.ignores)
    with pytest.raises(LoadError) as e:
        load(meta_moe(tied=False), write(tmp_path, moe_tensors()), rules)
    assert problems_of(e) == ["missing: lm_head.weight: the checkpoint has no tensor for it"]


def test_renames_are_reversed_in_messages(tmp_path):
    from loader import Rename

    t = {re.sub(r"\.mlp\.", ".block_sparse_moe.", k): v for k, v in moe_tensors().items()}
    del t["model.layers.0.block_sparse_moe.experts.0.gate_proj.weight"]
    rules = RULES + Rules(renames=(Rename(".block_sparse_moe.", ".mlp."),))
    with pytest.raises(LoadError) as e:
        load(meta_moe(), write(tmp_path, t), rules)
    assert problems_of(e) == ["missing: model.layers.0.block_sparse_moe.experts.0.gate_proj.weight -> "
                              "model.layers.0.mlp.experts.gate_up_proj.weight[0, rows 0:8]"]


def test_experts_kept_as_a_module_list_fall_back_to_per_expert_names(tmp_path):
    class Expert(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = nn.Linear(H, 2 * I, bias=False)  # fused within the expert, not stacked
            self.down_proj = nn.Linear(I, H, bias=False)

    with torch.device("meta"):
        model = TinyMoE()
        for block in model.model.layers:
            block.mlp.experts = nn.ModuleList([Expert() for _ in range(E)])
    t = moe_tensors()
    p = plan(model, write(tmp_path, t), RULES)
    assert p.ok
    assert {(e.param, str(e.region)) for e in p.entries if e.key == "model.layers.0.mlp.experts.2.up_proj.weight"} \
        == {("model.layers.0.mlp.experts.2.gate_up_proj.weight", "[rows 8:16]")}
    load(model, tmp_path, RULES)
    assert torch.equal(model.model.layers[0].mlp.experts[2].down_proj.weight, t["model.layers.0.mlp.experts.2.down_proj.weight"])


# -- ties must fit; dtype= casts floats only ------------------------------------------------------------------

class EmbedHead(nn.Module):
    """An embedding and a head the rules tie, possibly of different shapes or dtypes."""

    def __init__(self, rows=10, out=10, head_dtype=None):
        super().__init__()
        self.embed = nn.Embedding(rows, 4)  # [rows, 4]
        self.head = nn.Linear(4, out, bias=False, dtype=head_dtype)  # [out, 4]


TIE = Rules(ties=(Tie("head.weight", "embed.weight"),))


def test_tie_of_mismatched_shapes_is_refused(tmp_path):
    """embed [10, 4] tied to a head [12, 4]: rows 10:12 of the head would never be written."""
    write(tmp_path, {"embed.weight": torch.randn(10, 4)})
    with torch.device("meta"):
        model = EmbedHead(out=12)
    p = plan(model, tmp_path, TIE)
    assert not p.ties and p.owner["head.weight"] == "head.weight"
    assert [str(x) for x in p.problems] == [
        "shape: head.weight has shape [12, 4] but embed.weight, which it would be tied to, has shape [10, 4]: "
        "they cannot share one tensor",
        "missing: head.weight: the checkpoint has no tensor for it"]
    with pytest.raises(LoadError) as e:
        load(model, tmp_path, TIE)
    assert [x.kind for x in e.value.problems] == ["shape", "missing"] and model.head.weight.is_meta
    with torch.device("meta"):
        fits = EmbedHead(out=10)
    load(fits, tmp_path, TIE)
    assert fits.head.weight is fits.embed.weight


def test_tie_of_mismatched_dtypes_is_refused(tmp_path):
    write(tmp_path, {"embed.weight": torch.randn(10, 4)})
    with torch.device("meta"):
        model = EmbedHead(head_dtype=torch.float64)
    with pytest.raises(LoadError) as e:
        load(model, tmp_path, TIE)
    assert problems_of(e)[0] == ("dtype: head.weight is float64 but embed.weight, which it would be tied to, is "
                                 "float32: they cannot share one tensor")
    with torch.device("meta"):
        model = EmbedHead(head_dtype=torch.float64)
    load(model, tmp_path, TIE, dtype=torch.bfloat16)  # both allocated bfloat16: one tensor fits both
    assert model.head.weight is model.embed.weight and model.head.weight.dtype == torch.bfloat16


class WithIndex(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(2, 2, bias=False)
        self.register_buffer("index", torch.zeros(3, dtype=torch.int32))  # persistent integer buffer


def test_dtype_does_not_allow_lossy_integer_casts(tmp_path):
    """dtype= is a float -> float cast on purpose; int64 [1, 2**40, 3] into an int32 buffer is still refused."""
    write(tmp_path, {"proj.weight": torch.randn(2, 2), "index": torch.tensor([1, 2 ** 40, 3])})
    with pytest.raises(LoadError) as e:
        load(WithIndex(), tmp_path, dtype=torch.bfloat16)
    assert problems_of(e) == ["dtype: index in model.safetensors is int64 but index is int32: a lossy cast "
                              "(dtype= casts floating-point to floating-point only)"]
    write(tmp_path, {"proj.weight": torch.randn(2, 2), "index": torch.tensor([1, 2, 3], dtype=torch.int16)})
    model = WithIndex()
    load(model, tmp_path, dtype=torch.bfloat16)  # int16 -> int32 widens; float32 -> bfloat16 asked for
    assert model.index.tolist() == [1, 2, 3] and model.index.dtype == torch.int32
    assert model.proj.weight.dtype == torch.bfloat16
