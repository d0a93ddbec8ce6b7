"""`zoo inspect MODEL`: the loader's plan from headers, against transformers' class or the zoo's own."""
from __future__ import annotations

from safetensors.torch import load_file, save_file

from tiny import save_tiny
from zoo.cli import main


def test_inspect_transformers_class_clean(tmp_path, capsys):
    path = save_tiny("LlamaForCausalLM", tmp_path / "m", max_shard_size="20KB")
    assert main(["inspect", str(path), "--transformers"]) == 0
    out = capsys.readouterr().out
    assert "-> transformers LlamaForCausalLM (identity rules)" in out
    assert "model.layers.{i}.self_attn.q_proj.weight" in out and "(x2)" in out  # layers folded
    assert out.rstrip().endswith("ok: every checkpoint tensor and every element of every parameter is accounted for")


def test_inspect_zoo_model_shows_fused_regions(tmp_path, capsys):
    path = save_tiny("LlamaForCausalLM", tmp_path / "m", tie_word_embeddings=True)
    assert main(["inspect", str(path), "--all"]) == 0
    out = capsys.readouterr().out
    assert "model.layers.1.self_attn.k_proj.weight" in out
    assert "model.layers.1.self_attn.qkv_proj.weight[rows 64:96]" in out
    assert "tie: lm_head.weight tied to model.embed_tokens.weight" in out


def test_inspect_broken_checkpoint_exits_1(tmp_path, capsys):
    path = save_tiny("LlamaForCausalLM", tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1].clone()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    assert main(["inspect", str(path)]) == 1
    out = capsys.readouterr().out
    assert "2 problems:" in out
    assert ("missing: model.layers.0.self_attn.k_proj.weight -> "
            "model.layers.0.self_attn.qkv_proj.weight[rows 64:96]") in out
    assert "shape: model.norm.weight in model.safetensors has shape [63] but model.norm.weight expects [64]" in out


def test_inspect_nothing_there_exits_2(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 2
    assert f"no weights in {tmp_path}" in capsys.readouterr().out
