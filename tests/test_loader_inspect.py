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


def test_an_absent_shard_is_named_first(tmp_path, capsys):
    """An interrupted download: the shards holding the last layer are gone. zoo inspect and zoo run name the absent
    files first (the cause), then the layers the config claims and the checkpoint lacks."""
    import json

    from test_cli_run import save_word_tokenizer

    path = save_word_tokenizer(save_tiny("LlamaForCausalLM", tmp_path / "m", max_shard_size="20KB",
                                         num_hidden_layers=3))
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    gone = sorted({f for k, f in weight_map.items() if "layers.2." in k})
    for f in gone:
        (path / f).unlink()
    assert main(["inspect", str(path)]) == 1
    out = capsys.readouterr()
    text = out.out + out.err
    first = text.index(gone[0])
    assert f"not in {path} (an interrupted download?): {', '.join(gone)}" in text, text
    assert first < text.index("layers 2-2 have no tensors"), text
    assert main(["run", str(path), "--prompt", "w1 w2"]) == 1
    err = capsys.readouterr().err
    assert f"the index names are not in {path} (an interrupted download?): {gone[0]}" in err, err
