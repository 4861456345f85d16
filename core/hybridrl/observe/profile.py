"""Kernel profiles of named engine calls inside a real run (``trainer.profile_step``, ``trainer.profile_calls``).

A phase can run slower inside the colocated step than the same engine call alone (a benchmark of the train side,
say): the worker that hosts the role wraps the named call of the chosen step in ``torch.profiler`` and writes the
kernels (or, on a CPU, the operators) that took the most time, so both runs can be laid side by side.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch


def top_kernels(prof: Any, device: bool, limit: int = 25) -> list[dict[str, Any]]:
    """The events of a finished ``torch.profiler.profile`` that took the most self time: device time where a
    device was profiled (kernels), CPU time otherwise (operators); name, calls, milliseconds and share."""
    def self_us(event: Any) -> float:
        return float(event.self_device_time_total if device else event.self_cpu_time_total)

    rows = [e for e in prof.key_averages() if self_us(e) > 0]
    total = sum(self_us(e) for e in rows) or 1.0
    rows.sort(key=self_us, reverse=True)
    return [{"name": e.key[:120], "calls": e.count, "ms": self_us(e) / 1e3, "share": self_us(e) / total}
            for e in rows[:limit]]


@contextmanager
def profiled(limit: int = 25) -> Iterator[dict[str, Any]]:
    """The block under ``torch.profiler``; the dict it yields holds, once the block is done, its seconds (the
    device synchronised), the device and the top events (``top_kernels``)."""
    from torch.profiler import profile

    cuda = _cuda_in_use()
    report: dict[str, Any] = {}
    with profile(activities=_activities(cuda)) as prof:
        start = time.perf_counter()
        yield report
        if cuda:
            torch.cuda.synchronize()
        report["seconds"] = time.perf_counter() - start
    report.update(device="cuda" if cuda else "cpu", top=top_kernels(prof, device=cuda, limit=limit))


def profile_call(fn: Callable[..., Any], *args: Any, limit: int = 25, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
    """``fn(*args, **kwargs)`` under ``torch.profiler``: its result, and the top events with the call's seconds."""
    with profiled(limit) as report:
        result = fn(*args, **kwargs)
    return result, report


class CallProfiler:
    """Which ``role.method`` calls of this worker to profile next, and where their reports go. Each armed name
    is profiled once, at its next call, then disarmed."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.armed: set[str] = set()
        self.out_dir: Path | None = None
        self.step = 0

    def arm(self, names: list[str], out_dir: str, step: int) -> None:
        self.armed, self.out_dir, self.step = set(names), Path(out_dir), step

    @contextmanager
    def around(self, role: str, method: str) -> Iterator[None]:
        """Nothing unless ``role.method`` is armed; then the report is written once the call returns."""
        name = f"{role}.{method}"
        if name not in self.armed or self.out_dir is None:
            yield
            return
        self.armed.discard(name)
        with profiled() as report:
            yield
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"step{self.step}_{name}_rank{self.rank}.json"
        path.write_text(json.dumps({"step": self.step, "call": name, "rank": self.rank, **report}, indent=1))


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _activities(cuda: bool) -> list[Any]:
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
