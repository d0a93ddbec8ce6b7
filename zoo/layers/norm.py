"""RMS normalisation over the last dim, in float32, as transformers computes it.

Shape legend:
    ... = any leading dims (T tokens, or T x heads for q/k norm)    D = normalised dim

Fast path (float32, CPU, no autograd): `zoo.kernels.rms_norm`, one pass per row; the mean of squares is
summed in another order than torch's, so results agree to float32 rounding, not bit for bit.
"""
from __future__ import annotations

import torch
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
        return self.weight * _rms(x, self.eps).to(x.dtype)  # [..., D]

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class GemmaRMSNorm(RMSNorm):
    """Gemma's norm: `rms(x) * (1 + w)`, all in float32, cast to x's dtype at the end."""

    # diff with Llama: the checkpoint stores w - 1 (zeros initialise it), and the product stays in float32
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.fast(x, self.weight):
            return kernels.rms_norm(x, self.weight, self.eps, gemma=True)  # [..., D]
        return (_rms(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)  # [..., D]
