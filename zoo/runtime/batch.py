"""The contract between the runtime and a model: one step's flattened batch and its cache.

Shape legend:
    T = tokens scheduled this step (all requests, concatenated, no padding)
    B = requests in this step          N = positions whose logits are sampled
    NB = blocks in the KV pool         BS = tokens per block
    MB = max blocks of any request in this step

Request i owns tokens query_start_loc[i]:query_start_loc[i+1] of the step. Its context after this
step holds seq_lens[i] tokens: the seq_lens[i] - (query_start_loc[i+1] - query_start_loc[i]) tokens
computed in earlier steps (or found in the prefix cache) and the new ones. Token j of the step sits
in the KV pool at slot_mapping[j] = block * BS + offset; request i's context is, in order, the blocks
block_tables[i, :ceil(seq_lens[i] / BS)].

Cache storage belongs to the runtime. Each module that caches something declares a `cache_spec()`
(what one token costs) and finds its storage in `kv_caches[module.prefix]`; it never allocates it.
A recurrent (SSM) layer declares a `StateSpec` instead (what one request costs, whatever its length) and
finds its state tensors `[S, *shape]` in `ssm_states[module.prefix]`; request i's row is
`state_indices[i]`, which holds its state after its first has_initial_state[i] = False step. A slot's
content is never trusted before that: a request that starts (or restarts after preemption) reads zeros.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class CacheSpec:
    """What one token costs in one layer's cache: the tensor `[NB, BS, *per_token]` of `dtype`.

    Attention with K/V heads: per_token = (2, num_kv_heads, head_dim)  (index 0 = K, 1 = V).
    MLA: per_token = (kv_lora_rank + qk_rope_head_dim,), the latent and the shared rotary key.
    `sliding_window` lets the cache manager free blocks that fell out of a window (None = full).
    """

    per_token: tuple[int, ...]
    dtype: torch.dtype
    sliding_window: int | None = None

    def bytes_per_token(self) -> int:
        n = 1
        for d in self.per_token:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class StateSpec:
    """What one request costs in one recurrent layer: one tensor `[S, *shape]` per (name, shape, dtype).

    Mamba2: ("conv", (K - 1, conv_dim)) and ("ssm", (heads, head_dim, d_state)); Mamba1: ("conv", (K - 1, I))
    and ("ssm", (I, d_state)). The conv state keeps the last K - 1 inputs of the causal conv (vLLM's
    layout; transformers keeps K). S slots are shared by all recurrent layers: slot s is one request.
    """

    tensors: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]

    def bytes_per_request(self) -> int:
        total = 0
        for _, shape, dtype in self.tensors:
            n = torch.empty((), dtype=dtype).element_size()
            for d in shape:
                n *= d
            total += n
        return total


class MissingCache(LookupError):
    """The batch carries caches, but none for a module that declares cache_spec()."""


@dataclass
class StepLists:
    """One step's metadata as host lists, before it becomes a ForwardBatch's tensors (the fields of the same
    names there). The runner builds it; the fused native step reads it as it is (no tensor ops: after a decode
    step has streamed the weights through the caches, each torch op costs ~0.1 ms of misses on the CPU)."""
    input_ids: list[int]  # [T]
    positions: list[int]  # [T]
    slot_mapping: list[int]  # [T]
    query_start_loc_cpu: list[int]  # [B+1]
    seq_lens_cpu: list[int]  # [B]
    num_tokens_cpu: list[int]  # [B]
    block_tables: list[int]  # [B * MB], row-major, padded with 0
    max_blocks: int  # MB
    logits_indices: list[int]  # [N]


@dataclass
class ForwardBatch:
    query_start_loc: torch.Tensor  # [B+1] int32, cumulative new-token counts
    seq_lens: torch.Tensor  # [B] int32, context length after this step
    positions: torch.Tensor  # [T] int64, absolute position of each token
    slot_mapping: torch.Tensor  # [T] int64, where each new token's cache row goes
    block_tables: torch.Tensor  # [B, MB] int32, padded with 0 past each request's blocks
    logits_indices: torch.Tensor  # [N] int64, rows of the hidden states to sample
    kv_caches: dict[str, torch.Tensor] = field(default_factory=dict)  # prefix -> [NB, BS, *per_token]
    block_size: int = 16
    # Host copies of the small metadata, so layers can loop over requests without device syncs.
    query_start_loc_cpu: list[int] = field(default_factory=list)  # [B+1]
    seq_lens_cpu: list[int] = field(default_factory=list)  # [B]
    # [B] each request's whole length, prompt and outputs (longrope's switch, zoo/layers/rotary.py); empty:
    # seq_lens_cpu (a forward over whole sequences)
    num_tokens_cpu: list[int] = field(default_factory=list)
    # Per-family extras (left empty by families that do not need them).
    state_indices: torch.Tensor | None = None  # [B] SSM: each request's slot in the state pool
    ssm_states: dict[str, tuple[torch.Tensor, ...]] = field(default_factory=dict)  # prefix -> [S, *shape] each
    has_initial_state_cpu: list[bool] = field(default_factory=list)  # [B] the slot holds the state of the tokens before
    state_indices_cpu: list[int] = field(default_factory=list)  # [B]
    mm_embeds: torch.Tensor | None = None  # [M, H] multimodal: encoder outputs to merge
    mm_positions: torch.Tensor | None = None  # [M] rows of the step that are placeholders
    mrope_positions: torch.Tensor | None = None  # [3, T] M-RoPE (Qwen2-VL): temporal, height, width positions

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    def states_for(self, prefix: str) -> tuple[torch.Tensor, ...] | None:
        """The state tensors [S, *shape] of the recurrent layer built at `prefix`; None when the batch carries
        no states at all (whole prompts from a zero state). MissingCache when only this one is absent."""
        return _entry(self.ssm_states, "ssm_states", prefix, "state", "whose cache_spec() is a StateSpec")

    def cache_for(self, prefix: str) -> torch.Tensor | None:
        """The cache [NB, BS, *per_token] of the module built at `prefix`; None when the batch carries no
        caches at all (whole prompts, nothing cached or kept). MissingCache when only this one is absent."""
        return _entry(self.kv_caches, "kv_caches", prefix, "cache", "with cache_spec()")


def _entry(table: dict | None, field: str, prefix: str, what: str, which: str):
    """table[prefix]; None when the table is empty; MissingCache naming the field when only this entry is absent."""
    if not table:
        return None
    entry = table.get(prefix)
    if entry is None:
        raise MissingCache(f"batch.{field} has no {what} for {prefix!r} (it has {len(table)} others); "
                           f"allocate one for every module {which}")
    return entry
