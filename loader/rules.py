"""Weight rules: how checkpoint keys map onto a module's parameters, as data.

A checkpoint key goes through the rules in this order:

    Ignore  -> dropped, with the reason recorded in the report
    Rename  -> literal substring replacement (or of a key's start, for a src spelt "^..."), applied in order
               (reversible, so errors can name keys)
    Stack   -> `experts.{e}.` taken out of the key; the tensor goes to index e of the leading dim
    Fuse    -> `q_proj` / `k_proj` / `v_proj` become shard 0 / 1 / 2 of `qkv_proj` along `dim`
    Tie     -> a parameter that the checkpoint lacks is filled from another key it holds

The sizes of a fused parameter's shards come from `Fuse.sizes`, else from the destination parameter's
`shard_sizes` attribute (set by the layer that fuses), else an equal split.
"""
from __future__ import annotations

from dataclasses import dataclass


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
class Rules:
    """All rules of one architecture. The empty Rules() is the identity mapping."""

    renames: tuple[Rename, ...] = ()
    fuses: tuple[Fuse, ...] = ()
    stacks: tuple[Stack, ...] = ()
    ignores: tuple[Ignore, ...] = ()
    ties: tuple[Tie, ...] = ()

    def __add__(self, other: "Rules") -> "Rules":
        return Rules(
            self.renames + other.renames,
            self.fuses + other.fuses,
            self.stacks + other.stacks,
            self.ignores + other.ignores,
            self.ties + other.ties,
        )
