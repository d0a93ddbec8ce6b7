"""KV cache: what each layer stores per token, how many blocks fit, and which blocks each request holds.

Sizing: every module with a `cache_spec()` declares what one token costs in its own tensor
`[NB, BS, *per_token]` (K/V heads for attention, a latent for MLA). The pool's NB is shared by all of
them, so a token costs the sum of their `bytes_per_token()`, and a memory budget buys
budget // (BS * that sum) blocks. All attention layers of a dense model share one block table.

Hybrid SSM models: a recurrent layer's cache_spec() is a StateSpec (zoo/runtime/state_pool.py), not
a CacheSpec; the manager then also holds a StateSlots and gives each request a state slot with its
first blocks, taking it back in free(). Their prefix caching keeps state snapshots at block boundaries
(StateSnapshots): a hit is the longest run of cached blocks whose last block has a snapshot, and the
scheduler clips prefill chunks at block boundaries (`clip_to_blocks`) so that the snapshots exist.

Doors left open (not built): sliding-window layers could release blocks that fell out of the window
(CacheSpec.sliding_window); hybrid prefix caching would hash blocks with their state snapshots;
multimodal prompts add (hash, offset) of the images overlapping a block to its hash (multimodal.block_extra_keys).
"""
from __future__ import annotations

import math

import torch

from zoo.runtime.batch import CacheSpec
from zoo.runtime.block_pool import BlockPool, KVBlock, hash_block
from zoo.runtime.multimodal import block_extra_keys
from zoo.runtime.request import Request
from zoo.runtime.state_pool import StateSlots, StateSnapshots

DEFAULT_KV_MEMORY = 1 << 30  # bytes, when neither num_blocks nor a budget is given


def cache_specs(model: torch.nn.Module) -> dict[str, CacheSpec]:
    """prefix -> CacheSpec for every module of `model` that declares a per-token cache (in module order)."""
    return {p: s for p, s in declared_specs(model).items() if isinstance(s, CacheSpec)}


def declared_specs(model: torch.nn.Module) -> dict:
    """prefix -> whatever cache_spec() each module declares (CacheSpec, StateSpec), in module order."""
    specs = {}
    for name, module in model.named_modules():
        fn = getattr(module, "cache_spec", None)
        if callable(fn):
            spec = fn()
            if spec is None:
                continue
            prefix = getattr(module, "prefix", None) or name
            if prefix in specs:
                raise ValueError(f"two modules declare a cache under the prefix {prefix!r}")
            specs[prefix] = spec
    return specs


def bytes_per_token(specs: dict[str, CacheSpec]) -> int:
    return sum(s.bytes_per_token() for s in specs.values())


def num_blocks_for(specs: dict[str, CacheSpec], block_size: int, memory_bytes: int) -> int:
    per_block = bytes_per_token(specs) * block_size
    if per_block == 0:
        raise ValueError("the model declares no cache_spec(): nothing to size a KV pool from")
    return max(1, memory_bytes // per_block)


def device_kv_budget(device: torch.device | str, utilization: float, *, mem_get_info=None) -> int:
    """Bytes for the KV pool on an accelerator: `utilization` of its memory less what is in use already (the
    weights, loaded first, and anything else on it). `mem_get_info` (device -> (free, total)) defaults to torch's.
    A ValueError naming --gpu-memory-utilization when nothing is left."""
    if isinstance(utilization, bool) or not isinstance(utilization, (int, float)) or not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization={utilization!r} must be a fraction in (0, 1]")
    free, total = (mem_get_info or torch.cuda.mem_get_info)(torch.device(device))
    budget = int(utilization * total) - (total - free)
    if budget <= 0:
        raise ValueError(f"--gpu-memory-utilization {utilization}: {(total - free) / 2**30:.2f} GiB of the device's "
                         f"{total / 2**30:.2f} GiB are in use (the weights included): nothing is left for the KV "
                         f"cache; raise it or load a smaller model / dtype")
    return budget


def allocate_kv_caches(specs: dict[str, CacheSpec], num_blocks: int, block_size: int,
                       device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """prefix -> torch.empty(NB, BS, *per_token) in the spec's dtype."""
    return {p: torch.empty(num_blocks, block_size, *s.per_token, dtype=s.dtype, device=device)
            for p, s in specs.items()}


class KVCacheManager:
    """Which blocks each request holds; prefix-cache lookups and publication; the pool's accounting."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = True, namespace: str = "",
                 state_slots: StateSlots | None = None, state_snapshots: StateSnapshots | None = None,
                 long_rope_past: int | None = None):
        self.block_size = block_size
        # longrope's switch (zoo/layers/rotary.py): a request longer than it rotates every key with the long
        # factors, so its blocks hash apart from a shorter request's with the same tokens
        self.long_rope_past = long_rope_past
        self.state_slots = state_slots  # hybrid SSM models: one recurrent-state slot per running request
        # ... and, with prefix caching, their states at block boundaries (prefill chunks end on boundaries)
        self.state_snapshots = state_snapshots if enable_caching else None
        self.clip_to_blocks = self.state_snapshots is not None
        self.pool = BlockPool(num_blocks, enable_caching=enable_caching)
        self.enable_caching = enable_caching
        self.namespace = namespace  # the model identity; each request adds its cache_salt
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # how many of a request's blocks are published
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # tokens found in the cache

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def update_block_hashes(self, req: Request) -> None:
        """Extend req.block_hashes over the complete blocks of its tokens (prompt and outputs)."""
        bs, ns = self.block_size, self.namespace + "|" + (req.cache_salt or "")
        if self.long_rope_past is not None and req.num_tokens > self.long_rope_past:
            ns += "|long rope"  # (the scheduler drops a request's hashes when it crosses: recomputed long)
        hashes, tokens = req.block_hashes, req.all_token_ids
        for i in range(len(hashes), len(tokens) // bs):
            extra = block_extra_keys(req.mm_items, i * bs, (i + 1) * bs) if req.mm_items else ()  # images in it
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens[i * bs:(i + 1) * bs], ns, extra))

    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of whole blocks, leaving at least one token to compute (none for a request
        that wants its prompt's logprobs: every prompt row must run)."""
        if not self.enable_caching or req.wants_prompt_logits:
            return [], 0
        self.update_block_hashes(req)
        max_blocks = (req.num_tokens - 1) // self.block_size
        found = []
        for h in req.block_hashes[:max_blocks]:
            block = self.pool.lookup(h)
            if block is None:
                break
            found.append(block)
        if self.state_snapshots is not None:  # recurrent layers restart only where a state snapshot exists
            while found and not self.state_snapshots.has(req.block_hashes[len(found) - 1]):
                found.pop()
        return found, len(found) * self.block_size

    def record_hit(self, num_tokens: int, num_hit: int) -> None:
        """Count one admitted request's lookup (failed admissions retry and are not counted twice)."""
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit

    def allocate_slots(self, req: Request, num_new_tokens: int, new_computed_blocks: list[KVBlock] = ()) -> bool:
        """Make room for num_new_tokens more tokens of `req` (after its computed ones and the cache hits).

        Returns False, changing nothing, when the free list is too short.
        """
        held = self.req_blocks.setdefault(req.request_id, [])
        if not new_computed_blocks and req.num_computed_tokens + num_new_tokens <= len(held) * self.block_size \
                and (self.state_slots is None or self.state_slots.has(req.request_id)):
            return True  # (a decode step inside its last block: nothing to take)
        num_computed = req.num_computed_tokens + len(new_computed_blocks) * self.block_size
        need = math.ceil((num_computed + num_new_tokens) / self.block_size) - len(held) - len(new_computed_blocks)
        # Cache hits that nobody references sit in the free list: touching them takes them out of it.
        revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        no_slot = self.state_slots is not None and not self.state_slots.has(req.request_id) \
            and self.state_slots.num_free == 0
        if need > self.pool.num_free_blocks - revived or no_slot:
            if not held:
                del self.req_blocks[req.request_id]
            return False
        if self.state_slots is not None:
            slot = self.state_slots.allocate(req.request_id)
            if new_computed_blocks and self.state_snapshots is not None:  # the state at the end of the hit
                self.state_snapshots.restore(req.block_hashes[len(new_computed_blocks) - 1], slot)
        if new_computed_blocks:
            self.pool.touch(list(new_computed_blocks))
            held.extend(new_computed_blocks)
            self.num_cached_blocks[req.request_id] = len(held)
        if need > 0:
            held.extend(self.pool.allocate(need))
        return True

    def cache_blocks(self, req: Request) -> None:
        """Publish the request's blocks that became complete and computed (call after the step ran)."""
        if not self.enable_caching:
            return
        held = self.req_blocks.get(req.request_id, [])
        start = self.num_cached_blocks.get(req.request_id, 0)
        end = min(req.num_computed_tokens // self.block_size, len(held))
        if end <= start:
            return
        self.update_block_hashes(req)
        for i in range(start, end):
            self.pool.cache(held[i], req.block_hashes[i])
        self.num_cached_blocks[req.request_id] = end
        if self.state_snapshots is not None and req.num_computed_tokens == end * self.block_size:
            self.state_snapshots.save(req.block_hashes[end - 1], self.state_slots.slot(req.request_id))

    def free(self, req: Request) -> None:
        if self.state_slots is not None:
            self.state_slots.free(req.request_id)
        blocks = self.req_blocks.pop(req.request_id, [])
        self.num_cached_blocks.pop(req.request_id, None)
        self.pool.release(list(reversed(blocks)))
