"""Gated MLP: down(act(gate(x)) * up(x)), with gate and up fused into one weight.

Shape legend:
    T = tokens    H = hidden size    I = intermediate size

Fast path (float32, CPU, no autograd, silu): `zoo.kernels.silu_mul` computes silu(gate) * up in one pass.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zoo import kernels
from zoo.layers.linear import Linear, MergedLinear

# transformers' ACT2FN names -> the function it computes
ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def activation(name: str, *, field: str = "hidden_act"):
    """The activation transformers' ACT2FN[name] computes; an error names the config field otherwise."""
    if name not in ACTIVATIONS:
        raise ValueError(f"{field}={name!r} is not supported; supported: {', '.join(sorted(ACTIVATIONS))}")
    return ACTIVATIONS[name]


class GatedMLP(nn.Module):
    """SwiGLU (silu) for Llama/Mistral/Qwen, GELU-tanh gated for Gemma; `gate_up_proj` = cat(gate, up)."""

    def __init__(self, *, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", bias: bool = False,
                 prefix: str = ""):
        super().__init__()
        self.prefix = prefix
        self.act = activation(hidden_act)
        # the activations with a fused act(gate) * up kernel, also run by the fused decoder step
        self.kind = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}.get(hidden_act)
        self.gate_up_proj = MergedLinear(hidden_size, (intermediate_size, intermediate_size), bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        if self.kind and kernels.fast(gate_up):
            fused = kernels.silu_mul if self.kind == "silu" else kernels.gelu_tanh_mul
            return self.down_proj(fused(gate_up))  # [T, 2I] -> [T, I] -> [T, H]
        gate, up = self.gate_up_proj.split(gate_up)  # [T, 2I] -> [T, I], [T, I]
        return self.down_proj(self.act(gate) * up)  # [T, I] -> [T, H]
