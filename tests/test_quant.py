"""GGUF weights kept block-quantised (loader/quant.py, cpu.cpp's block kernels): strict loading, kernels equal
to the gguf package's dequantiser, and quantised models equal to the same file dequantised to float32.

The GGUF files are written by the `gguf` package from a tiny transformers Llama (tests/quant_gguf.py); the
oracle for what a block means is gguf.quants.dequantize. Runs on both paths (the native kernels, and torch:
dequantise, then F.linear).
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers

from batching import random_prompts, run_schedule
from kernel_paths import ops  # noqa: F401
from loader import LoadError
from loader.gguf import GGUFSource
from loader.quant import QUANT_TYPES, QuantLayout, layout_for
from quant_gguf import write_gguf
from tiny import tiny_config
from zoo import LLM, SamplingParams, kernels
from zoo.build import build_model
from zoo.runtime.engine import LLMEngine

CASES = {  # name -> (types by GGUF tensor short name, "" = the rest; tied head)
    "Q8_0": ({"": "Q8_0"}, True),
    "Q4_1": ({"": "Q4_1", "token_embd": "Q8_0"}, True),  # the embedded default's types
    "Q4_K": ({"": "Q4_K", "attn_v": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q4_0"}, False),  # a mixed q/k/v
}
ATOL = 1e-4  # float32 math on identical dequantised values: only the summation order differs


def _config(tied: bool):
    return tiny_config("LlamaForCausalLM", vocab_size=512, hidden_size=256, intermediate_size=512,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    out = {}
    for name, (types, tied) in CASES.items():
        config = _config(tied)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).eval()
        out[name] = (write_gguf(model, config, tmp_path_factory.mktemp(name) / "m.gguf", types), config)
    return out


def _build(path, config, quantized: bool):
    return build_model(GGUFSource(path, quantized=quantized), config=config, quantized=quantized)


def _random_blocks(qtype, rows: int, cols: int, rng) -> torch.Tensor:
    """Random block bytes with finite scales of a realistic size."""
    n = rows * cols // qtype.block
    raw = rng.integers(0, 256, size=(n, qtype.block_bytes), dtype=np.uint8)
    for at in qtype.scales:
        raw[:, at:at + 2] = rng.uniform(-0.05, 0.05, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    return torch.from_numpy(raw.reshape(-1).copy())


@pytest.fixture
def float_math():
    """The block GEMV on float32 math for every type (the default rounds Q4_0 / Q4_1 / Q8_0's x to int16)."""
    was = kernels.set_activation_bits(0)
    yield
    kernels.set_activation_bits(was)


@pytest.mark.parametrize("code", sorted(QUANT_TYPES))
def test_block_kernels_equal_the_gguf_dequantiser(code, float_math):
    qtype, rng = QUANT_TYPES[code], np.random.default_rng(code)
    rows, cols = 70, 512 if qtype.block == 256 else 544  # (an odd count of 32-blocks: the GEMV's alternating tail)
    w = _random_blocks(qtype, rows, cols, rng)
    w.quant = QuantLayout((rows, cols), ((0, rows, qtype),))
    ref = w.quant.dequantize(w)  # gguf.quants.dequantize
    with torch.no_grad():
        assert torch.equal(kernels.qembed(torch.arange(rows).flip(0), w), ref.flip(0))  # gathered rows: exact
        for m in (1, 2, 3, 4, 7, 20):  # GEMV (M <= 4: 1, 2, 3 or 4 rows per weight row) and the dequantised-panel GEMM
            x, b = torch.randn(m, cols), torch.randn(rows)
            want = torch.nn.functional.linear(x.double(), ref.double(), b.double())
            err = (kernels.qlinear(x, w, b).double() - want).abs().max() / want.abs().max()
            assert err < 1e-6, (qtype.name, m, float(err))


def test_a_weight_of_row_segments_of_different_types():
    rng = np.random.default_rng(1)
    k4, k6 = QUANT_TYPES[12], QUANT_TYPES[14]
    w = torch.cat([_random_blocks(k4, 32, 256, rng), _random_blocks(k6, 16, 256, rng)])
    w.quant = layout_for((48, 256), [(32, 48, k6), (0, 32, k4)])
    assert str(w.quant) == "Q4_K[0:32]+Q6_K[32:48] [48, 256]"
    ref = w.quant.dequantize(w)
    with torch.no_grad():
        for m in (1, 9):
            x = torch.randn(m, 256)
            want = x.double() @ ref.double().T
            assert (kernels.qlinear(x, w).double() - want).abs().max() / want.abs().max() < 1e-6


@pytest.mark.parametrize("case", list(CASES))
def test_quantized_gguf_loads_strictly_and_matches_the_dequantized_model(files, case, ops):
    path, config = files[case]
    model, _, _, report = _build(path, config, quantized=True)
    reference, _, _, _ = _build(path, config, quantized=False)
    types, tied = CASES[case]
    # every matrix kept as blocks, with the type the file holds; norms stay float32
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype is torch.uint8 and layer.input_layernorm.weight.dtype is torch.float32
    assert len(report.quantized) == 1 + 4 * config.num_hidden_layers + (not tied)
    assert report.quantized["model.embed_tokens.weight"].startswith(types.get("token_embd", types[""]))
    if case == "Q4_K":
        assert report.quantized["model.layers.0.self_attn.qkv_proj.weight"] == "Q4_K[0:384]+Q6_K[384:512] [512, 256]"
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert sum(p.numel() for p in model.parameters() if p.dtype is torch.uint8) * 3 < \
        sum(p.numel() * 4 for p in reference.parameters())  # the blocks, not float32
    prompts = random_prompts([5, 11, 2], vocab=config.vocab_size, seed=3)
    steps = [[(0, 5), (1, 11), (2, 2)], [(0, 1), (1, 1), (2, 1)], [(1, 1)]]  # prefill, decode (GEMV), one row
    prompts = [p + random_prompts([2], vocab=config.vocab_size, seed=4)[0] for p in prompts]
    got, want = run_schedule(model, prompts, steps), run_schedule(reference, prompts, steps)
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            assert (a - b).abs().max() < ATOL


def test_fused_step_on_quantized_weights_gives_the_module_path_tokens(files):
    path, config = files["Q4_K"]
    prompts = random_prompts([7, 3, 12], vocab=config.vocab_size, seed=5)
    runs = {}
    for name, quantized in (("quantized", True), ("float32", False)):
        model, config, _, _ = _build(path, config, quantized)
        engine = LLMEngine(model, config, None, num_blocks=64, block_size=4)
        runs[name] = engine
        out = LLM.from_engine(engine).generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        runs[name] = [o.token_ids for o in out], engine.runner.step_path
    assert runs["quantized"][1].startswith("fused native step") or not kernels.enabled()
    assert runs["quantized"][0] == runs["float32"][0]


def test_an_unsupported_type_is_refused_naming_the_tensor_unless_dequantized(tmp_path):
    config = _config(True)
    torch.manual_seed(0)
    path = write_gguf(transformers.LlamaForCausalLM(config).eval(), config, tmp_path / "q5.gguf",
                      {"": "Q8_0", "attn_q": "Q5_0"})
    with pytest.raises(LoadError) as e:
        _build(path, config, quantized=True)
    text = str(e.value)
    assert "blk.0.attn_q.weight" in text and "Q5_0" in text and "--dtype float32" in text
    model, _, _, report = _build(path, config, quantized=False)  # dequantized on request: loads
    assert not report.quantized and model.model.layers[0].self_attn.qkv_proj.weight.dtype is torch.float32


def test_blocks_into_a_float_only_layer_or_with_a_nan_scale_are_findings(files, tmp_path):
    path, config = files["Q8_0"]
    source = GGUFSource(path, quantized=True)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)  # transformers' own Linear: float weights only
    with pytest.raises(LoadError) as e:
        from loader import load

        load(model, source)
    assert "kept quantized" in str(e.value) and "model.layers.0.self_attn.q_proj.weight" in str(e.value)
    raw = bytearray(path.read_bytes())  # the first block's f16 scale of token_embd -> Inf
    at = source._tensors["model.embed_tokens.weight"][2]
    raw[at:at + 2] = np.float16(np.inf).tobytes()
    bad = tmp_path / "nan.gguf"
    bad.write_bytes(bytes(raw))
    with pytest.raises(LoadError) as e:
        _build(bad, config, quantized=True)
    assert "nonfinite" in str(e.value) and "model.embed_tokens.weight" in str(e.value)


# -- int8 / int16 activations (cpu.cpp's "int8 activations", "int16 activations": decode GEMV, M <= 4, Q4_0 / Q4_1 /
# Q8_0) ---------------------------------------------------------------------------------------------------------

def _int8_reference(x: torch.Tensor, w: torch.Tensor, qtype, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor,
                                                                                      torch.Tensor]:
    """(y, the scale of each term of y's sum, dx [M, K / 32]) of the int8 (int16) path computed in torch: x quantised
    per 32 as the kernel does (dx = max|x| / 127 (32767), qx = round(x / dx) to nearest even, sx = dx sum qx), the
    blocks' integers read from their bytes, y = sum over blocks (dw dx) sum qw qx + mw sx in float64."""
    m, k = x.shape
    blocks = x.view(m, k // 32, 32)
    dx = blocks.abs().amax(-1) / (2 ** (bits - 1) - 1)
    inv = torch.where(dx != 0, 1 / dx, torch.zeros_like(dx))
    qx = torch.round(blocks * inv[..., None])
    sx = dx * qx.sum(-1)
    raw = w.view(-1, qtype.block_bytes)
    dw = raw[:, 0:2].contiguous().view(torch.float16).float().view(-1)
    if qtype.name == "Q8_0":
        qw, mw = raw[:, 2:].contiguous().view(torch.int8).float(), torch.zeros_like(dw)
    else:
        qs = raw[:, 4 if qtype.name == "Q4_1" else 2:].int()
        qw = torch.cat([qs & 15, qs >> 4], 1).float()
        mw = raw[:, 2:4].contiguous().view(torch.float16).float().view(-1) if qtype.name == "Q4_1" else -8 * dw
    n = raw.shape[0] * 32 // k
    qw, dw, mw = qw.view(n, k // 32, 32), dw.view(n, k // 32), mw.view(n, k // 32)
    idot = torch.einsum("mbl,nbl->mnb", qx.double(), qw.double())  # exact integers
    terms = (dw[None] * dx[:, None]).double() * idot + mw[None].double() * sx[:, None].double()
    return terms.sum(-1), terms.abs().sum(-1), dx


@pytest.fixture(params=[8, 16])
def int_bits(request):
    if not kernels.enabled():
        pytest.skip("native kernels off: the integer paths are native only")
    was = kernels.set_activation_bits(request.param)
    yield request.param
    kernels.set_activation_bits(was)


@pytest.mark.parametrize("code", [2, 3, 8])
def test_int8_activations_equal_their_torch_reference_and_stay_within_the_rounding_bound(code, int_bits):
    """The kernel (int8, then int16 activations) against (1) the same integers and scales computed in torch (float32
    rounding apart), and (2) float32 math on the dequantised weights, within the stated bound of x's rounding:
    |y - w . x| <= sum_k |w_k| dx(k) / 2, dx = max|x| / 127 (int8) or / 32767 (int16) per 32. Odd sizes (17 blocks
    of 32, 70 rows), M = 1..4, 1 and 2 threads equal; a corrupted block scale breaks (2)."""
    qtype, rng = QUANT_TYPES[code], np.random.default_rng(code)
    torch.manual_seed(code)  # (x drawn the same every run)
    rows, cols = 70, 544
    w = _random_blocks(qtype, rows, cols, rng)
    w.quant = QuantLayout((rows, cols), ((0, rows, qtype),))
    deq = w.quant.dequantize(w).double()
    n = torch.get_num_threads()
    with torch.no_grad():
        for m in (1, 2, 3, 4):
            x = torch.randn(m, cols) * torch.linspace(0.1, 3, cols)  # blocks of different scales
            want, size, dx = _int8_reference(x, w, qtype, int_bits)
            torch.set_num_threads(1)
            one = kernels.qlinear(x, w)
            torch.set_num_threads(max(2, n))
            got = kernels.qlinear(x, w)
            torch.set_num_threads(n)
            assert torch.equal(one, got), (qtype.name, m)  # any thread count: the same bits
            assert ((got.double() - want).abs() <= 1e-6 * size + 1e-30).all(), (qtype.name, m)
            bound = deq.abs() @ dx.double().repeat_interleave(32, 1).T / 2  # [N, M]: x's rounding, at most dx / 2
            err = (got.double() - x.double() @ deq.T).abs()
            slack = (1e-5 if int_bits == 8 else 1e-6) * (x.double().abs() @ deq.abs().T)  # float32 rounding
            assert (err <= bound.T + slack).all(), (qtype.name, m, float((err - bound.T).max()))
            assert err.max() > 0.02 * bound.max()  # (the bound is not vacuous: x's rounding shows; random
            # rounding errors add up as sqrt(K) where the bound adds K: measured 0.04-0.1 of it)
            if int_bits == 16:  # (and int16 is no int8: 100x under the int8 bound)
                assert (err <= _int8_reference(x, w, qtype)[2].double().repeat_interleave(32, 1) @ deq.abs().T
                        / 200 + slack).all()
        bad = w.clone()  # a mutant: every block scale of rows 0..9 doubled (a wrong scale read)
        scales = bad.view(rows, -1, qtype.block_bytes)[:10, :, 0:2]
        scales.copy_((scales.contiguous().view(torch.float16) * 2).view(torch.uint8))
        bad.quant = w.quant
        x = torch.randn(1, cols)
        _, _, dx = _int8_reference(x, w, qtype, int_bits)
        err = (kernels.qlinear(x, bad).double() - x.double() @ deq.T).abs()[0]
        slack = (1e-5 if int_bits == 8 else 1e-6) * (deq.abs() @ x.double().abs()[0])
        bound = deq.abs() @ dx.double().repeat_interleave(32, 1)[0] / 2 + slack
        assert (err[:10] > bound[:10]).any() and (err[10:] <= bound[10:]).all()


def test_int8_activations_over_row_segments_and_only_for_few_rows(int_bits):
    """A weight of a Q4_1 and a Q8_0 segment (the path per segment); M = 5 keeps float32 math (the panel GEMM)."""
    rng = np.random.default_rng(7)
    q41, q80 = QUANT_TYPES[3], QUANT_TYPES[8]
    w = torch.cat([_random_blocks(q41, 20, 96, rng), _random_blocks(q80, 12, 96, rng)])
    w.quant = layout_for((32, 96), [(0, 20, q41), (20, 32, q80)])
    ref = w.quant.dequantize(w).double()
    with torch.no_grad():
        x = torch.randn(2, 96)
        got = kernels.qlinear(x, w).double()
        want = torch.cat([_int8_reference(x, w[:20 * 3 * 20], q41, int_bits)[0],
                          _int8_reference(x, w[20 * 3 * 20:], q80, int_bits)[0]], 1)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
        x5 = torch.randn(5, 96)
        assert (kernels.qlinear(x5, w).double() - x5.double() @ ref.T).abs().max() < 1e-5 * (x5.abs().sum())


def test_the_activation_setting_is_checked_where_it_is_given():
    with pytest.raises(ValueError, match="bits must be 0, 8 or 16, got True"):
        kernels.set_activation_bits(True)
    assert kernels.activation_bits() == int(os.environ.get("ZOO_QUANT_ACT", "16"))  # (the default: int16)
    bad = subprocess.run([sys.executable, "-c", "import zoo.kernels"], env={**os.environ, "ZOO_QUANT_ACT": "4"},
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "ZOO_QUANT_ACT='4': one of 16, 8, 0" in bad.stderr
