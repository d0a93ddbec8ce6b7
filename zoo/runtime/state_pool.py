"""The recurrent state pool of hybrid / SSM models, beside the KV block pool.

A Mamba layer's cache is not paged by token: it is a fixed-size state per request (the conv window and
the SSM state), overwritten every step. So the pool is one slot per running request, shared by all the
recurrent layers: slot s of every layer's tensors `[S, *shape]` (shapes from each layer's StateSpec) is
one request's. The KV cache manager takes a slot when it admits a request and gives it back when the
request finishes or is preempted (preemption is by recompute: the request restarts from its first token,
so the slot it gets next is not read before it is written).

A slot's content is never trusted: the model reads it only when the batch says has_initial_state for
the request (tokens computed in earlier steps), and writes it at the end of each step.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from zoo.runtime.batch import StateSpec


def state_specs(model: torch.nn.Module) -> dict[str, StateSpec]:
    """prefix -> StateSpec for every module of `model` whose cache_spec() is a StateSpec (in module order)."""
    from zoo.runtime.kv_cache import declared_specs

    return {p: s for p, s in declared_specs(model).items() if isinstance(s, StateSpec)}


def bytes_per_request(specs: dict[str, StateSpec]) -> int:
    return sum(s.bytes_per_request() for s in specs.values())


def allocate_states(specs: dict[str, StateSpec], num_slots: int,
                    device: torch.device | str = "cpu") -> dict[str, tuple[torch.Tensor, ...]]:
    """prefix -> one torch.empty(S, *shape) per tensor of the spec, in the spec's order and dtypes."""
    return {p: tuple(torch.empty(num_slots, *shape, dtype=dtype, device=device) for _, shape, dtype in s.tensors)
            for p, s in specs.items()}


class StateSlots:
    """Which slot each running request holds (host-side accounting; the tensors live in the model runner)."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"the state pool needs at least one slot (got num_slots={num_slots})")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: slot 0 is taken first
        self._slot_of: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def has(self, request_id: str) -> bool:
        return request_id in self._slot_of

    def slot(self, request_id: str) -> int:
        try:
            return self._slot_of[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} holds no state slot (it was never admitted, or was freed)") from None

    def allocate(self, request_id: str) -> int:
        if request_id in self._slot_of:
            return self._slot_of[request_id]
        if not self._free:
            raise RuntimeError(f"no free state slot for request {request_id!r} (all {self.num_slots} are held)")
        self._slot_of[request_id] = slot = self._free.pop()
        return slot

    def free(self, request_id: str) -> int | None:
        """Give the request's slot back (None if it held none)."""
        slot = self._slot_of.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)
        return slot

    def free_slots(self) -> list[int]:
        return list(self._free)


class StateSnapshots:
    """Prefix caching for recurrent layers (vLLM's "align" mode): copies of a request's state taken when its
    computed tokens end exactly on a block boundary, keyed by that block's chained hash, LRU-evicted.

    A prefix hit is then a run of cached KV blocks whose last block has a snapshot: the request's slot is
    restored from it. The scheduler clips prefill chunks at block boundaries so the boundary states exist.
    Copies are queued here and run by the model runner before the next forward, saves first: a save
    queued after step t reads the slot as step t left it, and a restore queued while scheduling step t + 1
    reads a snapshot whose save is already ahead of it in the queue (so no snapshot is used by the step
    that writes it).
    """

    def __init__(self, num_snapshots: int):
        if num_snapshots < 1:
            raise ValueError(f"the state snapshot store needs at least one entry (got {num_snapshots})")
        self.num_snapshots = num_snapshots
        self._free = list(range(num_snapshots - 1, -1, -1))
        self._by_hash: OrderedDict[bytes, int] = OrderedDict()  # oldest first
        self.copies: list[tuple[str, int, int]] = []  # ("save", slot, snapshot) / ("restore", snapshot, slot)

    def has(self, block_hash: bytes) -> bool:
        return block_hash in self._by_hash

    def __len__(self) -> int:
        return len(self._by_hash)

    def save(self, block_hash: bytes, slot: int) -> None:
        if block_hash in self._by_hash:
            self._by_hash.move_to_end(block_hash)
            return
        snap = self._free.pop() if self._free else self._by_hash.popitem(last=False)[1]
        self._by_hash[block_hash] = snap
        self.copies.append(("save", slot, snap))

    def restore(self, block_hash: bytes, slot: int) -> None:
        snap = self._by_hash[block_hash]
        self._by_hash.move_to_end(block_hash)
        self.copies.append(("restore", snap, slot))

    def drain(self) -> list[tuple[str, int, int]]:
        copies, self.copies = self.copies, []
        return copies


def apply_copies(copies, states: dict[str, tuple[torch.Tensor, ...]],
                 snapshots: dict[str, tuple[torch.Tensor, ...]]) -> None:
    """Run the queued snapshot saves and restores, in order, on every recurrent layer's tensors."""
    for kind, src, dst in copies:
        for prefix, tensors in states.items():
            for live, snap in zip(tensors, snapshots[prefix]):
                if kind == "save":
                    snap[dst].copy_(live[src])
                else:
                    live[dst].copy_(snap[src])
