"""Kernel benchmark: zoo.kernels against torch on SmolLM2-135M's shapes, weights streamed from memory.

    python bench/kernels.py [--threads 2] [--rows 1 4 16 64] [--rounds 5] [--dtype bfloat16]

A decode step uses each weight matrix once, so a GEMV measured on one hot matrix (in cache) says little:
here every pass cycles over 30 layers' distinct matrices (qkv 960x576, o 576x576, gate_up 3072x576,
down 576x1536) and the 49152x576 head, 538 MB in all, as one step of SmolLM2-135M does; once as separate
tensors, once packed end to end (kernels.pack_weights, as the runtime does). Variants run interleaved,
round after round, and each reports its best and median pass (the machine is shared).
Also: the read bandwidth (torch.sum over 1 GiB, as bench/generate.py), and the small ops of one layer.
--dtype bfloat16: the same matrices in bfloat16 (half the bytes; the kernels read them widened, torch's F.linear
computes in bfloat16 on a bfloat16 x).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict

import torch
import torch.nn.functional as F

from zoo import kernels
from zoo.table import print_table

LAYERS = 30
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # [N, K] of qkv, o, gate_up, down
HEAD = (49152, 576)


def bandwidth_gbs() -> float:
    x = torch.ones(1 << 28)
    best = min(_timed(x.sum) for _ in range(5))
    return (1 << 30) / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    if not kernels.enabled():
        print("zoo kernels are off (ZOO_FAST=0) or failed to build", file=sys.stderr)
        return 2
    g = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    weights = [(torch.randn(n, k, generator=g) * 0.02).to(dtype) for _ in range(LAYERS) for n, k in SHAPES]
    weights.append((torch.randn(*HEAD, generator=g) * 0.02).to(dtype))
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    gbs = bandwidth_gbs()
    print(f"threads {args.threads}, torch {torch.__version__}; {len(weights)} {args.dtype} matrices, "
          f"{nbytes / 1e6:.0f} MB; "
          f"read bandwidth {gbs:.1f} GB/s (torch.sum over 1 GiB); floor {nbytes / gbs / 1e6:.1f} ms per pass\n")
    print_table(["machine", "what runs"], kernels.describe().items())
    print()

    # the same matrices packed end to end in reading order (kernels.pack_weights, as the runtime does)
    holder = torch.nn.ParameterList([torch.nn.Parameter(w.clone(), requires_grad=False) for w in weights])
    kernels.pack_weights(holder)
    packed = list(holder)
    torch_linear = F.linear if dtype is torch.float32 else lambda x, w: F.linear(x.to(w.dtype), w)
    variants = {"torch F.linear": (torch_linear, weights), "zoo kernels.linear": (kernels.linear, weights),
                "zoo kernels.linear, packed": (kernels.linear, packed)}
    rows = []
    for m in args.rows:
        xs = {k: torch.randn(m, k, generator=g) for k in {k for _, k in SHAPES}}
        for w in weights[:4]:  # agreement first
            want = F.linear(xs[w.shape[1]], w.float())
            err = (kernels.linear(xs[w.shape[1]], w) - want).abs().max().item()
            assert err < 1e-4 * max(1.0, want.abs().max().item()), f"M={m} {tuple(w.shape)}: error {err}"
        times = defaultdict(list)
        for _ in range(args.rounds):
            for name, (fn, ws) in variants.items():
                times[name].append(_timed(lambda: [fn(xs[w.shape[1]], w) for w in ws]))
        for name, ts in times.items():
            best, med = min(ts), statistics.median(ts)
            rows.append((f"M={m}", name, f"{best * 1e3:.1f}", f"{med * 1e3:.1f}", f"{nbytes / best / 1e9:.1f}",
                         f"{2 * m * nbytes / weights[0].element_size() / best / 1e9:.1f}",
                         f"{nbytes / gbs / 1e6 / (best * 1e3):.0%}"))
    print_table(["rows", "variant", "best ms", "median ms", "GB/s (best)", "GFLOP/s (best)", "of floor"], rows)

    # the small ops of one SmolLM2 layer at T tokens: torch reference vs kernel, microseconds per call
    print()
    small = []
    for t in (1, 16):
        x = torch.randn(t, 576, generator=g)
        w = torch.randn(576, generator=g)
        gu = torch.randn(t, 3072, generator=g)
        pairs = {
            "rms_norm": (lambda: w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)),
                         lambda: kernels.rms_norm(x, w, 1e-5)),
            "silu_mul": (lambda: F.silu(gu[:, :1536]) * gu[:, 1536:], lambda: kernels.silu_mul(gu)),
        }
        for name, (ref, ours) in pairs.items():
            a = min(_timed(lambda: [ref() for _ in range(100)]) for _ in range(5)) / 100
            b = min(_timed(lambda: [ours() for _ in range(100)]) for _ in range(5)) / 100
            small.append((f"T={t}", name, f"{a * 1e6:.1f}", f"{b * 1e6:.1f}"))
    print_table(["tokens", "op", "torch us", "zoo us"], small)
    return 0


if __name__ == "__main__":
    sys.exit(main())
