"""Tensor-parallel layers (Megatron-style) over torch.distributed's default group.

Shape legend:
    T = tokens    N = rows whose logits are wanted    H = hidden size    I_r = this rank's input features
    V = vocab size    V_r = this rank's rows of the padded vocab (the same on every rank)

A model built from the rank-local config (spec.tensor_parallel) already has each rank's shapes: the column-
parallel q/k/v and gate/up and the attention need nothing more. What needs the other ranks is swapped in by
`parallelize` once the weights are loaded (the modules keep their Parameters):
    RowParallelLinear      o_proj, down_proj: the partial products summed over the ranks; the bias added once
    VocabParallelEmbedding this rank's vocab rows; ids of other ranks give zero rows; summed over the ranks
    ParallelLMHead         this rank's logit columns gathered from every rank, the vocab padding cut
    summed blocks          a module whose class sets `tensor_parallel_sum = True` (the MoE blocks: experts split
                           by intermediate size, a shared expert like a dense MLP) returns a partial sum: its
                           output is all-reduced once, and the row-parallel weights inside it are not reduced
                           on their own (one all-reduce per MoE layer, routed and shared experts together)
"""
from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import nn

from zoo.layers.embedding import LMHead, VocabEmbedding
from zoo.layers.linear import Linear, linear


def _adopt(cls, module: nn.Module, **attrs) -> nn.Module:
    """`module` as an instance of its subclass `cls`, sharing its Parameters."""
    new = cls.__new__(cls)
    new.__dict__.update(module.__dict__)
    new.__dict__.update(attrs)
    return new


class RowParallelLinear(Linear):
    """y = sum over ranks of x_r W_r^T, + b: the input features (cols of W) split; the bias is replicated."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight)  # [T, I_r] -> [T, O], this rank's partial sum
        dist.all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(VocabEmbedding):
    """Rows start:start+V_r of the padded vocabulary; ids outside them are this rank's zero rows."""

    start: int = 0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start  # [T]
        mine = (local >= 0) & (local < self.weight.shape[0])  # [T]
        x = super().forward(torch.where(mine, local, torch.zeros_like(local)))  # [T, H]
        x = x * mine.unsqueeze(-1).to(x.dtype)
        dist.all_reduce(x)
        return x


class ParallelLMHead(LMHead):
    """logits for this rank's V_r vocab rows, gathered from every rank in rank order, cut to the real vocab."""

    full_vocab: int = 0

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        part = super().forward(hidden).contiguous()  # [N, H] -> [N, V_r]
        parts = [torch.empty_like(part) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, part)
        return torch.cat(parts, dim=-1)[:, :self.full_vocab]  # [N, V]


class SummedOverRanks:
    """Mixed into a block whose output, under tensor parallelism, is this rank's partial sum: the sum over
    the ranks (all-reduce) is the block's output."""

    def forward(self, *args, **kwargs) -> torch.Tensor:
        y = super().forward(*args, **kwargs)  # [T, H], this rank's part
        dist.all_reduce(y)
        return y


_SUMMED: dict[type, type] = {}


def _summed(cls: type) -> type:
    if cls not in _SUMMED:
        _SUMMED[cls] = type(f"Summed{cls.__name__}", (SummedOverRanks, cls), {"__doc__": cls.__doc__})
    return _SUMMED[cls]


def parallelize(model: nn.Module, rules, rank: int, vocab_size: int) -> nn.Module:
    """Swap in the layers that talk to the other ranks, by the rules' Shard kinds: "row" weights' Linear,
    "vocab" weights' embedding and head, and the blocks that declare `tensor_parallel_sum` (summed once; the
    row-parallel weights inside them stay partial). Returns `model`; ValueError when a sharded weight's module
    is of another kind (its forward would silently compute on a slice)."""
    kinds = [(re.compile(s.pattern), s.kind) for s in rules.shards]
    summed = [name for name, m in model.named_modules() if getattr(type(m), "tensor_parallel_sum", False)]
    for name in summed:
        module = model.get_submodule(name)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, _adopt(_summed(type(module)), module))
    for name, module in list(model.named_modules()):
        w = getattr(module, "weight", None)
        kind = next((k for p, k in kinds if isinstance(w, torch.Tensor) and p.search(f"{name}.weight")), None)
        inside = next((s for s in summed if name.startswith(f"{s}.")), None)
        if kind == "row" and inside is not None:
            if getattr(module, "bias", None) is not None:
                raise ValueError(f"{name}: a row-parallel weight with a bias inside {inside}, whose output is summed "
                                 f"over the ranks: the bias would be added once per rank")
            continue  # a partial product; the block sums it with the rest
        if kind == "row" and type(module) is Linear:
            new = _adopt(RowParallelLinear, module)
        elif kind == "vocab" and type(module) is VocabEmbedding:
            new = _adopt(VocabParallelEmbedding, module, start=rank * module.weight.shape[0])
        elif kind == "vocab" and type(module) is LMHead:
            new = _adopt(ParallelLMHead, module, full_vocab=vocab_size)
        elif kind in ("row", "vocab"):
            raise ValueError(f"{name}: a {kind}-parallel weight in a {type(module).__name__}, which has no "
                             f"tensor-parallel form")
        else:
            continue
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
    return model
