"""Feed-forward blocks: the gated MLP down(act(gate(x)) * up(x)), with gate and up fused into one weight, and
the plain MLP down(act(up(x))) of GPT-2, GPT-NeoX, Phi and StarCoder2 (under their own checkpoint names).

Shape legend:
    T = tokens    H = hidden size    I = intermediate size

Fast path (float32, CPU, no autograd, silu or gelu_pytorch_tanh): `act_and_mul` computes act(gate) * up in one
pass (`zoo.kernels.silu_mul`, `gelu_tanh_mul`), for the dense MLP and the MoE experts alike.
"""
from __future__ import annotations

import math

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
    # transformers' NewGELUActivation, formula for formula (GPT-2, Phi)
    "gelu_new": lambda x: 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0)))),
}


FUSED_ACTS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # hidden_act -> its kernel


def act_and_mul(gate_up: torch.Tensor, act, kind: str | None) -> torch.Tensor:
    """act(gate) * up for gate_up = cat(gate, up) [T, 2I] -> [T, I], on the fused kernel of `kind`
    (FUSED_ACTS; the fused decoder step runs the same one) when it applies."""
    if kind and kernels.fast(gate_up):
        return (kernels.silu_mul if kind == "silu" else kernels.gelu_tanh_mul)(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)  # [T, I], [T, I]
    return act(gate) * up


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
        self.kind = FUSED_ACTS.get(hidden_act)
        self.gate_up_proj = MergedLinear(hidden_size, (intermediate_size, intermediate_size), bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        return self.down_proj(act_and_mul(gate_up, self.act, self.kind))  # [T, 2I] -> [T, I] -> [T, H]


class MLP(nn.Module):
    """down(act(up(x))) with biases; `names` are the checkpoint's names of up and down ("c_fc", "c_proj")."""

    def __init__(self, *, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool = True,
                 names: tuple[str, str] = ("fc1", "fc2"), prefix: str = ""):
        super().__init__()
        self.prefix, self.names = prefix, names
        self.act = activation(hidden_act)
        setattr(self, names[0], Linear(hidden_size, intermediate_size, bias=bias))
        setattr(self, names[1], Linear(intermediate_size, hidden_size, bias=bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up, down = (getattr(self, n) for n in self.names)
        return down(self.act(up(x)))  # [T, H] -> [T, I] -> [T, H]
