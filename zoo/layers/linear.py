"""Linear layers, plain and fused. Parameters are created uninitialised: the loader fills them.

Shape legend:
    T = tokens    I = input features    O = output features (the sum of the shards when fused)
    H = query heads    KV = key/value heads    D = head dim

A fused weight carries `weight.shard_sizes` (and `bias.shard_sizes`): the rows each checkpoint tensor
fills, in order. The loader's Fuse rule reads it to slice `q_proj` / `k_proj` / `v_proj` into `qkv_proj`
and `gate_proj` / `up_proj` into `gate_up_proj`.

Fast path: float32 on the CPU without autograd runs `zoo.kernels.linear` (a streaming GEMV for a few rows,
a register-tiled GEMM for more, over the checkpoint layout); ZOO_FAST=0 keeps F.linear.

Quantised weights: a weight loaded from a GGUF kept quantised (loader/quant.py) is uint8 bytes with its
layout in `weight.quant` (the logical shape is the layer's [O, I]); `linear` runs it on the block kernels
(`zoo.kernels.qlinear`), or dequantises it and calls F.linear when the kernels are off. Weights marked
`quantizable` are the ones the loader may fill that way.

Compact storage: on the CPU the activations are float32 whatever the model's dtype (`compute_dtype`: bfloat16
arithmetic there is no faster, only less exact; a decode step's time is the bytes of the weights it streams).
`dtype=bfloat16` then stores the weights marked `compact` (the matrices, embedding tables and expert stacks of
zoo.layers, read through `linear` and their layers' own forwards) and the KV caches in bfloat16, everything else
(norms, biases, convolutions, SSM parameters, routers) in float32 (zoo.build.storage_dtypes), and `linear` reads
such a weight widened (`zoo.kernels.linear`'s bfloat16 GEMV / GEMM, float32 arithmetic). On the device path
(CUDA) every parameter and the activations take the model's dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zoo import kernels


def compute_dtype(weight: torch.Tensor) -> torch.dtype:
    """The activations' dtype beside this weight: float32 on the CPU, the weight's own on the device path."""
    return weight.dtype if kernels.device_path(weight) else torch.float32


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), on the native GEMV / GEMM when it applies (float32 CPU, no autograd); a weight
    stored narrower than x (bfloat16 under float32 activations) is read widened."""
    if weight.dtype is torch.uint8:  # block-quantised (weight.quant)
        if kernels.fast(x):
            return kernels.qlinear(x, weight, bias)  # [T, I] -> [T, O]
        return F.linear(x, kernels.dequantize(weight).to(x.dtype), bias)  # [T, I] -> [T, O]
    if weight.dtype is not x.dtype:  # compact storage
        if weight.dtype is torch.bfloat16 and weight.is_cpu and kernels.fast(x):
            return kernels.linear(x, weight, bias)  # [T, I] -> [T, O], the bfloat16 kernels
        return F.linear(x, weight.to(x.dtype), bias)  # [T, I] -> [T, O]
    if kernels.fast(x, weight):
        return kernels.linear(x, weight, bias)  # [T, I] -> [T, O]
    return F.linear(x, weight, bias)  # [T, I] -> [T, O]


class Linear(nn.Module):
    """y = x W^T (+ b), weight [O, I] as in the checkpoint."""

    def __init__(self, input_size: int, output_size: int, *, bias: bool = False):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size))  # [O, I]
        self.weight.quantizable = True  # (the loader may keep a GGUF's blocks here)
        self.weight.compact = True  # (and bfloat16 under float32 activations: `linear` widens it)
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None  # [O]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)  # [T, I] -> [T, O]

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


class MergedLinear(Linear):
    """Several linears of one input stacked along the output: out = cat(x W_0^T, x W_1^T, ...)."""

    def __init__(self, input_size: int, output_sizes: tuple[int, ...], *, bias: bool = False):
        super().__init__(input_size, sum(output_sizes), bias=bias)
        self.output_sizes = tuple(output_sizes)
        self.weight.shard_sizes = self.output_sizes  # rows of each checkpoint shard, in order
        if self.bias is not None:
            self.bias.shard_sizes = self.output_sizes

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[T, O] -> one [T, O_i] per shard."""
        return out.split(self.output_sizes, dim=-1)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={'+'.join(map(str, self.output_sizes))}, bias={self.bias is not None}"


class QKVLinear(MergedLinear):
    """q, k and v projections in one weight [(H + 2 KV) * D, I]."""

    def __init__(self, hidden_size: int, *, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        super().__init__(hidden_size, (num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim),
                         bias=bias)
