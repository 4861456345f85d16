"""The device peak the memory meter reports per phase (``hybridrl.observe.memory.DeviceMemoryMeter``) on CUDA,
and its CPU behaviour."""

from __future__ import annotations

import ctypes

import pytest
import torch

from hybridrl.engines.train_kit import release_cached_device_memory
from hybridrl.observe.memory import MIB, DeviceMemoryMeter

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_on_cpu_the_meter_records_no_device_peak():
    meter = DeviceMemoryMeter("cpu")
    with meter.watch("actor", "update"):
        torch.zeros(1000).sum()
    assert meter.report() == {}


@pytest.mark.gpu
@cuda
def test_a_cache_released_inside_a_call_is_not_counted_again_beside_what_comes_after():
    """A colocated rollout gives torch's cache back, then maps its weights outside torch (``reshard``): the
    phase's peak is the larger of the two moments, not their sum."""
    meter = DeviceMemoryMeter("cuda")
    block = torch.empty(4 * 2**30, dtype=torch.uint8, device="cuda")  # the trainer's activations, then cached
    del block
    with meter.watch("rollout", "reshard"):
        release_cached_device_memory()
        libcuda = ctypes.CDLL("libcuda.so.1")  # device memory outside torch's allocator, as vLLM's weights are
        weights = ctypes.c_uint64()
        assert libcuda.cuMemAlloc_v2(ctypes.byref(weights), ctypes.c_size_t(2 * 2**30)) == 0
        try:
            free, total = torch.cuda.mem_get_info()
            used_now = (total - free) / MIB
        finally:
            libcuda.cuMemFree_v2(weights)
    peak = meter.report()["reshard"]
    # at most the moment with the 4 GiB cache (before the release) or with the 2 GiB weights, never 4 + 2
    assert peak < used_now + 3 * 1024, (peak, used_now)
