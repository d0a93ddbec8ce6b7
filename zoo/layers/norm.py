"""Norms over the last dim, in float32, as transformers computes them.

Shape legend:
    ... = any leading dims (T tokens, or T x heads for q/k norm)    D = normalised dim

    RMSNorm           w * rms(x), rms(x) cast to x's dtype before the weight (Llama)
    RMSNormF32Weight  (w * rms(x)) in float32, cast after the weight (OLMo-2)
    GemmaRMSNorm      rms(x) * (1 + w) in float32 (Gemma; the checkpoint stores w - 1)
    LayerNorm         (x - mean) / std * w (+ b), with or without a bias; a weight of shape (n, D) holds one
                      row per head (Cohere's per-head q/k norms), still normalising over D only
    PerHeadNorm       one LayerNorm per head stored as `norms.{h}.weight` (StableLM), held as norms.weight [n, D]
                      (the loader's Stack("norms") rule fills row h)

Fast path (float32, CPU, no autograd): `zoo.kernels.rms_norm`, one pass per row; the mean of squares is
summed in another order than torch's, so results agree to float32 rounding, not bit for bit.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zoo import kernels


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # [..., D] float32


class RMSNorm(nn.Module):
    """Llama's norm: `w * rms(x)`, the normalised x cast back to x's dtype before the weight."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))  # [D]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.fast(x, self.weight):
            return kernels.rms_norm(x, self.weight, self.eps)  # [..., D]
        return self.weighted(_rms(x, self.eps), x.dtype)  # [..., D]

    def weighted(self, normed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The weight applied to the normalised x (float32), in this norm's order and precision, cast to `dtype`
        (a tensor-parallel norm over a split width reuses it: zoo/layers/parallel.py)."""
        return self.weight * normed.to(dtype)  # [..., D]

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class GemmaRMSNorm(RMSNorm):
    """Gemma's norm: `rms(x) * (1 + w)`, all in float32, cast to x's dtype at the end."""

    # diff with Llama: the checkpoint stores w - 1 (zeros initialise it), and the product stays in float32
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.fast(x, self.weight):
            return kernels.rms_norm(x, self.weight, self.eps, gemma=True)  # [..., D]
        return self.weighted(_rms(x, self.eps), x.dtype)  # [..., D]

    def weighted(self, normed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (normed * (1.0 + self.weight.float())).to(dtype)  # [..., D]


class RMSNormF32Weight(RMSNorm):
    """OLMo-2's norm: `(w * rms(x))` in float32, cast to x's dtype after the weight."""

    # diff with Llama: the weight multiplies the float32 rms (equal to RMSNorm's result in float32)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype is torch.float32 and kernels.fast(x, self.weight):
            return kernels.rms_norm(x, self.weight, self.eps)  # [..., D]
        return self.weighted(_rms(x, self.eps), x.dtype)  # [..., D]

    def weighted(self, normed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (self.weight.float() * normed).to(dtype)  # [..., D]


class LayerNorm(nn.Module):
    """LayerNorm over the last dim D in float32, cast back; weight of `shape` (D, or (n, D): one row per head),
    an optional bias of the same shape."""

    def __init__(self, shape: int | tuple[int, ...], eps: float = 1e-5, *, bias: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(shape))  # [D] or [n, D]
        self.bias = nn.Parameter(torch.empty(shape)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = self.weight.shape[-1]
        if self.weight.dim() == 1:
            w, b = self.weight.float(), None if self.bias is None else self.bias.float()
            return F.layer_norm(x.float(), (d,), w, b, self.eps).to(x.dtype)  # [..., D]
        y = F.layer_norm(x.float(), (d,), eps=self.eps) * self.weight.float()  # [..., n, D]
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, bias={self.bias is not None}"


class PerHeadNorm(nn.Module):
    """StableLM's q/k norms: a bias-free LayerNorm per head, `norms.{h}.weight` in the checkpoint."""

    def __init__(self, num_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.norms = LayerNorm((num_heads, head_dim), eps, bias=False)  # weight [n, D]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norms(x)  # [T, n, D]
