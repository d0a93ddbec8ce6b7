"""Hostile and malformed checkpoint files (issue 13), each built here from a tiny checkpoint that
transformers saved, and fed to `zoo inspect`, `zoo run`, `zoo parity` and the loader API.

Every case asserts: the exit status (2: the input is unreadable or refused, 1: a strictness finding), one
output line naming the file and the key (or the config field), no traceback, a time bound (a FIFO must not
hang), a peak-memory bound (a header that claims gigabytes must not be read), and for the security cases
that nothing of the file outside the checkpoint appears in any output. The loader API raises LoadError and
nothing else. The commands run in this process (a thread with a deadline); a few run as real processes.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import transformers

from loader import LoadError, load, open_source
from tiny import save_tiny
from zoo.cli import main

SECRET = "zoo-secret-7f3a9c-do-not-print"
TIME_BOUND_S = 30
PEAK_BOUND_MB = 400  # above the RSS when the case starts


# -- what a case is ----------------------------------------------------------------------------------------
class Case:
    def __init__(self, name, make, code, words, *, codes=None, security=False, api=True):
        self.name, self.make, self.code, self.words = name, make, code, words
        self.codes = codes or {}  # command -> exit status where it differs from `code`
        self.security, self.api = security, api

    def __repr__(self):
        return self.name


def index_of(d: Path) -> dict:
    return json.loads((d / "model.safetensors.index.json").read_text())


def write_index(d: Path, index) -> None:
    (d / "model.safetensors.index.json").write_text(index if isinstance(index, str) else json.dumps(index))


def shards(d: Path) -> list[Path]:
    return sorted(d.glob("model-*.safetensors"))


def split(f: Path) -> tuple[dict, bytes]:
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_st(f: Path, header, data: bytes) -> None:
    raw = (header if isinstance(header, str) else json.dumps(header)).encode()
    f.write_bytes(len(raw).to_bytes(8, "little") + raw + data)


def tensors_by_offset(header: dict) -> list[str]:
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])


def retarget(d: Path, shard: Path, to: str) -> str:
    """Point every index entry of `shard` at the name `to`; returns one key it names."""
    index = index_of(d)
    keys = [k for k, v in index["weight_map"].items() if v == shard.name]
    for k in keys:
        index["weight_map"][k] = to
    write_index(d, index)
    return keys[0]


def edit_config(d: Path, **change) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(change)
    (d / "config.json").write_text(json.dumps(cfg))


# -- security --------------------------------------------------------------------------------------------
def traversal(d, out):
    key = retarget(d, shards(d)[0], os.path.relpath(out / "secret.txt", d))
    return str(d), [key, "model.safetensors.index.json", "not a plain file name"]


def absolute(d, out):
    key = retarget(d, shards(d)[0], str(out / "secret.txt"))
    return str(d), [key, "model.safetensors.index.json", "not a plain file name"]


def dev_zero(d, out):
    key = retarget(d, shards(d)[0], "/dev/zero")
    return str(d), [key, "model.safetensors.index.json", "not a plain file name"]


def traversal_to_a_real_shard(d, out):
    """The index names a loadable copy of a shard in another directory: refused all the same."""
    shard = shards(d)[0]
    shutil.copy(shard, out / shard.name)
    key = retarget(d, shard, f"../{out.name}/{shard.name}")
    return str(d), [key, "model.safetensors.index.json", "not a plain file name"]


def symlink_to_a_secret(d, out):
    """A shard that links to a regular file which is no safetensors file: followed (as transformers follows it),
    read as a header and refused, no byte of it printed."""
    shard = shards(d)[0]
    shard.unlink()
    shard.symlink_to(out / "secret.txt")
    return str(d), [shard.name, "100 MB"]


def symlinked_config(d, out):
    (d / "config.json").unlink()
    (d / "config.json").symlink_to(out / "secret.txt")
    return str(d), ["config.json", "not JSON"]


def gguf_symlink_to_a_secret(d, out):
    """A directory whose one .gguf links to a regular file elsewhere that is no GGUF."""
    shutil.rmtree(d)
    d.mkdir()
    (d / "model.gguf").symlink_to(out / "secret.txt")
    return str(d), ["model.gguf", "not a GGUF file"]


def symlink_to_a_fifo(d, out):
    shard = shards(d)[0]
    shard.unlink()
    os.mkfifo(out / "fifo")
    shard.symlink_to(out / "fifo")
    return str(d), [shard.name, "a FIFO, not a regular file"]


def symlink_to_a_directory(d, out):
    shard = shards(d)[0]
    shard.unlink()
    shard.symlink_to(out, target_is_directory=True)
    return str(d), [shard.name, "a directory, not a regular file"]


def symlinked_config_to_a_fifo(d, out):
    (d / "config.json").unlink()
    os.mkfifo(out / "fifo")
    (d / "config.json").symlink_to(out / "fifo")
    return str(d), ["config.json", "a FIFO, not a regular file"]


def dangling_symlink(d, out):
    shard = shards(d)[0]
    shard.unlink()
    shard.symlink_to(out / "gone.safetensors")
    return str(d), [shard.name, "a symbolic link to nothing"]


def dangling_config(d, out):
    (d / "config.json").unlink()
    (d / "config.json").symlink_to(out / "gone.json")
    return str(d), ["config.json", "a symbolic link to nothing"]


def fifo_shard(d, out):
    shard = shards(d)[0]
    shard.unlink()
    os.mkfifo(shard)
    return str(d), [shard.name, "a FIFO, not a regular file"]


def fifo_index(d, out):
    (d / "model.safetensors.index.json").unlink()
    os.mkfifo(d / "model.safetensors.index.json")
    return str(d), ["model.safetensors.index.json", "a FIFO, not a regular file"]


def fifo_config(d, out):
    (d / "config.json").unlink()
    os.mkfifo(d / "config.json")
    return str(d), ["config.json", "a FIFO, not a regular file"]


# -- lying safetensors headers (the plan finds them: exit 1 everywhere, `zoo inspect` included) ------------
def truncated(d, out):
    shard = shards(d)[-1]
    header, data = split(shard)
    write_st(shard, header, data[:-4])
    return str(d), [tensors_by_offset(header)[-1], shard.name, "past the end"]


def overlapping(d, out):
    shard = next(f for f in shards(d) if len(tensors_by_offset(split(f)[0])) >= 2)
    header, data = split(shard)
    second = tensors_by_offset(header)[1]
    b, e = header[second]["data_offsets"]
    header[second]["data_offsets"] = [b - 4, e - 4]
    write_st(shard, header, data)
    return str(d), [second, shard.name, "overlap"]


def duplicate_key(d, out):
    shard = next(f for f in shards(d) if len(tensors_by_offset(split(f)[0])) >= 2)
    header, data = split(shard)
    first, second = tensors_by_offset(header)[:2]
    text = json.dumps(header).replace(json.dumps(second), json.dumps(first), 1)  # `first` twice in one object
    write_st(shard, text, data)
    return str(d), [first, "appears twice", shard.name]


def wrong_byte_count(d, out):
    shard = shards(d)[0]
    header, data = split(shard)
    key = tensors_by_offset(header)[0]
    header[key]["shape"] = [header[key]["shape"][0] + 1, *header[key]["shape"][1:]]
    write_st(shard, header, data)
    return str(d), [key, shard.name, "bytes"]


def huge_header_length(d, out):
    """A 64 GiB header length: refused before a byte of it is read."""
    shard = shards(d)[0]
    with open(shard, "r+b") as f:
        f.write((64 << 30).to_bytes(8, "little"))
    return str(d), [shard.name, "100 MB"]


def sparse_3gib_header(d, out):
    """A 3 GiB file of zeros behind a 3 GiB header length (sparse on disk): refused, never read whole."""
    shard = shards(d)[0]
    with open(shard, "wb") as f:
        f.write((3 << 30).to_bytes(8, "little"))
        f.truncate(8 + (3 << 30))
    return str(d), [shard.name, "100 MB"]


def nesting_bomb_header(d, out):
    shard = shards(d)[0]
    write_st(shard, "[" * 200_000 + "]" * 200_000, b"")
    return str(d), [shard.name, "nests JSON too deeply"]


def header_not_json(d, out):
    shard = shards(d)[0]
    write_st(shard, '{"model.norm.weight": {"dtype": "F32", ', b"")
    return str(d), [shard.name, "not JSON"]


# -- malformed indexes (exit 2) ---------------------------------------------------------------------------
def index_not_json(d, out):
    write_index(d, "{not json")
    return str(d), ["model.safetensors.index.json", "not JSON"]


def index_without_weight_map(d, out):
    write_index(d, {"metadata": {}})
    return str(d), ["model.safetensors.index.json", "no weight_map"]


def index_weight_map_a_list(d, out):
    write_index(d, {"weight_map": ["model.norm.weight"]})
    return str(d), ["model.safetensors.index.json", "weight_map is a JSON list"]


def index_value_an_int(d, out):
    index = index_of(d)
    index["weight_map"]["model.norm.weight"] = 3
    write_index(d, index)
    return str(d), ["model.safetensors.index.json", "model.norm.weight", "integer, not a shard file name"]


def index_value_null(d, out):
    index = index_of(d)
    index["weight_map"]["model.norm.weight"] = None
    write_index(d, index)
    return str(d), ["model.safetensors.index.json", "model.norm.weight", "null, not a shard file name"]


def index_a_list(d, out):
    write_index(d, [index_of(d)])
    return str(d), ["model.safetensors.index.json", "a JSON list, not an object"]


def index_nesting_bomb(d, out):
    write_index(d, '{"weight_map": ' + "[" * 200_000 + "]" * 200_000 + "}")
    return str(d), ["model.safetensors.index.json", "nests JSON too deeply"]


# -- GGUF (exit 2), written by hand: magic, version, counts, metadata, tensor infos, aligned data -----------
def gstr(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def gguf_bytes(*, magic=b"GGUF", version=3, n_tensors=None, n_kv=None, kv=None, tensors=None) -> bytes:
    """A little-endian GGUF file. kv: [(key, type, payload)]; tensors: [(name, dims fastest-first, type,
    data bytes)], laid out 32-byte aligned."""
    kv = [(b"general.architecture", 8, gstr("llama")), (b"llama.block_count", 4, struct.pack("<I", 1))] \
        if kv is None else kv
    if tensors is None:
        tensors = [("output_norm.weight", [8], 0, struct.pack("<8f", *range(8))),
                   ("token_embd.weight", [8, 4], 0, struct.pack("<32f", *range(32)))]
    head = magic + struct.pack("<I", version)
    head += struct.pack("<QQ", len(tensors) if n_tensors is None else n_tensors, len(kv) if n_kv is None else n_kv)
    for key, kind, payload in kv:
        head += gstr(key) + struct.pack("<I", kind) + payload
    data, offsets = b"", []
    for _, _, _, raw in tensors:
        data += bytes(-len(data) % 32)
        offsets.append(len(data))
        data += raw
    for (name, dims, kind, _), off in zip(tensors, offsets):
        head += gstr(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
        head += struct.pack("<IQ", kind, off)
    return head + bytes(-len(head) % 32) + data


def gguf_case(make_bytes, words):
    def make(d, out):
        shutil.rmtree(d)
        d.mkdir()
        (d / "model.gguf").write_bytes(make_bytes())
        return str(d / "model.gguf"), ["model.gguf", *words]
    make.__name__ = make_bytes.__name__
    return make


GGUF_CASES = [
    (lambda: b"", ["not a GGUF file"]),
    (lambda: b"GGML" + gguf_bytes()[4:], ["not a GGUF file"]),
    (lambda: gguf_bytes(version=1), ["version 1 is not supported"]),
    (lambda: gguf_bytes(version=99), ["version 99 is not supported"]),
    (lambda: gguf_bytes()[:128], ["truncated GGUF file", "output_norm.weight"]),
    (lambda: gguf_bytes()[:-8], ["token_embd.weight", "past the end of the file"]),
    (lambda: gguf_bytes(n_tensors=1 << 60), ["claims 1152921504606846976 tensors"]),
    (lambda: gguf_bytes(n_kv=1 << 60), ["1152921504606846976 metadata entries"]),
    (lambda: gguf_bytes(kv=[(b"general.name", 8, struct.pack("<Q", 1 << 50))]), ["general.name", "string of"]),
    (lambda: gguf_bytes(kv=[(b"x.list", 9, struct.pack("<IQ", 4, 1 << 50))]), ["x.list", "array items"]),
    (lambda: gguf_bytes(kv=[(b"x.vocab", 9, struct.pack("<IQQ", 8, 2, 1 << 50))]), ["x.vocab", "string of"]),
    (lambda: gguf_bytes(tensors=[("output_norm.weight", [32], 9, bytes(36))]), ["output_norm.weight", "GGML type 9"]),
    (lambda: gguf_bytes(tensors=[("output_norm.weight", [1] * 5, 0, bytes(4))]), ["output_norm.weight", "5 dims"]),
    (lambda: gguf_bytes(kv=[(b"k", 4, bytes(4)), (b"k", 4, bytes(4))]), ["'k' appears twice"]),
]
for i, (fn, _) in enumerate(GGUF_CASES):
    fn.__name__ = ["gguf_empty", "gguf_bad_magic", "gguf_version_1", "gguf_version_99", "gguf_truncated_header",
                   "gguf_truncated_data", "gguf_huge_tensor_count", "gguf_huge_kv_count", "gguf_huge_string",
                   "gguf_huge_array", "gguf_huge_string_in_array", "gguf_unsupported_quant", "gguf_too_many_dims", "gguf_duplicate_key"][i]


# -- configs (exit 2; a config claiming more layers than the checkpoint holds: a finding, 1) -----------------
def config_case(field_words, **change):
    def make(d, out):
        edit_config(d, **change)
        return str(d), field_words
    make.__name__ = "config_" + "_".join(change)
    return make


def yarn_without_factor(d, out):
    edit_config(d, rope_scaling={"rope_type": "yarn"}, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4})
    return str(d), ["factor", "yarn"]


def config_not_json(d, out):
    (d / "config.json").write_text("{")
    return str(d), ["config.json", "not JSON"]


def nan_weights(d, out):
    from safetensors.torch import load_file, save_file

    shard = shards(d)[0]
    tensors = load_file(shard)
    key = sorted(tensors)[0]
    tensors[key].view(-1)[3] = float("nan")
    save_file(tensors, shard, metadata={"format": "pt"})
    return str(d), [key, shard.name, "NaN/Inf"]


SECURITY = [traversal, absolute, dev_zero, traversal_to_a_real_shard, symlink_to_a_secret, symlinked_config,
            gguf_symlink_to_a_secret, symlink_to_a_fifo, symlink_to_a_directory, symlinked_config_to_a_fifo,
            dangling_symlink, dangling_config, fifo_shard, fifo_index, fifo_config]
NO_API = (symlinked_config, symlinked_config_to_a_fifo, dangling_config, fifo_config)  # (the loader API reads no config)
CASES = (
    [Case(f.__name__, f, 2, None, security=True, api=f not in NO_API) for f in SECURITY]
    + [Case(f.__name__, f, 1, None) for f in (truncated, overlapping, duplicate_key, wrong_byte_count)]
    + [Case(f.__name__, f, 2, None) for f in (huge_header_length, sparse_3gib_header, nesting_bomb_header,
                                              header_not_json)]
    + [Case(f.__name__, f, 2, None) for f in (index_not_json, index_without_weight_map, index_weight_map_a_list,
                                              index_value_an_int, index_value_null, index_a_list, index_nesting_bomb)]
    + [Case(fn.__name__, gguf_case(fn, w), 2, None) for fn, w in GGUF_CASES]
    + [Case(m.__name__, m, 2, None, api=False) for m in (
        config_case(["num_attention_heads=0"], num_attention_heads=0),
        config_case(["hidden_size=-4"], hidden_size=-4),
        config_case(["intermediate_size=0"], intermediate_size=0),
        config_case(["max_position_embeddings=0"], max_position_embeddings=0),
        config_case(["max_position_embeddings=-1"], max_position_embeddings=-1),
        config_case(["architectures='LlamaForCausalLM'", "not a list"], architectures="LlamaForCausalLM"),
        config_case(["rms_norm_eps=nan"], rms_norm_eps=float("nan")),
        config_case(["vocab_size"], vocab_size="x"),
        yarn_without_factor, config_not_json)]
    + [Case("config_num_hidden_layers_100000", config_case(["num_hidden_layers=100000", "layers 0-1"],
                                                           num_hidden_layers=100000), 1, None, api=False),
       Case("nan_weights", nan_weights, 1, None, codes={"inspect": 0})]
)


# -- running a case --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A sharded tiny Llama checkpoint (index + shards), saved by transformers, with a tokenizer (zoo run checks
    for one before it reads a weight: without one, every case would stop there)."""
    from test_cli_run import save_word_tokenizer

    return save_word_tokenizer(save_tiny("LlamaForCausalLM", tmp_path_factory.mktemp("base") / "m",
                                         max_shard_size="20KB"))


@pytest.fixture
def case_dirs(base, tmp_path):
    """(a fresh copy of the checkpoint, a directory beside it holding a secret and a valid shard's copy)."""
    d = tmp_path / "ckpt"
    shutil.copytree(base, d)
    out = tmp_path / "outside"
    out.mkdir()
    (out / "secret.txt").write_text((SECRET + "\n") * 64)
    return d, out


def peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def bounded(fn, *args):
    """fn(*args) in a thread with a deadline: (result or exception, seconds, peak RSS growth in MB or None)."""
    measured = reset_peak()
    before = rss_mb()
    box = {}

    def target():
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 (reported to the test)
            box["value"] = e

    t0 = time.perf_counter()
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(TIME_BOUND_S)
    seconds = time.perf_counter() - t0
    assert not thread.is_alive(), f"still running after {TIME_BOUND_S} s (a hang)"
    return box["value"], seconds, (peak_rss_mb() - before) if measured else None


def run_cli(command: str, target: str) -> int:
    argv = {"inspect": ["inspect", target],
            "run": ["run", target, "--prompt", "w1", "--max-tokens", "1"],
            "parity": ["parity", target, "--quiet", "--scenario", "prefill"]}[command]
    return main(argv)


def api(target: str):
    """The loader API on its own: open, plan and load (NaN/Inf checked) into transformers' Llama on meta."""
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    return load(model, target, check_finite=True)


@pytest.mark.parametrize("command", ["inspect", "run", "parity", "api"])
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_hostile_input(case, command, case_dirs, capsys):
    if command == "api" and not case.api:
        pytest.skip("the loader API reads no config")
    d, out = case_dirs
    target, words = case.make(d, out)
    capsys.readouterr()
    result, seconds, grown = bounded(api if command == "api" else run_cli, *([target] if command == "api" else
                                                                              [command, target]))
    stdout, stderr = capsys.readouterr()
    text = stdout + stderr
    if command == "api":
        assert isinstance(result, LoadError), f"{type(result).__name__}: {result}"
        text = str(result)
    else:
        assert not isinstance(result, BaseException), f"{type(result).__name__}: {result}"
        assert result == case.codes.get(command, case.code), text
    assert "Traceback" not in text
    if not (command == "inspect" and case.codes.get("inspect") == 0):
        assert any(all(w in line for w in words) for line in text.splitlines()), (words, text)
    assert seconds < TIME_BOUND_S
    if grown is not None:
        assert grown < PEAK_BOUND_MB, f"peak RSS grew by {grown:.0f} MB"
    if case.security:
        assert SECRET not in text
        assert not any(w.startswith(SECRET[:8]) for w in text.split())


# -- what is legitimate still loads ------------------------------------------------------------------------
def test_a_hub_snapshot_whose_files_link_into_blobs_loads(base, tmp_path):
    """The hub cache's own layout: snapshots/<rev>/<file> -> ../../blobs/<hash>."""
    repo = tmp_path / "models--org--tiny"
    snap = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(base.iterdir())):
        blob = repo / "blobs" / f"blob{i}"
        shutil.copy(f, blob)
        (snap / f.name).symlink_to(Path("../../blobs") / blob.name)
    report = api(str(snap))
    assert report.tensors == len(open_source(base).keys())


def linked_copy(src: Path, linked: Path, store: Path) -> Path:
    """`linked`: every file of `src` a symlink to its copy in `store` (shared storage, a cache), by another name."""
    linked.mkdir()
    store.mkdir(exist_ok=True)
    for f in sorted(src.iterdir()):
        shutil.copy(f, store / f"blob-{f.name}")
        (linked / f.name).symlink_to(store / f"blob-{f.name}")
    return linked


def test_weights_linked_from_elsewhere_load_equal_to_the_files_themselves(base, tmp_path):
    """Shards, index, config and tokenizer linked from another directory, and a single model.safetensors linked
    likewise: followed as transformers and vLLM follow them. Every tensor equals the unlinked load's, and the LLM
    (config and tokenizer read through the links) gives the unlinked one's greedy tokens."""
    from test_cli_run import save_word_tokenizer
    from zoo import LLM, SamplingParams

    single = save_word_tokenizer(save_tiny("LlamaForCausalLM", tmp_path / "single"))
    for src in (base, single):
        linked = linked_copy(src, tmp_path / f"linked-{src.name}", tmp_path / "store")
        assert all((linked / f.name).is_symlink() for f in src.iterdir())
        want, got = api_cpu(str(src)), api_cpu(str(linked))
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        assert LLM(str(linked)).generate(["w1 w2 w3"], params)[0].token_ids == \
            LLM(str(src)).generate(["w1 w2 w3"], params)[0].token_ids
    assert main(["inspect", str(tmp_path / "linked-m")]) == 0


def api_cpu(target: str) -> dict[str, torch.Tensor]:
    """The loader API into transformers' Llama on the CPU (random init first): its state dict after the load."""
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config)
    load(model, target)
    return model.state_dict()


def test_a_valid_hand_written_gguf_reads_back(tmp_path):
    """The hand-written GGUF of the cases above, unmutated: the header walk accepts it, the values read back."""
    path = tmp_path / "model.gguf"
    path.write_bytes(gguf_bytes())
    source = open_source(path)
    assert source.info("model.embed_tokens.weight").shape == (4, 8)
    assert torch.equal(source.get("model.embed_tokens.weight"), torch.arange(32.0).reshape(4, 8))
    assert torch.equal(source.get("model.norm.weight"), torch.arange(8.0))


# -- pickles -------------------------------------------------------------------------------------------------
class Payload:
    """Unpickling this calls os.system: a checkpoint that runs code when loaded."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_payload_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    d = tmp_path / "m"
    d.mkdir()
    torch.save({"model.norm.weight": torch.ones(4), "x": Payload(marker)}, d / "pytorch_model.bin")
    with pytest.raises(LoadError, match="PyTorch pickle weights .*refused"):
        open_source(d)
    with pytest.raises(LoadError):  # opted in: torch.load(weights_only=True) refuses the payload
        open_source(d, allow_bin=True)
    assert main(["inspect", str(d)]) == 2 and main(["inspect", str(d), "--allow-bin"]) in (1, 2)
    assert not marker.exists()


# -- real processes: no traceback on stderr, no hang --------------------------------------------------------
def test_real_processes_refuse_a_fifo_and_a_traversal(base, tmp_path):
    runs = []
    for make, command in ((fifo_shard, ["inspect"]), (traversal, ["run", "--prompt", "w1"])):
        d, out = tmp_path / make.__name__, tmp_path / f"{make.__name__}-outside"
        shutil.copytree(base, d)
        out.mkdir()
        (out / "secret.txt").write_text((SECRET + "\n") * 64)
        target, words = make(d, out)
        runs.append((subprocess.Popen([sys.executable, "-m", "zoo.cli", command[0], target, *command[1:]],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      cwd=Path(__file__).parent.parent), words))
    for proc, words in runs:
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 2, stdout + stderr
        assert "Traceback" not in stderr and SECRET not in stdout + stderr
        assert any(all(w in line for w in words) for line in (stdout + stderr).splitlines()), stdout + stderr
