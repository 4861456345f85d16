"""Phase timers: every phase of a step is timed and reported as ``timing/<phase>`` seconds, and noted as a span
(its wall-clock start and end) that ``hybridrl.observe.spans`` ties to the devices of the phase's roles."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class PhaseTimer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        #: (phase, start, end) in seconds since the epoch, in the order the phases ended
        self.spans: list[tuple[str, float, float]] = []
        #: when the timer (and so the step it times) began, seconds since the epoch
        self.started = time.time()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start, wall = time.perf_counter(), time.time()
        try:
            yield
        finally:
            took = time.perf_counter() - start
            self.seconds[name] = self.seconds.get(name, 0.0) + took
            self.spans.append((name, wall, wall + took))

    def record(self, name: str, seconds: float) -> None:
        """A phase timed elsewhere (a generation that ran on the rollout's clock, overlapping the driver): its
        span is placed to end now, when its result arrived."""
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        now = time.time()
        self.spans.append((name, now - seconds, now))

    def metrics(self) -> dict[str, float]:
        return {f"timing/{k}": v for k, v in self.seconds.items()}
