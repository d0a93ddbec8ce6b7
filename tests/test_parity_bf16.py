"""`zoo parity MODEL --dtype bfloat16`: the zoo's CPU bfloat16 path (compact weights and KV caches bfloat16, float32
math) against transformers float32 on the same values with its cache reads rounded as the zoo's cache rounds them
(parity/bfloat16.py), judged with parity/tolerances.py BFLOAT16. From bfloat16 files the reference reads the
checkpoint as it is; from float32 files both sides read a temporary copy with the compact tensors rounded. A
bfloat16 activation planted in the path (the embedding's rows left bfloat16) fails it.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from multimodal_tiny import random_image
from mutants import planted_runtime
from parity.bfloat16 import compact_keys, reference_checkpoint
from parity.harness import run_parity
from parity.tolerances import tolerances
from test_bf16_storage import save_bf16
from tiny_configs import save_arch
from zoo.cli import main as zoo_main
from zoo.runtime.model_files import load_config, resolve_model

BF16 = torch.bfloat16
ARCHS = {  # architecture -> family; one of each (the multimodal one: test_cli_with_an_image)
    "LlamaForCausalLM": "dense",
    "MixtralForCausalLM": "moe",
    "DeepseekV3ForCausalLM": "mla",
    "BambaForCausalLM": "hybrid-ssm",
}


@pytest.fixture(scope="module")
def bf16_files(tmp_path_factory):
    return {arch: save_bf16(arch, tmp_path_factory.mktemp(arch)) for arch in [*ARCHS, "LlavaForConditionalGeneration"]}


def failures(result) -> dict:
    return {n: (s.failures, s.first_divergence) for n, s in result.scenarios.items() if not s.passed}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_every_scenario_passes_from_bfloat16_files(bf16_files, arch):
    result = run_parity(bf16_files[arch], dtype=BF16)
    assert result.passed, failures(result)
    assert result.meta["dtype"] == "bfloat16" and result.meta["reference"]["route"] == "checkpoint as is"
    assert result.meta["tolerance_set"] == f"{ARCHS[arch]} + BFLOAT16"
    assert result.tol == tolerances(ARCHS[arch], bfloat16=True)
    if arch in ("LlamaForCausalLM", "MixtralForCausalLM"):  # the fused native bfloat16 step serves them
        assert result.scenarios["served"].info["fused_steps"] > 0


def test_from_float32_files_both_sides_read_a_rounded_copy(tmp_path):
    """Qwen2 (a tied head): exactly the tensors the loader maps into compact parameters are rounded in the copy,
    the rest (norms, biases) kept as they are, and the copy is gone after the run."""
    path = save_arch("Qwen2ForCausalLM", tmp_path / "f32")
    held = load_file(path / "model.safetensors")
    config = load_config(resolve_model(path))
    keys = compact_keys(path, config)
    assert keys and set(keys.values()) == {torch.float32}
    assert any(k.endswith("norm.weight") for k in set(held) - set(keys))  # (a float32 parameter: not rounded)
    with reference_checkpoint(path, config) as (copy, record):
        assert record["route"] == "rounded copy" and record["rounded_tensors"] == len(keys)
        assert (copy / "config.json").read_bytes() == (path / "config.json").read_bytes()
        for key, t in load_file(copy / "model.safetensors").items():
            want = held[key].to(BF16) if key in keys else held[key]
            assert t.dtype == want.dtype and torch.equal(t, want), key
    assert not copy.exists()
    said = []
    result = run_parity(path, dtype=BF16, progress=said.append)
    assert result.passed, failures(result)
    assert result.meta["reference"]["route"] == "rounded copy"
    loaded_from = next(m.rsplit(" from ", 1)[1] for m in said if m.startswith("loading the reference"))
    assert loaded_from != str(path) and not Path(loaded_from).exists()


def test_a_checkpoint_the_zoo_does_not_load_is_a_finding_about_that_checkpoint(tmp_path, capsys):
    """float32 files lacking a tensor: no rounded copy is written (the zoo's plan has problems), so the strict
    loader's refusal names the user's directory, not a temporary one: exit 1."""
    path = save_arch("LlamaForCausalLM", tmp_path / "broken")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.self_attn.o_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    assert zoo_main(["parity", str(path), "--dtype", "bfloat16", "--scenario", "prefill", "--quiet"]) == 1
    out = capsys.readouterr().out
    assert f"{path} does not fit LlamaForCausalLM" in out and "missing: model.layers.1.self_attn.o_proj.weight" in out


def test_a_bfloat16_activation_fails_it(bf16_files):
    """The embedding's rows left bfloat16 (tests/mutants.py embedding_rows_as_stored): layer 0's norm rounds its
    output (1.6e-3), which the tolerances admit as they admit the cache's rounding compounding layer to layer
    (parity/tolerances.py BFLOAT16); by layer 1 it is 2e-2 and the logits' KL 1e-4."""
    path = bf16_files["LlamaForCausalLM"]
    with planted_runtime("embedding_rows_as_stored"):
        result = run_parity(path, dtype=BF16, scenarios=("prefill",))
    s = result.scenarios["prefill"]
    assert not s.passed and not result.passed
    first = s.first_divergence
    assert (first["tap"], first["layer"]) == ("model.layers.1.self_attn", 1), first
    assert any(f.startswith("logits: KL mean") for f in s.failures), s.failures
    assert run_parity(path, dtype=BF16, scenarios=("prefill",)).passed  # restored


@pytest.mark.parametrize("arch,mutant,mixer", [
    ("BambaForCausalLM", "mamba2_input_as_bfloat16", "model.layers.0.mamba"),
    ("JambaForCausalLM", "mamba_input_as_bfloat16", "model.layers.0.mamba"),
    ("Mamba2ForCausalLM", "mamba2_input_as_bfloat16", "backbone.layers.0.mixer")])
def test_a_bfloat16_mixer_input_is_named_at_the_mixer(bf16_files, tmp_path, arch, mutant, mixer):
    """A recurrent mixer reading its input rounded to bfloat16 adds 1.3e-3 to 2.2e-3 of its own at its in_proj, under
    the bfloat16 bound of a tap's total (6e-2, for the cache's rounding compounding): it was named downstream (the
    next attention, the logits) or, in Mamba2, passed. A mixer rounds nothing of its own, so its own error keeps the
    family's float32 bound (`ssm_local`), and a model without a KV cache (Mamba2) has nothing for bfloat16's bounds
    to admit: the float32 set judges it."""
    path = bf16_files.get(arch) or save_bf16(arch, tmp_path)
    assert run_parity(path, dtype=BF16, scenarios=("prefill",)).passed
    with planted_runtime(mutant):
        result = run_parity(path, dtype=BF16, scenarios=("prefill",))
    s = result.scenarios["prefill"]
    assert not s.passed and s.localization.culprit["tap"] == f"{mixer}.in_proj", s.localization.culprit
    assert result.meta["tolerance_set"] == ("hybrid-ssm" if arch == "Mamba2ForCausalLM" else "hybrid-ssm + BFLOAT16")


def test_cli_with_an_image(bf16_files, tmp_path, capsys):
    """LLaVA: the text scenarios and the image parity (vision layers, projector, merged embeddings, logits; an image
    split across chunks and a prefix hit inside it, with the language model's cache rounded), exit 0."""
    image, out = tmp_path / "image.png", tmp_path / "report.json"
    random_image(0, (60, 80)).save(image)
    rc = zoo_main(["parity", str(bf16_files["LlavaForConditionalGeneration"]), "--dtype", "bfloat16", "--image",
                   str(image), "--scenario", "prefill", "--scenario", "served", "--json", str(out), "--quiet"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "bfloat16: the zoo side stores" in text and "tolerances (multimodal + BFLOAT16)" in text
    doc = json.loads(out.read_text())
    meta = doc["meta"]
    assert doc["passed"] and meta["dtype"] == "bfloat16" and meta["reference"]["route"] == "checkpoint as is"
    assert meta["tolerance_set"] == "multimodal + BFLOAT16"
    assert doc["images"]["passed"] and set(doc["images"]["scenarios"]) == {"chunked", "prefix", "decode", "processors"}


@pytest.mark.parametrize("argv, message", [
    (["--dtype", "float16"], "argument --dtype: invalid choice: 'float16'"),
    (["--dtype", "bfloat16", "--device", "meta"], "--dtype bfloat16 checks the CPU's bfloat16 storage"),
])
def test_usage_errors_exit_2(bf16_files, argv, message, capsys):
    path = str(bf16_files["LlamaForCausalLM"])
    try:
        rc = zoo_main(["parity", path, *argv, "--quiet"])
    except SystemExit as e:  # (argparse's own refusal)
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert message in err and "loading the reference" not in err, err
