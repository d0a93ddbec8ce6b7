"""The KV block pool: reference counts, free blocks, and the prefix-cache hash map.

A block is free when no request references it. A free block may still hold a cached prefix (its
hash is in `cached`): a later request with the same prefix takes it back (`touch`). Free blocks of two
kinds: empty ones (no cached prefix), reused most recently freed first, and cached ones, kept in LRU
order. Allocation takes an empty block while there is one, and only then evicts the least recently
freed cached block (dropping its hash). Reusing the warmest empty block keeps a CPU run's KV memory in
the caches and never pages in untouched memory while touched memory is free (a first touch costs a
page fault and zeroing: 3% of a benchmark step when allocation cycled through the whole pool).

Block hashes are chained: hash(parent hash, the block's token ids, namespace, extra keys), so equal
hashes mean equal whole prefixes. The namespace holds the model identity and a request's cache salt;
`extra` is the door for multimodal inputs (the hash of an image whose placeholders fall in the block).
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict


def hash_block(parent: bytes | None, token_ids, namespace: str, extra: tuple = ()) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(array("q", token_ids).tobytes())
    h.update(namespace.encode())
    for e in extra:
        h.update(repr(e).encode())
    return h.digest()


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    def __init__(self, num_blocks: int, *, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"BlockPool: num_blocks={num_blocks} must be >= 1")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.empty: list[KVBlock] = self.blocks[::-1]  # a stack: block 0 first, then the most recently freed
        self.free: OrderedDict[int, KVBlock] = OrderedDict()  # free blocks holding a cached prefix, LRU first
        self.cached: dict[bytes, KVBlock] = {}  # block hash -> the block holding that prefix
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.empty) + len(self.free)

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def allocate(self, n: int) -> list[KVBlock]:
        """n free blocks (empty ones first, then evicting cached ones, LRU first), each with ref_cnt 1."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"BlockPool: asked for {n} blocks, {self.num_free_blocks} free of {self.num_blocks}")
        out = []
        for _ in range(n):
            if self.empty:
                block = self.empty.pop()
            else:
                _, block = self.free.popitem(last=False)
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on cached blocks found by a prefix lookup (out of the free ones if unused)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free[block.block_id]  # (a cached block: free ones with no hash are never looked up)
            block.ref_cnt += 1

    def release(self, blocks: list[KVBlock]) -> None:
        """Drop one reference on each block; unreferenced ones become free (cached: the LRU end).

        Pass a request's blocks in reverse order so that its tail (the least shared part of a prefix)
        is evicted before its head.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"BlockPool: releasing {block!r}, which nobody references")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.empty.append(block)
                else:
                    self.free[block.block_id] = block

    def cache(self, block: KVBlock, block_hash: bytes) -> None:
        """Publish a complete, computed block under its hash (a duplicate of a cached one stays private)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None
            self.num_evictions += 1
