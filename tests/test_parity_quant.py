"""`zoo parity x.gguf` on a GGUF kept quantized (the zoo side on the block kernels, `zoo run`'s default) against
transformers' dequantized float32 reference: the report's KL / top-1 and its quantization record, the float32
comparison kept behind --dtype float32, and a planted bug in the quantized path only that changes the verdict.

The GGUF is written by the `gguf` package from a tiny transformers Llama, with a vocabulary, so the config and
tokenizer come from the file alone (tests/quant_gguf.py); its types are the embedded default's (Q4_1, a Q8_0
embedding).
"""
from __future__ import annotations

import json

import pytest
import torch
import transformers

from mutants import BUG_LAYER, planted
from parity.harness import run_parity
from parity.tolerances import tolerances
from quant_gguf import write_gguf
from tiny import tiny_config
from zoo.cli import main as zoo_main

L = f"model.layers.{BUG_LAYER}"


@pytest.fixture(scope="module")
def q4_1(tmp_path_factory):
    config = tiny_config("LlamaForCausalLM", vocab_size=512, hidden_size=256, intermediate_size=512,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    return write_gguf(model, config, tmp_path_factory.mktemp("q4_1") / "m.gguf", {"": "Q4_1", "token_embd": "Q8_0"},
                      tokenizer=True)


def test_parity_of_a_gguf_runs_its_blocks_quantized_and_reports_kl_and_top1(q4_1, tmp_path, capsys):
    out = tmp_path / "report.json"
    rc = zoo_main(["parity", str(q4_1), "--scenario", "prefill", "--scenario", "decode", "--scenario", "served",
                   "--json", str(out), "--quiet"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "quantized: the zoo side runs" in text and "Q4_1 x" in text and "PASS" in text
    doc = json.loads(out.read_text())
    quant = doc["meta"]["quantization"]
    assert quant["mode"] == "blocks" and quant["file_types"]["Q4_1"] > 0 and quant["file_types"]["Q8_0"] == 1
    assert set(quant["types"]) == {"Q4_1", "Q8_0"}
    assert quant["weights"]["model.embed_tokens.weight"].startswith("Q8_0")
    assert quant["weights"][f"{L}.mlp.down_proj.weight"].startswith("Q4_1")
    assert doc["tolerances"] == tolerances("dense", quantized=True)
    for name in ("prefill", "decode", "served"):
        scenario = doc["scenarios"][name]
        logits = scenario["logits"]["sampled_logits" if name == "served" else "logits"]["summary"]
        assert {"kl_mean", "kl_max", "top1"} <= set(logits), logits
        assert logits["kl_max"] <= doc["tolerances"]["kl_max"] and logits["top1"] == 1.0, (name, logits)
        assert scenario["passed"], (name, scenario["failures"])
    assert doc["scenarios"]["served"]["info"]["fused_steps"] > 0 or "module path" in \
        doc["scenarios"]["served"]["description"]


def test_dtype_float32_keeps_the_dequantized_comparison(q4_1, tmp_path, capsys):
    out = tmp_path / "report.json"
    rc = zoo_main(["parity", str(q4_1), "--dtype", "float32", "--scenario", "prefill", "--json", str(out), "--quiet"])
    text = capsys.readouterr().out
    assert rc == 0, text
    doc = json.loads(out.read_text())
    assert doc["meta"]["quantization"]["mode"] == "dequantized" and not doc["meta"]["quantization"]["weights"]
    assert doc["tolerances"] == tolerances("dense")


def test_a_bug_in_the_quantized_path_only_fails_the_quantized_run(q4_1):
    """Nibbles read swapped in layer 1's down_proj blocks (tests/mutants.py): the quantized run diverges there,
    with KL and top-1 reported; the same mutant on the dequantized file (float32 weights) is correct."""
    with planted("quant_nibbles_swapped"):
        bad = run_parity(q4_1, scenarios=("prefill", "served"))
        dequantized = run_parity(q4_1, scenarios=("prefill",), quantized=False)
    assert bad.meta["quantization"]["mode"] == "blocks" and not bad.passed
    s = bad.scenarios["prefill"]
    assert not s.passed and not bad.scenarios["served"].passed
    assert (s.first_divergence["tap"], s.first_divergence["position"]) == (f"{L}.mlp", 0), s.first_divergence
    assert s.localization.culprit["block"] == L
    logits = s.comparison.logits.summary(s.tol)
    assert logits["kl_max"] > s.tol["kl_max"], logits
    assert dequantized.passed, {n: r.failures for n, r in dequantized.scenarios.items()}


def test_dtype_bfloat16_of_a_gguf_is_a_usage_error(q4_1, capsys):
    """bfloat16 parity takes a safetensors checkpoint: refused before anything loads, naming the flag."""
    assert zoo_main(["parity", str(q4_1), "--dtype", "bfloat16"]) == 2
    err = capsys.readouterr().err
    assert "zoo parity: --dtype bfloat16: m.gguf is a GGUF file" in err and "loading the reference" not in err, err
