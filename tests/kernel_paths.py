"""Fixtures that run a test on both paths of the layers: zoo's native kernels and plain torch ops (and
`twice(fn)`: a kernel's result on one thread and on two, equal bit for bit).

    from kernel_paths import ops  # noqa: F401   (pytest finds fixtures imported into a test module)

    def test_something(ops): ...              # runs as test_something[kernels] and test_something[torch]

On the kernels path grad mode is off (the layers take their native path only without autograd, as in the
runtime); on the torch path the kernels are switched off. ZOO_FAST=0 in the environment skips the kernels
runs (so does ZOO_DEVICE_PATH=1, the device path forced); a kernels run on a machine where the library does not build fails, naming why.
"""
from __future__ import annotations

import os

import pytest
import torch

from zoo import kernels


@pytest.fixture(params=["kernels", "torch"])
def ops(request):
    on = request.param == "kernels"
    if on and os.environ.get("ZOO_FAST") == "0":
        pytest.skip("ZOO_FAST=0: native kernels switched off")
    if on and os.environ.get("ZOO_DEVICE_PATH") == "1":
        pytest.skip("ZOO_DEVICE_PATH=1: the device path is forced (no native kernels)")
    previous = kernels.set_enabled(on)
    try:
        if on and not kernels.enabled():
            pytest.fail("zoo's native kernels did not build (see the RuntimeWarning); set ZOO_FAST=0 to skip")
        with torch.set_grad_enabled(not on):
            yield request.param
    finally:
        kernels.set_enabled(previous)


def twice(fn):
    """fn() on one thread and on two: the results must be equal bit for bit."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fn()
        torch.set_num_threads(2)
        two = fn()
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two), "the result depends on the thread count"
    return one
