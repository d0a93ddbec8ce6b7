"""A guard for the device path: inside `forbid()`, any read of a tensor's values back to Python (a host
synchronisation on an accelerator) raises HostSync naming the call, so a forced device-path run on the CPU
(zoo.kernels.set_device_path, `ZOO_DEVICE_PATH=1`) proves that a step's model code never waits for the device.

Caught: Tensor.item / tolist / __bool__ / __int__ / __float__ / __index__ (an `if t:`, `int(t)`, `range(t)`),
and the ops whose output size depends on values (nonzero, unique, bincount, masked_select). Not caught:
indexing with a boolean mask (a `__getitem__` patched onto Tensor's own dict changes the type's slots, and
torch.tensor() then takes every 0-d tensor for a sequence, even after the patch is removed). `allow()` lifts it around the torch references of the Triton kernels (on a device the kernel runs
there, reading nothing back). The model runner wraps forward and compute_logits in it when the device path is
forced on the CPU; the sampler's single read of the sampled tokens is outside.
"""
from __future__ import annotations

import contextlib
import threading

import torch

_state = threading.local()
_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "unique", "bincount",
            "masked_select")
_FUNCTIONS = ("nonzero", "unique", "bincount", "masked_select")


class HostSync(RuntimeError):
    """A step of the device path read a tensor's values back to the host."""


def _active() -> bool:
    return getattr(_state, "depth", 0) > 0 and not getattr(_state, "allowed", 0)


def _wrap(name: str, fn):
    def guarded(*args, **kwargs):
        if _active():
            name_ = f"Tensor.{name}" if name.startswith("_") or name in ("item", "tolist") else name
            raise HostSync(f"{name_} inside a device-path step: it reads the device's values back to the host "
                           f"(a synchronisation); keep the values on the device or take them from the batch's "
                           f"host lists (query_start_loc_cpu, seq_lens_cpu)")
        return fn(*args, **kwargs)
    guarded.__wrapped__ = fn
    return guarded


_installed: dict = {}
_lock = threading.Lock()
_users = 0  # threads inside forbid(): the patches stay while any is


def _install() -> None:
    with _lock:
        if _installed:
            return
        for name in _METHODS:
            # None: inherited from TensorBase; removed again on uninstall rather than copied into Tensor's dict
            _installed[("Tensor", name)] = vars(torch.Tensor).get(name)
            setattr(torch.Tensor, name, _wrap(name, getattr(torch.Tensor, name)))
        for name in _FUNCTIONS:
            original = getattr(torch, name)
            _installed[("torch", name)] = original
            setattr(torch, name, _wrap(name, original))


def _uninstall() -> None:
    with _lock:
        if _users:
            return
        for (where, name), original in _installed.items():
            if original is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor if where == "Tensor" else torch, name, original)
        _installed.clear()


@contextlib.contextmanager
def forbid():
    """Raise HostSync on a host read inside the block (this thread; nested blocks are fine)."""
    global _users
    _state.depth = getattr(_state, "depth", 0) + 1
    if _state.depth == 1:
        with _lock:
            _users += 1
        _install()
    try:
        yield
    finally:
        _state.depth -= 1
        if _state.depth == 0:
            with _lock:
                _users -= 1
                last = _users == 0
            if last:
                _uninstall()


@contextlib.contextmanager
def allow():
    """Lift forbid() for a kernel's torch reference (a stand-in for a kernel that reads nothing back)."""
    _state.allowed = getattr(_state, "allowed", 0) + 1
    try:
        yield
    finally:
        _state.allowed -= 1
