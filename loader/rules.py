"""Weight rules: how checkpoint keys map onto a module's parameters, as data.

A checkpoint key goes through the rules in this order:

    Ignore  -> dropped, with the reason recorded in the report
    Rename  -> literal substring replacement (or of a key's start, for a src spelt "^..."), applied in order
               (reversible, so errors can name keys)
    Stack   -> `experts.{e}.` taken out of the key; the tensor goes to index e of the leading dim
    Fuse    -> `q_proj` / `k_proj` / `v_proj` become shard 0 / 1 / 2 of `qkv_proj` along `dim`
    Tie     -> a parameter that the checkpoint lacks is filled from another key it holds
    Transform -> a key that holds its whole parameter in another layout (transposed, heads interleaved) is
               shape-checked in that layout and rearranged as it is written; coverage is the parameter's

    Shard -> tensor parallelism: which slice of a key's full tensor one rank holds (column, row, vocab, kv,
               fused parts, once, replicated); a key no Shard matches is replicated. See loader/shard.py for the
               arithmetic.

The sizes of a fused parameter's shards come from `Fuse.sizes`, else from the destination parameter's
`shard_sizes` attribute (set by the layer that fuses), else from the checkpoint's shapes of the parts when they
add up to the destination (a grouped-query q/k/v), else an equal split.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Rename:
    """Replace the literal substring `src` of a key with `dst` (e.g. ".block_sparse_moe." -> ".mlp.").

    A `src` starting with "^" replaces only a key's start: Rename("^vision_tower.", "model.vision_tower.")
    maps `vision_tower.x` and leaves `model.vision_tower.x` alone (two layouts of one checkpoint).
    """

    src: str
    dst: str


@dataclass(frozen=True)
class Fuse:
    """Checkpoint modules `parts` are the shards, in order, of module `into` along `dim`.

    Matched on a whole dotted component: Fuse(("q_proj", "k_proj", "v_proj"), "qkv_proj")
    maps `...self_attn.k_proj.weight` to shard 1 of `...self_attn.qkv_proj.weight`.
    """

    parts: tuple[str, ...]
    into: str
    dim: int = 0
    sizes: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Stack:
    """`{container}.{e}.` in a key is an expert index: the tensor is row e of a stacked parameter.

    Stack("experts") maps `mlp.experts.3.down_proj.weight` to `mlp.experts.down_proj.weight[3]`.
    """

    container: str = "experts"


@dataclass(frozen=True)
class Ignore:
    """Checkpoint keys matching the regex `pattern` are dropped on purpose; `reason` says why."""

    pattern: str
    reason: str


@dataclass(frozen=True)
class Tie:
    """Parameter `param` shares `source`'s tensor when the checkpoint holds no key for `param`.

    When the checkpoint does hold `param` (a tied config but a real lm_head.weight), the loader unties
    the two and loads both, and the report says so.
    """

    param: str
    source: str


@dataclass(frozen=True)
class Transform:
    """Checkpoint keys matching the regex `pattern` hold their parameter in another layout, by `kind`:

        "transpose"   a 2-D tensor stored as W^T ([in, out] for an [out, in] parameter: GPT-2's Conv1D); 1-D
                      tensors (biases) are as they are
        "interleave"  `parts` projections interleaved head by head along dim 0 (GPT-NeoX's query_key_value): rows
                      [heads, parts, head_dim] in the checkpoint, [parts, heads, head_dim] in the parameter
    A transformed key fills its whole parameter (it cannot also be a Fuse shard or a Stack row).
    """

    pattern: str
    kind: str
    parts: int = 3
    head_dim: int = 0

    def __post_init__(self):
        if self.kind not in ("transpose", "interleave"):
            raise ValueError(f"Transform kind {self.kind!r}: expected 'transpose' or 'interleave'")

    def source_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape the checkpoint holds for a parameter of `shape`."""
        return tuple(reversed(shape)) if self.kind == "transpose" and len(shape) == 2 else tuple(shape)

    def problem(self, shape: tuple[int, ...]) -> str | None:
        """Why a parameter of `shape` cannot take this layout, or None."""
        if self.kind == "interleave" and (not shape or self.head_dim <= 0 or shape[0] % (self.parts * self.head_dim)):
            return (f"dim 0 of size {shape[0] if shape else 0} is not {self.parts} parts x heads x head_dim "
                    f"{self.head_dim}")
        return None

    def write(self, src: torch.Tensor, dest: torch.Tensor) -> None:
        """Copy `src` (checkpoint layout) into `dest` (parameter layout)."""
        if self.kind == "transpose":
            dest.copy_(src.t() if src.dim() == 2 else src)
            return
        heads = dest.shape[0] // (self.parts * self.head_dim)
        rest = dest.shape[1:]
        view = dest.view(self.parts, heads, self.head_dim, *rest).transpose(0, 1)  # [heads, parts, D, ...]
        view.copy_(src.view(heads, self.parts, self.head_dim, *rest))


SHARD_KINDS = ("column", "row", "vocab", "kv", "fused", "once", "replicated")
PART_KINDS = ("column", "kv")  # how each part of a "fused" Shard splits
VOCAB_MULTIPLE = 64


def padded_vocab(size: int, n: int) -> int:
    """`size` rows padded to a multiple of 64 (of 64 x n when that does not split over n ranks)."""
    padded = -(-size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    if padded % n:
        padded = -(-size // (VOCAB_MULTIPLE * n)) * VOCAB_MULTIPLE * n
    return padded


@dataclass(frozen=True)
class Shard:
    """Under tensor parallelism, checkpoint keys matching the regex `pattern` are split across ranks by `kind`:

        "column"      dim 0 in equal parts, rank r holds part r (q_proj, gate_proj/up_proj and their biases)
        "row"         dim 1 in equal parts (o_proj, down_proj weights; their bias is replicated, added once)
        "vocab"       dim 0 of a `size`-row embedding / head, padded to a multiple of 64 (x size of the group),
                      rank r holds rows r*V'/N..(r+1)*V'/N of the padded V'; rows past `size` are zero padding
        "kv"          dim 0 holds `heads` heads (k_proj, v_proj, per-head k weights): split by heads when
                      heads >= N, else each rank holds one head, head r // (N / heads) (KV replication)
        "fused"       dim 0 is a run of `parts` (a checkpoint-fused qkv_proj: ("column", "kv", "kv"); gate_up_proj:
                      ("column", "column")), each split by its own kind: rank r holds its part of each, so a key
                      is read as one slice per part. The parts' rank-local sizes are the parameter's
                      `shard_sizes` (a MergedLinear's, a stacked expert's), else equal
        "once"        rank 0 holds the tensor, every other rank zeros of its shape: a term of a partial sum the
                      ranks add up (gpt-oss's expert down_proj bias inside its summed MoE block), counted once
        "replicated"  every rank holds the whole tensor (the default for a key no Shard matches)
    `dim` splits another dim than the kind's (of the parameter's layout, per key: [E, H, 2I] gpt-oss experts
    split by intermediate size on dim 2; a transposed key's dims are the parameter's, not the checkpoint's).
    `stack=True` splits the rows of a Stack rule instead of a tensor (which keys a rank reads: StableLM's per-head
    `q_layernorm.norms.{h}`, rank r holding heads r*Hq/N..; by "column" or, with KV replication, "kv").
    The first matching Shard applies. The parameter a key fills has the rank-local shape.
    """

    pattern: str
    kind: str
    heads: int = 0  # for "kv" (and a "fused" Shard's "kv" parts): the number of heads the full tensor holds
    size: int = 0  # for "vocab": the real vocabulary size (rows of the full tensor)
    dim: int | None = None  # the dim split (default: 1 for "row", else 0)
    parts: tuple[str, ...] = ()  # for "fused": each part's kind, in order along `dim`
    stack: bool = False  # split a Stack's rows (keys), not a dim of each key's tensor

    def __post_init__(self):
        if self.kind not in SHARD_KINDS:
            raise ValueError(f"Shard kind {self.kind!r}: expected one of {', '.join(SHARD_KINDS)}")
        if (self.kind == "kv" or "kv" in self.parts) and self.heads <= 0:
            raise ValueError(f"Shard {self.pattern!r}: a 'kv' shard needs heads > 0")
        if self.kind == "vocab" and self.size <= 0:
            raise ValueError(f"Shard {self.pattern!r}: a 'vocab' shard needs size > 0")
        if (self.kind == "fused") != bool(self.parts) or not set(self.parts) <= set(PART_KINDS):
            raise ValueError(f"Shard {self.pattern!r}: parts {self.parts!r} (a 'fused' shard, and only it, has parts, "
                             f"each one of {', '.join(PART_KINDS)})")
        if self.stack and self.kind not in ("column", "kv"):
            raise ValueError(f"Shard {self.pattern!r}: a stack shard splits by 'column' or 'kv', not {self.kind!r}")
        if self.dim is not None and self.dim < 0:
            raise ValueError(f"Shard {self.pattern!r}: dim {self.dim} must be >= 0")


@dataclass(frozen=True)
class Rules:
    """All rules of one architecture. The empty Rules() is the identity mapping."""

    renames: tuple[Rename, ...] = ()
    fuses: tuple[Fuse, ...] = ()
    stacks: tuple[Stack, ...] = ()
    ignores: tuple[Ignore, ...] = ()
    ties: tuple[Tie, ...] = ()
    transforms: tuple[Transform, ...] = ()
    shards: tuple[Shard, ...] = ()

    def __add__(self, other: "Rules") -> "Rules":
        return Rules(
            self.renames + other.renames,
            self.fuses + other.fuses,
            self.stacks + other.stacks,
            self.ignores + other.ignores,
            self.ties + other.ties,
            self.transforms + other.transforms,
            self.shards + other.shards,
        )
