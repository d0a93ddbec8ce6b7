"""Tensor-parallel layers (Megatron-style) over the process's tensor-parallel group (`GROUP`: torch.distributed's
default group, or one pipeline stage's ranks under pipeline x tensor parallelism: zoo/runtime/pipeline.py).

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
    WholeWidthRMS          an RMS norm whose weight is split with the heads ("column" / "kv": OLMo-2's and OLMoE's
                           q/k norms over the whole projection width): each rank's sum of squares, summed over the
                           ranks (an all-reduce of [T, 1], not the all-gather of q and k vLLM does), normalises its
                           own part of the width
    GroupRMSOverRanks      Mamba2's gated norm when ranks outnumber its groups (each group's channels split over
                           `group_ranks` consecutive ranks): the squares of the ranks that share a group summed (an
                           all-gather of [T, 1]); with groups split whole over the ranks the norm needs nothing
"""
from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import nn

from zoo.layers.embedding import LMHead, VocabEmbedding
from zoo.layers.linear import Linear, linear
from zoo.layers.norm import LayerNorm, RMSNorm
from zoo.layers.ssm import GatedRMSNorm

# the ranks this process's tensor-parallel layers talk to: None, the default group (tensor parallelism alone); a
# pipeline stage's ranks (set once by the stage before its first forward: one model per process)
GROUP: dist.ProcessGroup | None = None


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
        dist.all_reduce(y, group=GROUP)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(VocabEmbedding):
    """Rows start:start+V_r of the padded vocabulary; ids outside them are this rank's zero rows."""

    start: int = 0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start  # [T]
        mine = (local >= 0) & (local < self.weight.shape[0])  # [T]
        x = super().forward(torch.where(mine, local, torch.zeros_like(local)))  # [T, H]
        x = x * mine.unsqueeze(-1).to(x.dtype)
        dist.all_reduce(x, group=GROUP)
        return x


class ParallelLMHead(LMHead):
    """logits for this rank's V_r vocab rows, gathered from every rank in rank order, cut to the real vocab."""

    full_vocab: int = 0

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        part = super().forward(hidden).contiguous()  # [N, H] -> [N, V_r]
        parts = [torch.empty_like(part) for _ in range(dist.get_world_size(GROUP))]
        dist.all_gather(parts, part, group=GROUP)
        return torch.cat(parts, dim=-1)[:, :self.full_vocab]  # [N, V]


class SummedOverRanks:
    """Mixed into a block whose output, under tensor parallelism, is this rank's partial sum: the sum over
    the ranks (all-reduce) is the block's output."""

    def forward(self, *args, **kwargs) -> torch.Tensor:
        y = super().forward(*args, **kwargs)  # [T, H], this rank's part
        dist.all_reduce(y, group=GROUP)
        return y


class WholeWidthRMS:
    """Mixed into an RMS norm over a width W that the ranks split ([T, W_r] here, the weight this rank's W_r entries):
    the mean square over W is the sum over the ranks of each rank's sum of squares over W_r * size. KV heads held by
    several ranks (replicated) count as often in the sum as in the width, so the mean is the same."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        squares = xf.pow(2).sum(-1, keepdim=True)  # [T, 1], this rank's part of the width
        dist.all_reduce(squares, group=GROUP)  # [T, 1], summed over the ranks
        mean = squares / (x.shape[-1] * dist.get_world_size(GROUP))
        return self.weighted(xf * torch.rsqrt(mean + self.eps), x.dtype)  # [T, W_r]


class GroupRMSOverRanks:
    """Mixed into Mamba2's gated norm (zoo/layers/ssm.py) when `group_ranks` consecutive ranks share each of its
    groups, each holding D_r channels of it: every rank's sum of squares [T, 1] is gathered, and those of the ranks
    holding this rank's group are added in rank order (the same sum on each of them), over the group's D_r x
    group_ranks channels. vLLM all-gathers the gated activations instead."""

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        g = self.gated(y, gate)  # [T, D_r], float32
        squares = g.pow(2).sum(-1, keepdim=True)  # [T, 1], this rank's part of the group
        parts = [torch.empty_like(squares) for _ in range(dist.get_world_size(GROUP))]
        dist.all_gather(parts, squares, group=GROUP)
        first = dist.get_rank(GROUP) // self.group_ranks * self.group_ranks  # the group's first rank
        total = parts[first]
        for part in parts[first + 1:first + self.group_ranks]:
            total = total + part  # [T, 1]
        mean = total / (g.shape[-1] * self.group_ranks)
        return self.weight * (g * torch.rsqrt(mean + self.eps)).to(y.dtype)  # [T, D_r]


_MIXED: dict[tuple[type, type], type] = {}


def _mixed(mixin: type, cls: type) -> type:
    """`cls` with `mixin` in front (SummedOverRanks, WholeWidthRMS), one class per pair."""
    if (mixin, cls) not in _MIXED:
        prefix = {SummedOverRanks: "Summed", WholeWidthRMS: "WholeWidth", GroupRMSOverRanks: "OverRanks"}[mixin]
        _MIXED[mixin, cls] = type(f"{prefix}{cls.__name__}", (mixin, cls), {"__doc__": cls.__doc__})
    return _MIXED[mixin, cls]


def _summed(cls: type) -> type:
    return _mixed(SummedOverRanks, cls)


def parallelize(model: nn.Module, rules, rank: int, vocab_size: int) -> nn.Module:
    """Swap in the layers that talk to the other ranks, by the rules' Shard kinds: "row" weights' Linear,
    "vocab" weights' embedding and head, "column" / "kv" weights' RMS norms (over the whole width), a "column" gated
    norm whose groups span ranks (`group_ranks`), and the blocks
    that declare `tensor_parallel_sum` (summed once; the row-parallel weights inside them stay partial). Returns
    `model`; ValueError when a sharded weight's module is of another kind (its forward would silently compute on a
    slice)."""
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
        elif kind in ("column", "kv") and isinstance(module, RMSNorm):
            new = _adopt(_mixed(WholeWidthRMS, type(module)), module)
        elif kind == "column" and isinstance(module, GatedRMSNorm) and module.group_ranks > 1:
            new = _adopt(_mixed(GroupRMSOverRanks, type(module)), module)
        elif kind in ("column", "kv", "fused") and isinstance(module, LayerNorm) and w.dim() == 1:
            raise ValueError(f"{name}: a LayerNorm whose weight is {kind}-parallel normalises a split width; it has "
                             f"no tensor-parallel form (an RMS norm over a split width does: WholeWidthRMS)")
        elif kind in ("row", "vocab"):
            raise ValueError(f"{name}: a {kind}-parallel weight in a {type(module).__name__}, which has no "
                             f"tensor-parallel form")
        else:
            continue
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
    return model
