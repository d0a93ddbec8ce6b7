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
