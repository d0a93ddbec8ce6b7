"""Pass/fail thresholds per model family, overridable from the command line (`--tol key=value`).

Both sides run float32; what separates them is the order of floating-point operations (paged vs eager
attention, fused vs separate projections, grouped vs per-expert MoE). That costs ~1e-6 relative per
layer in a dense model; the defaults leave two orders of magnitude above that and stay far below what
any real bug produces (a wrong rotary half, an eps, a swapped projection: 1e-3 and up).
MoE, MLA, SSM and multimodal get more room: a near-tie in a router can pick another expert for one
token, absorbed MLA and chunked scans reorder more arithmetic.

A GGUF run with its blocks kept quantized (`quantized=True`) is judged with QUANTIZED (below), stated apart.

Keys:
    rel_l2       max relative L2 error of any tap row                      (||zoo - ref|| / ||ref||)
    cosine       min cosine similarity of any tap row
    kl_max       max KL(ref || zoo) of the logits at any position, nats
    kl_mean      mean KL over positions
    top1         min fraction of decisive positions whose top-1 token agrees
    top1_margin  a position is decisive when the reference's top-2 logit gap exceeds this
    experts      min fraction of the reference's chosen experts the zoo also chose (MoE routers)
    packing      max relative L2 between one prompt alone and packed with others (zoo vs zoo)
"""
from __future__ import annotations

BASE = {
    "rel_l2": 1e-4,
    "cosine": 1 - 1e-6,
    "kl_max": 1e-6,
    "kl_mean": 1e-7,
    "top1": 1.0,
    "top1_margin": 1e-3,
    "experts": 1.0,
    "packing": 1e-4,
}

FAMILY = {
    "dense": {},
    "moe": {"rel_l2": 1e-3, "cosine": 1 - 1e-5, "kl_max": 1e-5, "kl_mean": 1e-6, "experts": 0.95, "packing": 1e-3},
    "mla": {"rel_l2": 1e-3, "cosine": 1 - 1e-5, "kl_max": 1e-5, "kl_mean": 1e-6, "experts": 0.95, "packing": 1e-3},
    "multimodal": {"rel_l2": 1e-3, "cosine": 1 - 1e-5, "kl_max": 1e-5, "kl_mean": 1e-6, "packing": 1e-3},
    "hybrid-ssm": {"rel_l2": 1e-3, "cosine": 1 - 1e-5, "kl_max": 1e-5, "kl_mean": 1e-6, "packing": 1e-3},
}


# The zoo side on a GGUF's blocks kept quantized (`zoo parity x.gguf`, as `zoo run` runs it) against transformers'
# dequantized float32 model: the block kernels dequantize in registers and accumulate in float32, so both sides
# compute float32 math on the same values, in another summation order. Stated on their own (a loosening only:
# the family's looser bounds stay). Measured on the embedded SmolLM2-135M Q4_1 file, 30 layers, all six
# scenarios: worst rel_l2 7.5e-6, KL max 6.4e-11, top-1 100% (dequantized to float32: the same orders); on the
# tiny Q4_1 GGUF of tests/test_parity_quant.py: rel_l2 1.3e-6, KL max 3.7e-14. So the float32 bounds hold as they
# are; integer (VNNI) kernels, which round the activations, would need their own.
QUANTIZED = {k: BASE[k] for k in ("rel_l2", "cosine", "kl_max", "kl_mean", "top1", "packing")}
LOOSER_IS_LOWER = ("cosine", "top1", "experts")  # lower bounds: loosening takes the smaller value


def tolerances(family: str, overrides: dict[str, float] | None = None, *, quantized: bool = False) -> dict[str, float]:
    if family not in FAMILY:
        raise ValueError(f"unknown family {family!r}; one of {', '.join(FAMILY)}")
    tol = {**BASE, **FAMILY[family]}
    if quantized:  # the quantized bounds, where looser than the family's
        tol = {k: v if k not in QUANTIZED else min(v, QUANTIZED[k]) if k in LOOSER_IS_LOWER else max(v, QUANTIZED[k])
               for k, v in tol.items()}
    for key, value in (overrides or {}).items():
        if key not in tol:
            raise ValueError(f"--tol {key}: unknown key; known: {', '.join(tol)}")
        tol[key] = float(value)
    return tol


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
