"""The busy fraction measured on the device (``hybridrl.observe.device_busy``): the sampler fed by an injected
utilisation function, the NVML device it would read, and the driver's choice of NVML's value where a worker
sampled one, else the span-based one. CPU only: no GPU and no NVML library."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

import pytest
from _span_helpers import fractional_plan, split_plan, timer_with

from hybridrl.observe.device_busy import BusySampler, merge_busy, nvml_target, nvml_utilisation, sampled_busy
from hybridrl.observe.spans import SpanLog

STEP_PHASES = [("data", 0.0, 0.5), ("gen", 0.5, 4.5), ("reward", 4.5, 5.0), ("ref", 5.0, 6.0),
               ("update_actor", 6.0, 9.0), ("reshard", 9.0, 10.0)]
SPAN_BUSY = {"device/train.0/busy": 0.5, "device/train.1/busy": 0.5, "device/gen.0/busy": 0.5,
             "device/gen.1/busy": 0.5}  # STEP_PHASES on split_plan, from the spans


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def sampler_of(values: list[float], clock: Clock, step: float = 0.5) -> BusySampler:
    """A sampler that has taken ``values`` (percent), one every ``step`` seconds of ``clock``."""
    source = iter(values)
    sampler = BusySampler(lambda: next(source), clock=clock)
    for _ in values:
        assert sampler.sample()
        clock.now += step
    return sampler


def test_the_fraction_is_the_mean_utilisation_of_the_windows_samples():
    clock = Clock(1000.0)
    sampler = sampler_of([100, 100, 0, 50, 0, 0], clock)  # at 1000.0, 1000.5 ... 1002.5
    assert sampler.fractions([(1000.0, 1001.5)])[0] == pytest.approx((1.0 + 1.0 + 0.0 + 0.5) / 4)
    assert sampler.fractions([(1002.0, 1003.0)])[0] == 0.0  # an idle GPU
    assert sampler.fractions([(1000.0, 1003.0)])[0] == 0.0  # those before the last window asked for were dropped
    assert sampler.fractions([(1010.0, 1011.0)])[0] is None  # no sample in the window: the driver keeps the spans


def test_utilisation_outside_0_to_100_is_clipped():
    sampler = sampler_of([150, -5], Clock())
    assert sampler.fractions([(0.0, 2000.0)])[0] == pytest.approx(0.5)


def test_a_failing_source_stops_the_sampling():
    clock = Clock()

    def utilisation() -> float:
        raise RuntimeError("NVML: not supported")

    sampler = BusySampler(utilisation, clock=clock)
    assert not sampler.sample() and "not supported" in (sampler.failed or "")
    assert not sampler.sample()
    assert sampler.fractions([(0.0, 2000.0)])[0] is None


def test_the_thread_samples_until_stopped():
    seen: list[float] = []

    def utilisation() -> float:
        seen.append(time.time())
        return 80.0

    sampler = BusySampler(utilisation, interval=0.01)
    begun = time.time()
    sampler.start()
    deadline = time.time() + 5.0
    while len(seen) < 5 and time.time() < deadline:
        time.sleep(0.01)
    sampler.stop()
    taken = len(seen)
    assert taken >= 5 and sampler.fractions([(begun, time.time())])[0] == pytest.approx(0.8)
    time.sleep(0.05)
    assert len(seen) == taken  # stopped


@pytest.mark.parametrize(("index", "visible", "target"), [
    (0, None, 0), (1, "", 1), (0, "3", 3), (1, "2,5", 5), (0, "GPU-8f6c, GPU-1a2b", "GPU-8f6c"),
])
def test_the_nvml_device_is_the_physical_one_behind_cuda_visible_devices(index, visible, target):
    assert nvml_target(index, visible) == target


def test_without_nvml_or_a_cuda_device_there_is_no_sampler(monkeypatch):
    assert nvml_utilisation("cpu") is None
    monkeypatch.setitem(sys.modules, "pynvml", None)  # importing it raises ImportError: not installed
    assert nvml_utilisation("cuda") is None


@dataclass
class Pool:
    pool: str


class Group:
    """A worker group's ``call_all("busy_report", windows)``: per rank, a constant fraction for every window, a
    sampler's answer, None (no sampler), or an error for the whole group."""

    def __init__(self, pool: str, answers: list[float | BusySampler | None] | Exception) -> None:
        self.plan = Pool(pool)
        self.answers = answers
        self.asked: list[tuple[Any, ...]] = []

    def call_all(self, method: str, *args: Any) -> list[list[float | None] | None]:
        self.asked.append((method, *args))
        if isinstance(self.answers, Exception):
            raise self.answers
        (windows,) = args
        return [a.fractions(windows) if isinstance(a, BusySampler) else None if a is None else [a] * len(windows)
                for a in self.answers]


def test_nvml_values_replace_the_span_based_ones_device_by_device():
    train = Group("train", [0.25, None])  # rank 1 did not sample
    gen = Group("gen", [0.75, 0.8])
    groups = {"actor": train, "ref": train, "rollout": gen}  # fused roles share a group: asked once
    metrics = SpanLog.for_plan(split_plan(), None).record_step(1, timer_with(STEP_PHASES), 10.0, 40, 100, groups)
    assert metrics == {"device/train.0/busy": 0.25, "device/train.1/busy": pytest.approx(0.5),
                       "device/gen.0/busy": 0.75, "device/gen.1/busy": 0.8, "device/busy_sampled": 0.75,
                       "busy/gen": pytest.approx(0.775), "busy/ref": 0.25, "busy/update_actor": 0.25,
                       "busy/reshard": pytest.approx((0.25 + 0.75 + 0.8) / 3)}  # reshard: both pools' devices
    # one call a group: the step's wall-clock window, then each pooled phase's
    assert train.asked == [("busy_report", [(1000.0, 1010.0), (1000.5, 1004.5), (1005.0, 1006.0), (1006.0, 1009.0),
                                            (1009.0, 1010.0)])]


def test_each_phase_gets_the_share_sampled_while_it_ran():
    """A host-bound generation (30 % of its seconds in kernels) beside a compute-bound update (90 %), sampled by
    real samplers on a clock the test moves: the phases' shares tell them apart where the step's mean does not."""
    clock = Clock(1000.0)
    samplers = [BusySampler(lambda: 0.0, clock=clock) for _ in range(2)]
    for tenth in range(100):  # 10 s of samples, every 0.1 s
        clock.now = 1000.0 + tenth / 10
        level = 30.0 if 0.5 <= tenth / 10 < 4.5 else 90.0 if 5.0 <= tenth / 10 < 9.0 else 0.0
        for sampler in samplers:
            sampler.utilisation = lambda level=level: level
            assert sampler.sample()
    groups = {"actor": Group("train", samplers), "rollout": Group("gen", [None, None])}
    metrics = SpanLog.for_plan(split_plan(), None).record_step(1, timer_with(STEP_PHASES), 10.0, 40, 100, groups)
    assert metrics["busy/update_actor"] == pytest.approx(0.9, abs=0.03)
    assert metrics["busy/ref"] == pytest.approx(0.9, abs=0.1)  # its window's edges: 1005.0 sampled at 90
    assert "busy/gen" not in metrics  # the rollout's devices were not sampled: no share is made up
    gen_on_train = {"actor": Group("train", samplers), "rollout": Group("gen", samplers)}  # a guest pool
    plan = fractional_plan()
    metrics = SpanLog.for_plan(plan, None).record_step(1, timer_with(STEP_PHASES), 10.0, 40, 100, gen_on_train)
    assert metrics["busy/gen"] == pytest.approx(0.3, abs=0.03)


def test_without_nvml_the_span_based_value_is_used(caplog):
    groups = {"actor": Group("train", [None, None]), "rollout": Group("gen", RuntimeError("worker gone"))}
    log = SpanLog.for_plan(split_plan(), None)
    with caplog.at_level("INFO", logger="hybridrl.observe.spans"):
        metrics = log.record_step(1, timer_with(STEP_PHASES), 10.0, 40, 100, groups)
        log.record_step(2, timer_with(STEP_PHASES, 1020.0), 10.0, 40, 100, groups)
    assert metrics == {**{k: pytest.approx(v) for k, v in SPAN_BUSY.items()}, "device/busy_sampled": 0.0}
    lines = [r.getMessage() for r in caplog.records if "busy fractions" in r.getMessage()]
    assert lines == ["device busy fractions: from the phase spans on all 4 device(s) (no NVML sampling)"]  # once
    assert SpanLog.for_plan(split_plan(), None).record_step(1, timer_with(STEP_PHASES), 10.0, 40, 100) == \
        pytest.approx(SPAN_BUSY)  # no groups given: the spans, as before


def test_processes_sharing_a_device_report_the_largest_fraction():
    groups = {"actor": Group("main", [0.2, 0.6]), "rollout": Group("main", [0.5, None])}
    assert sampled_busy(groups, [(0.0, 1.0)]) == {("main", 0): [0.5], ("main", 1): [0.6]}
    merged, sampled = merge_busy({("main", 0): 0.9, ("main", 1): 0.9, ("main", 2): 0.9}, {("main", 1): 0.6})
    assert merged == {("main", 0): 0.9, ("main", 1): 0.6, ("main", 2): 0.9} and sampled == 1


def test_a_sampler_answers_each_window_of_one_call():
    clock = Clock(1000.0)
    sampler = sampler_of([100, 100, 0, 50, 0, 0], clock)  # at 1000.0, 1000.5 ... 1002.5
    assert sampler.fractions([(1000.0, 1002.5), (1000.0, 1000.5), (1001.0, 1001.5), (1005.0, 1006.0)]) == \
        [pytest.approx(250 / 600), 1.0, 0.25, None]


def test_a_cpu_worker_has_no_sampler_and_reports_none():
    from hybridrl.runtime.worker import RoleWorker

    worker = RoleWorker(0, 1, "cpu")
    try:
        assert worker.busy is None and worker.busy_report([(0.0, 1.0)]) is None
    finally:
        worker.gc_pauses.close()


def test_a_fractional_pool_is_counted_on_its_hosts_devices(caplog):
    """The rollout's pool on the trainers' GPUs (fractional): one device each, not two; its spans and its
    workers' NVML samples land on the host's ranks, and the log counts 2 devices, not 4."""
    phases = [("gen", 0.0, 6.0), ("ref", 5.0, 6.0), ("update_actor", 6.0, 8.0)]
    log = SpanLog.for_plan(fractional_plan(), None)
    assert SpanLog.for_plan(fractional_plan(), None).record_step(1, timer_with(phases), 10.0, 40, 100) == \
        {"device/train.0/busy": pytest.approx(0.8), "device/train.1/busy": pytest.approx(0.8)}
    groups = {"actor": Group("train", [0.4, None]), "rollout": Group("gen", [0.7, None])}
    with caplog.at_level("INFO", logger="hybridrl.observe.spans"):
        metrics = log.record_step(1, timer_with(phases), 10.0, 40, 100, groups)
    assert metrics == {"device/train.0/busy": 0.7, "device/train.1/busy": pytest.approx(0.8),
                       "device/busy_sampled": 0.5,  # the larger of the two processes' samples of GPU 0
                       "busy/gen": pytest.approx(0.7), "busy/ref": 0.7, "busy/update_actor": 0.7}
    assert any("sampled on 1 of 2 device(s)" in r.getMessage() for r in caplog.records)
