"""Pass/fail thresholds per model family, overridable from the command line (`--tol key=value`).

Both sides run float32; what separates them is the order of floating-point operations (paged vs eager
attention, fused vs separate projections, grouped vs per-expert MoE, chunked vs sequential scans, rank-split sums).
Each family's bounds are set from what correct models measure (`python bench/parity_baselines.py --seeds 4 --wide
--real --tp 2 --device-path`: every registered architecture's tiny checkpoint, seeds 0-3, on the CPU path, the
device path and two tensor-parallel ranks; six families at 8 layers and hidden 1024; the embedded SmolLM2-135M, 30
layers, dequantised; the multimodal image scenarios on transformers' default LLaVA and Qwen2-VL configs, four image
sets): the worst of each key over all of them, times 10 for the quantities linear in the error (rel_l2, packing,
ssm_local) and 100 for the quadratic ones (1 - cosine, KL), rounded up to one significant digit. The factor covers
what the measured models lack: float32 error grows about as sqrt(depth x width), ~4x from 8 layers of 1024 to a
32-layer, 4096-wide model, leaving ~2.5x. A real bug is far above (a wrong rotary half, a swapped projection, a
dropped bias: 1e-3 and up); an eps or multiplier too small to show is a built constant (parity/constants.py).

    family       rel_l2 measured (worst at)                     bound   KL max measured   bound
    dense        9.7e-6 (Llama, 8 layers x 1024, TP=2, prefix)  1e-4    7.0e-11 (SmolLM2)  7e-9
    moe          2.3e-5 (Mixtral, 8 x 1024, prefix)             3e-4    2.2e-10 (Mixtral)  3e-8
    mla          1.1e-5 (DeepSeek-V3, 8 x 1024, prefix)         2e-4    2.9e-11            3e-9
    multimodal   8.5e-6 (Qwen2-VL images, processors)           1e-4    1.3e-10 (Qwen2-VL) 2e-8
    hybrid-ssm   1.2e-4 (Jamba tiny, device path, chunked)      2e-3    3.5e-10 (Jamba)    4e-8
The multimodal models' language models are dense ones: their set takes the dense measurements too. The hybrid
bound is Jamba's: its tiny checkpoint's reference disagrees with itself by as much (transformers' cached decode
against its own one forward: 1.2e-4, tests/test_hybrid.py), where Mamba2 and Bamba measure <= 3.5e-6; `ssm_local`
holds a recurrent mixer's own error tighter. MoE and MLA keep `experts` at 95%: a near-tie in a router may pick
another expert for a token (random weights never did).

A GGUF run with its blocks kept quantized (`quantized=True`) is judged with QUANTIZED (below), stated apart; a
bfloat16 run (`bfloat16=True`: the zoo's CPU bfloat16 storage against transformers float32 on the same values, its
cache reads rounded as the zoo's cache rounds them; parity/bfloat16.py) with BFLOAT16.

Keys:
    rel_l2       max relative L2 error of any tap row                      (||zoo - ref|| / ||ref||)
    cosine       min cosine similarity of any tap row
    kl_max       max KL(ref || zoo) of the logits at any position, nats
    kl_mean      mean KL over positions
    top1         min fraction of decisive positions whose top-1 token agrees
    top1_margin  a position is decisive when the reference's top-2 logit gap exceeds this
    experts      min fraction of the reference's chosen experts the zoo also chose (MoE routers)
    packing      max relative L2 between one prompt alone and packed with others (zoo vs zoo)
    ssm_local    (hybrid models) the bound of a recurrent mixer tap's own added error in localisation: nothing in
                 a mixer is rounded, even in a bfloat16 run (its states, conv and scan stay float32 on both sides),
                 so its own error is float32's however much it inherits (measured 1.2e-5 float32, 6.5e-5 bfloat16:
                 Jamba, seeds 0-3); a mixer input rounded to bfloat16 adds 1.3e-3 to 2.2e-3 there and is named at
                 the mixer, not downstream
"""
from __future__ import annotations

BASE = {
    "rel_l2": 1e-4,
    "cosine": 1 - 5e-9,
    "kl_max": 7e-9,
    "kl_mean": 3e-9,
    "top1": 1.0,
    "top1_margin": 1e-3,
    "experts": 1.0,
    "packing": 4e-5,
}

FAMILY = {  # measured worst x 10 (linear) or x 100 (quadratic), above
    "dense": {},
    "moe": {"rel_l2": 3e-4, "cosine": 1 - 3e-8, "kl_max": 3e-8, "kl_mean": 9e-9, "experts": 0.95, "packing": 9e-5},
    "mla": {"rel_l2": 2e-4, "cosine": 1 - 6e-9, "kl_max": 3e-9, "kl_mean": 3e-9, "experts": 0.95, "packing": 3e-5},
    "multimodal": {"kl_max": 2e-8, "kl_mean": 2e-8},
    "hybrid-ssm": {"rel_l2": 2e-3, "cosine": 1 - 5e-7, "kl_max": 4e-8, "kl_mean": 5e-9, "packing": 8e-5,
                   "ssm_local": 7e-4},
}


# The zoo side on a GGUF's blocks kept quantized (`zoo parity x.gguf`, as `zoo run` runs it) against transformers'
# dequantized float32 model. The decode GEMV of Q4_0 / Q4_1 / Q8_0 blocks rounds x to int16 per 32 values
# (kernels.set_activation_bits: |error| <= sum |w| dx / 2, dx = max|x| / 32767, cpu.cpp's "int16 activations");
# everything else is float32 math on the same values in another summation order. Stated on their own (a
# loosening only: the family's looser bounds stay), ~4x over what was measured on the embedded SmolLM2-135M Q4_1
# file (30 layers, all six scenarios, int16: worst rel_l2 3.2e-4 in decode, 5.0e-4 in packing (alone = int16 GEMV,
# packed = float32 panels), KL max 2.7e-7, mean 4.8e-8, top-1 100%; float32 math, ZOO_QUANT_ACT=0: rel_l2 7.5e-6,
# KL max 6.4e-11); int8 activations (ZOO_QUANT_ACT=8, top-1 97% on that file) are outside these bounds by design.
QUANTIZED = {"rel_l2": 2e-3, "cosine": 1 - 1e-5, "kl_max": 1e-6, "kl_mean": 2e-7, "top1": 1.0, "packing": 2e-3}

# The zoo's CPU bfloat16 path (`zoo parity MODEL --dtype bfloat16`) against transformers float32 on the same weights,
# its k and v rounded to bfloat16 where its attention reads them (parity/bfloat16.py). Both compute in float32, but a
# sum in another order now and then lands a k or v value on the other side of a bfloat16 rounding step (2^-8 of it),
# and the cache's rounding compounds what differs: a difference d in a layer's input rounds ~d / 2^-8 of its k and v
# values the other way, ~sqrt(d * 2^-8) in its output, so layer after layer the rows part towards bfloat16's step.
# Measured (worst row of any tap, every scenario), the tiny checkpoint of every architecture (seed 0; seeds 1-3 for
# twelve of them) from bfloat16 files and from float32 files (the rounded copy): rel_l2 6.4e-3 (Jamba, Bamba: an SSM
# mixer after a flipped value; 2.6e-3 in the other families), 1 - cosine 2.0e-5, KL max 7.3e-6, mean 2.5e-7, packing
# 6.4e-3, top-1 and experts 100%; SmolLM2-135M (30 layers; the embedded GGUF's weights saved as bfloat16 and as
# float32 safetensors: the same figures to the bit), where the compounding shows (layer 0 6.6e-7, layer 2 1.7e-3,
# layers 9-29 1e-3 to 1.4e-2; its float32 parity <= 6e-6): rel_l2 1.4e-2, 1 - cosine 5.1e-5, KL max 2.8e-5, mean
# 6.8e-6, packing 4.4e-3, top-1 100%, logits up to 0.06 apart. The bounds are ~4x over the worst of both. Past the
# layers the compounding reaches they admit a bfloat16 rounding of an activation: tests/test_parity_bf16.py plants one
# (the embedding's rows left bfloat16: 1.6e-3 at layer 0's norm, 2e-2 to 5e-2 by layer 1, KL mean 4e-5 to 3e-3 on the
# tiny models, which fails 27 of the 30 architectures, by cosine and KL; on SmolLM2 KL mean 1.9e-5 to 2.9e-5, inside
# them); so in a deep model they catch a wrong layer, not a stray rounding: float32 parity is the fine check.
# top1_margin: a near-tie closer than the logits' spread is not decisive.
BFLOAT16 = {"rel_l2": 6e-2, "cosine": 1 - 2e-4, "kl_max": 1.2e-4, "kl_mean": 3e-5, "top1_margin": 0.25, "packing": 2e-2}
LOOSER_IS_LOWER = ("cosine", "top1", "experts")  # lower bounds: loosening takes the smaller value


def tolerances(family: str, overrides: dict[str, float] | None = None, *, quantized: bool = False,
               bfloat16: bool = False) -> dict[str, float]:
    if family not in FAMILY:
        raise ValueError(f"unknown family {family!r}; one of {', '.join(FAMILY)}")
    tol = {**BASE, **FAMILY[family]}
    for loosening in [QUANTIZED] * quantized + [BFLOAT16] * bfloat16:  # where looser than the family's
        tol = {k: v if k not in loosening else min(v, loosening[k]) if k in LOOSER_IS_LOWER else max(v, loosening[k])
               for k, v in tol.items()}
    for key, value in (overrides or {}).items():
        if key not in tol:
            raise ValueError(f"--tol {key}: unknown key; known: {', '.join(tol)}")
        tol[key] = float(value)
    return tol


def tolerance_set(family: str, *, quantized: bool = False, bfloat16: bool = False) -> str:
    """The name of the set `tolerances` takes: 'dense', 'moe + QUANTIZED', 'mla + BFLOAT16' ..."""
    return " + ".join([family] + ["QUANTIZED"] * quantized + ["BFLOAT16"] * bfloat16)


def parse_overrides(items: list[str] | None) -> dict[str, float]:
    """['rel_l2=1e-3', 'kl_max=1e-5'] -> {'rel_l2': 0.001, 'kl_max': 1e-05}; errors name the item."""
    out = {}
    for item in items or []:
        for part in item.split(","):
            key, sep, value = part.partition("=")
            if not sep or not key.strip():
                raise ValueError(f"--tol {part!r}: expected key=value, e.g. rel_l2=1e-3")
            try:
                out[key.strip()] = float(value)
            except ValueError:
                raise ValueError(f"--tol {part!r}: {value!r} is not a number") from None
    return out
