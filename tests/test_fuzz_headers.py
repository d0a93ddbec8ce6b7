"""Fuzzing the two headers the loader parses (issue 13): a valid safetensors file and a valid GGUF file,
each mutated at random (fixed seed, bounded count), in this process through the loader API and, for a few
of them, through `zoo inspect`.

The properties: the loader raises LoadError or loads (never another exception), every tensor it then
offers reads back with the shape it announced, the message names the file, a case takes well under a
second, and the whole run's peak memory stays bounded (no header makes it allocate what it claims).
"""
from __future__ import annotations

import json
import random
import struct
import time

import pytest
import torch
import transformers

from loader import LoadError, load, open_source
from test_hostile_files import PEAK_BOUND_MB, gguf_bytes, gstr, peak_rss_mb, reset_peak, rss_mb
from tiny import save_tiny
from zoo.cli import main

SEED = 13
CASES = 300  # of each format
CLI_EVERY = 60  # every 60th case also through `zoo inspect` (in-process)
CASE_BOUND_S = 5.0
ODD = [-1, 0, 1, 3, 2 ** 31, 2 ** 63, 2 ** 64, 10 ** 30, 1.5, float("inf"), "x", "F32", "F4", None, True, [],
       {}, [0], [-1, 4], [0, 2 ** 62], [[0]], {"a": 1}]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A one-file tiny Llama (model.safetensors + config.json) and a meta module that fits it."""
    path = save_tiny("LlamaForCausalLM", tmp_path_factory.mktemp("fuzz") / "m", num_hidden_layers=1,
                     hidden_size=16, intermediate_size=24, vocab_size=32)
    return path, transformers.AutoConfig.from_pretrained(path)


def meta_model(config):
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def mutate_safetensors(rng: random.Random, raw: bytes) -> bytes:
    n = int.from_bytes(raw[:8], "little")
    header, data = raw[8:8 + n], raw[8 + n:]
    op = rng.randrange(7)
    if op == 0:  # a few bytes of the header text replaced
        h = bytearray(header)
        for _ in range(rng.randint(1, 4)):
            h[rng.randrange(len(h))] = rng.randrange(256)
        return raw[:8] + bytes(h) + data
    if op == 1:  # the length field lies
        length = rng.choice([0, 1, n - 1, n + 1, len(raw), 2 ** 63, rng.randrange(2 ** 64), 3 << 30])
        return length.to_bytes(8, "little") + raw[8:]
    if op == 2:  # the file ends early, or carries more
        return raw[:rng.randrange(len(raw))] if rng.random() < 0.7 else raw + bytes(rng.randint(1, 64))
    obj = json.loads(header)
    keys = [k for k in obj if k != "__metadata__"]
    key = rng.choice(keys)
    if op == 3:  # one field of one entry set to an odd value, or dropped
        field = rng.choice(["dtype", "shape", "data_offsets"])
        if rng.random() < 0.2:
            del obj[key][field]
        else:
            obj[key][field] = rng.choice(ODD)
    elif op == 4:  # offsets shifted or swapped
        other = rng.choice(keys)
        if rng.random() < 0.5:
            d = rng.choice([-8, -4, -1, 1, 4, 8, 2 ** 40])
            obj[key]["data_offsets"] = [o + d for o in obj[key]["data_offsets"]]
        else:
            obj[key]["data_offsets"], obj[other]["data_offsets"] = obj[other]["data_offsets"], obj[key]["data_offsets"]
    elif op == 5:  # an entry renamed, or one key written twice
        text = json.dumps(obj)
        other = rng.choice(keys)
        text = text.replace(json.dumps(other), json.dumps(key), 1) if rng.random() < 0.5 else \
            text.replace(json.dumps(key), json.dumps(key + "x"), 1)
        new = text.encode()
        return len(new).to_bytes(8, "little") + new + data
    else:  # a shape changed (the bytes no longer fit), or a nesting bomb in a field
        obj[key]["shape"] = [rng.randint(0, 40) for _ in range(rng.randint(0, 3))] if rng.random() < 0.8 else \
            json.loads("[" * 50 + "]" * 50)
        if rng.random() < 0.1:
            new = json.dumps(obj).replace(json.dumps(key), json.dumps(key) + ": " + "[" * 100_000 + "]" * 100_000
                                          + ", " + json.dumps(key + "y"), 1).encode()
            return len(new).to_bytes(8, "little") + new + data
    new = json.dumps(obj).encode()
    return len(new).to_bytes(8, "little") + new + data


def valid_gguf() -> bytes:
    """A GGUF with every part the header walk reads: string, number and array metadata, F32 / F16 / Q8_0
    tensors, Llama q/k rows that the head counts split."""
    u32 = lambda v: struct.pack("<I", v)  # noqa: E731
    kv = [(b"general.architecture", 8, gstr("llama")), (b"llama.attention.head_count", 4, u32(2)),
          (b"llama.attention.head_count_kv", 4, u32(1)), (b"general.alignment", 4, u32(32)),
          (b"llama.rope.freq_base", 6, struct.pack("<f", 1e4)),
          (b"tokenizer.ggml.tokens", 9, u32(8) + struct.pack("<Q", 3) + gstr("a") + gstr("bc") + gstr("")),
          (b"tokenizer.ggml.token_type", 9, u32(5) + struct.pack("<Q", 3) + struct.pack("<3i", 1, 1, 3))]
    rng = random.Random(0)
    q8 = b"".join(struct.pack("<e", 0.01) + bytes(rng.randrange(256) for _ in range(32)) for _ in range(2))
    tensors = [("blk.0.attn_q.weight", [4, 8], 0, struct.pack("<32f", *range(32))),
               ("blk.0.attn_k.weight", [4, 4], 1, struct.pack("<16e", *range(16))),
               ("token_embd.weight", [32, 2], 8, q8),
               ("output_norm.weight", [4], 0, struct.pack("<4f", 1, 2, 3, 4))]
    return gguf_bytes(kv=kv, tensors=tensors)


def mutate_gguf(rng: random.Random, raw: bytes, header_end: int) -> bytes:
    b = bytearray(raw)
    op = rng.randrange(4)
    if op == 0:  # bytes of the header replaced
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(header_end)] = rng.randrange(256)
    elif op == 1:  # a count, length, dim, type or offset (any 4-aligned word of the header) lies
        at = rng.randrange(4, header_end - 8) & ~3
        value = rng.choice([0, 1, 2, 5, 9, 31, 2 ** 31, 2 ** 32 - 1, 2 ** 63, 2 ** 64 - 1, rng.randrange(2 ** 64)])
        b[at:at + 8] = value.to_bytes(8, "little")
    elif op == 2:  # the file ends early
        del b[rng.randrange(len(b)):]
    else:  # anything anywhere (data bytes included: NaN scales, odd quants)
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
    return bytes(b)


def outcome(fn, *where: str):
    """'ok' or 'refused' (a LoadError naming the file or its directory); anything else fails."""
    t0 = time.perf_counter()
    try:
        fn()
        result = "ok"
    except LoadError as e:
        assert any(w in str(e) for w in where), f"the error names none of {where}: {e}"
        result = "refused"
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"{type(e).__name__} (not LoadError): {e}")
    assert time.perf_counter() - t0 < CASE_BOUND_S
    return result


def test_fuzzed_safetensors_headers(small, tmp_path, capsys):
    path, config = small
    good = (path / "model.safetensors").read_bytes()
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_bytes((path / "config.json").read_bytes())
    rng = random.Random(SEED)
    model = meta_model(config)
    measured, before = reset_peak(), rss_mb()
    seen = {"ok": 0, "refused": 0}
    for i in range(CASES):
        (d / "model.safetensors").write_bytes(mutate_safetensors(rng, good))
        seen[outcome(lambda: load(model, d, check_finite=True), "model.safetensors", str(d))] += 1
        if i % CLI_EVERY == 0:
            assert main(["inspect", str(d)]) in (0, 1, 2)
            assert "Traceback" not in "".join(capsys.readouterr())
    if measured:
        assert peak_rss_mb() - before < PEAK_BOUND_MB
    assert seen["refused"] > CASES // 2 and seen["ok"] > 0, seen  # the mutations reach both ends


def test_fuzzed_gguf_headers(tmp_path, capsys):
    good = valid_gguf()
    header_end = good.index(struct.pack("<32f", *range(32)))  # the first tensor's data starts the data section
    path = tmp_path / "model.gguf"
    path.write_bytes(good)
    source = open_source(path)  # the unmutated file reads back
    assert torch.equal(source.get("model.norm.weight"), torch.tensor([1.0, 2, 3, 4]))
    assert source.info("model.embed_tokens.weight").shape == (2, 32)
    rng = random.Random(SEED)
    measured, before = reset_peak(), rss_mb()
    seen = {"ok": 0, "refused": 0}

    def read_all():
        s = open_source(path)
        for key in s.keys():
            assert tuple(s.get(key).shape) == s.info(key).shape, key

    for i in range(CASES):
        path.write_bytes(mutate_gguf(rng, good, header_end))
        seen[outcome(read_all, "model.gguf")] += 1
        if i % CLI_EVERY == 0:
            assert main(["inspect", str(path)]) in (0, 1, 2)
            assert "Traceback" not in "".join(capsys.readouterr())
    if measured:
        assert peak_rss_mb() - before < PEAK_BOUND_MB
    assert seen["refused"] > CASES // 3 and seen["ok"] > 0, seen
