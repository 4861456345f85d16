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


class _Counters:
    """torch.cuda's peak-allocated counter as the allocator keeps it: a running max that a reset brings down to
    what is allocated now."""

    def __init__(self) -> None:
        self.now = self.peak = 0

    def allocate(self, nbytes: int) -> None:
        self.now += nbytes
        self.peak = max(self.peak, self.now)

    def free(self, nbytes: int) -> None:
        self.now -= nbytes

    def reset(self) -> None:
        self.peak = self.now


def test_the_process_peak_survives_the_meters_restarts_of_torchs_counters(monkeypatch):
    """The meter restarts torch's peak counters at each phase; ``memory/<role>/peak_mb`` (``allocated_peak_mb``)
    still answers the largest moment of the process, not the last phase's (a colocated update at 100 GB, then a
    reshard at 11 GB, reported 11 GB)."""
    from hybridrl.observe import memory

    counters = _Counters()
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: counters.peak)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a, **k: counters.reset())
    monkeypatch.setattr(memory, "_allocated_peak_bytes", 0)
    memory._restart_peak_counters()  # phase: update
    counters.allocate(100 * 2**30)
    counters.free(90 * 2**30)
    memory._restart_peak_counters()  # phase: reshard
    counters.allocate(1 * 2**30)
    assert counters.peak == 11 * 2**30  # what torch's counter alone would answer
    assert memory.allocated_peak_mb() == 100 * 1024
    counters.allocate(200 * 2**30)  # a later moment above every earlier one
    assert memory.allocated_peak_mb() == 211 * 1024


@pytest.mark.gpu
@cuda
def test_a_workers_peak_is_its_largest_phase_not_its_last():
    meter = DeviceMemoryMeter("cuda")
    from hybridrl.observe.memory import allocated_peak_mb

    with meter.watch("actor", "update"):
        block = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
        del block
    with meter.watch("rollout", "reshard"):
        small = torch.empty(2**20, dtype=torch.uint8, device="cuda")
        del small
    assert torch.cuda.max_memory_allocated() < 2**30  # the counter restarted at reshard
    assert allocated_peak_mb() >= 2 * 1024
