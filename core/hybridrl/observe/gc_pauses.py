"""Seconds the cyclic garbage collector holds a worker's process, per engine call (``gc/<role>.<method>_s``).

A process that hosts a trainer and an in-process inference engine holds millions of long-lived objects (modules,
parameters, compiled graphs, the engine's tables); every full collection walks them all, and a step that makes
many small objects (autograd nodes, scheduler records) triggers collections often. The meter tells that pause from
the compute around it, so a step that runs slower than its parts alone can be checked for it.
"""

from __future__ import annotations

import gc
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class GcPauseMeter:
    """Collector pauses of this process, summed per ``role.method`` call since the last report."""

    def __init__(self) -> None:
        self.paused_s = 0.0
        self.full_collections = 0
        self._started: float | None = None
        self._per_call: dict[str, float] = defaultdict(float)
        self._full_per_call: dict[str, int] = defaultdict(int)
        gc.callbacks.append(self._on_collect)

    def close(self) -> None:
        if self._on_collect in gc.callbacks:
            gc.callbacks.remove(self._on_collect)

    def _on_collect(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.paused_s += time.perf_counter() - self._started
            self.full_collections += info.get("generation") == 2
            self._started = None

    @contextmanager
    def watch(self, role: str, method: str) -> Iterator[None]:
        paused, full = self.paused_s, self.full_collections
        try:
            yield
        finally:
            name = f"{role}.{method}"
            self._per_call[name] += self.paused_s - paused
            self._full_per_call[name] += self.full_collections - full

    def report(self, reset: bool = True) -> dict[str, float]:
        """``{"gc/<role>.<method>_s": seconds, "gc/<role>.<method>_full": full collections}`` since the last
        report."""
        out = {f"gc/{name}_s": s for name, s in self._per_call.items()}
        out.update({f"gc/{name}_full": float(n) for name, n in self._full_per_call.items()})
        if reset:
            self._per_call.clear()
            self._full_per_call.clear()
        return out


def gc_pause_metrics(groups: dict[str, Any]) -> dict[str, float]:
    """Each ``gc/<role>.<method>_s`` / ``_full`` of the step, the largest over the ranks (a collective step
    waits for its slowest rank); roles fused into one process report once."""
    out: dict[str, float] = {}
    seen: set[int] = set()
    for group in groups.values():
        if id(group) in seen:
            continue
        seen.add(id(group))
        try:
            reports = group.call_all("gc_report")
        except Exception:  # noqa: BLE001 - a metric must never stop training
            continue
        for report in reports:
            for key, value in (report or {}).items():
                out[key] = max(out.get(key, 0.0), float(value))
    return out
