"""Triton kernels for the device path (CUDA): paged attention (zoo/kernels/triton/attention.py) and the MoE
experts' grouped GEMM (zoo/kernels/triton/moe.py). Triton is imported only when a kernel runs on a device
tensor, so the CPU runtime never needs it; each kernel's pure-torch reference stays the CPU path:

    kernel                        reference (the CPU path)
    attention.paged_attention     zoo.layers.attention.Attention's torch loop over requests
    moe.grouped_gemm              grouped_gemm_ref below (the per-expert loop of zoo.layers.moe)

`use(t)`: whether a layer should call the Triton kernel for tensor t (on CUDA, Triton importable).
tests/test_triton_kernels.py runs the kernels under TRITON_INTERPRET=1 on CPU tensors against the references.
"""
from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F


@functools.cache
def missing() -> str | None:
    """Why the Triton kernels cannot run (None: they can)."""
    if importlib.util.find_spec("triton") is None:  # (found, not imported: TRITON_INTERPRET is read at import)
        return "triton is not installed (pip install triton)"
    return None


def use(t: torch.Tensor) -> bool:
    """Take the Triton kernel for t: on a CUDA device with Triton installed (else the torch reference)."""
    return t.is_cuda and missing() is None


def paged_attention(*args, **kwargs) -> torch.Tensor:
    from zoo.kernels.triton.attention import paged_attention as kernel

    return kernel(*args, **kwargs)


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [A, K] sorted by expert, w [E, N, K], offsets [E+1] -> [A, N]: Triton on CUDA, else the reference."""
    if use(x):
        from zoo.kernels.triton.moe import grouped_gemm as kernel

        return kernel(x, w, offsets)
    from zoo.kernels import host_sync

    with host_sync.allow():  # (the reference reads the offsets; the kernel it stands for does not)
        return grouped_gemm_ref(x, w, offsets)


def grouped_gemm_ref(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The torch reference: each expert's contiguous rows times its weight (reads the offsets on the host)."""
    y = x.new_empty(x.shape[0], w.shape[1])  # [A, N]
    bounds = offsets.tolist()
    for e in range(w.shape[0]):
        s, t = bounds[e], bounds[e + 1]
        if t > s:
            y[s:t] = F.linear(x[s:t], w[e])
    return y
