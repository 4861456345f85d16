"""How long the driver waits for its workers (``trainer.step_timeout_s``), and what it says when they do not
answer.

A worker that is stopped, deadlocked or stuck in a collective whose peer is gone does not fail: its result
never comes. Without a deadline the driver waits for it for ever. Every wait of the driver on worker results
(``WorkerGroup`` calls, the weight broadcast) is given ``CallDeadline.timeout_s()``; at expiry it raises
``WorkersNotAnswering`` naming the role, the method and the ranks whose result did not come.

``auto`` (the default) is derived from the run's own steps: until a step has finished (start-up: engines built,
weights loaded and synced, then the first step with its compilation and warm-up) ``STARTUP_S`` (30 min: loading
a 70B checkpoint from network storage and capturing CUDA graphs take minutes); after, ``FACTOR`` times the
slowest step so far, at least ``FLOOR_S`` (10 min), so that a step that is slow now and then (a checkpoint
save, a validation pass, a long generation) is never taken for a hang, and a real hang is named within
minutes, not hours. A number is used as it is, for every wait.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: ``auto``: the allowance before the first step has finished (start-up and the first step).
STARTUP_S = 1800.0
#: ``auto``: at least this long once steps have been timed.
FLOOR_S = 600.0
#: ``auto``: this many times the slowest step so far.
FACTOR = 10.0


@dataclass(frozen=True)
class Silent:
    """The ranks of one worker group whose result of ``what`` (``role.method``) did not come."""

    roles: tuple[str, ...]
    pool: str
    ranks: tuple[int, ...]
    world_size: int
    what: str

    def describe(self) -> str:
        which = "rank" if len(self.ranks) == 1 else "ranks"
        return (f"role {'+'.join(self.roles)} (pool '{self.pool}'), {which} "
                f"{', '.join(str(r) for r in self.ranks)} of {self.world_size} ({self.what})")


class WorkersNotAnswering(RuntimeError):
    """Ranks of worker groups whose results did not come within the deadline (stopped, deadlocked, or in a
    collective that hangs); the run's guard turns it into ``WorkerHangError`` with the checkpoint to resume."""

    def __init__(self, silent: list[Silent], timeout_s: float, setting: str) -> None:
        self.silent, self.timeout_s, self.setting = silent, timeout_s, setting
        super().__init__(self.describe())

    def describe(self) -> str:
        return (f"{'; '.join(s.describe() for s in self.silent)} did not answer within {self.timeout_s:.0f}s "
                f"(trainer.step_timeout_s={self.setting})")


class CallDeadline:
    """The seconds a wait on workers may take: a number, or ``auto`` from the slowest step seen."""

    def __init__(self, setting: float | str = "auto") -> None:
        self.setting = setting
        self.slowest_step_s: float | None = None

    def observe_step(self, seconds: float) -> None:
        """A step finished in ``seconds`` (the driver's wall time of the whole step)."""
        self.slowest_step_s = max(seconds, self.slowest_step_s or 0.0)

    def timeout_s(self) -> float:
        if self.setting != "auto":
            return float(self.setting)
        if self.slowest_step_s is None:
            return STARTUP_S
        return max(FLOOR_S, FACTOR * self.slowest_step_s)

    def label(self) -> str:
        return str(self.setting) if self.setting != "auto" else "auto"


@dataclass
class Waited:
    """Futures of one worker group to wait for: ``futures[i]`` is the result of rank ``ranks[i]`` (default i)."""

    group: Any  # WorkerGroup
    futures: list[Any]
    what: str
    ranks: list[int] | None = None


def wait_all(parts: list[Waited], deadline: CallDeadline | None) -> list[list[Any]]:
    """``ray.get`` of every part's futures, all within one deadline (None: no limit); the results per part.
    A rank that failed is reported as its own error (a dead worker is not a hang, even while its peers hang in
    a collective with it); ranks whose result did not come raise ``WorkersNotAnswering``."""
    import ray

    futures = [f for part in parts for f in part.futures]
    if deadline is not None and futures:
        timeout = deadline.timeout_s()
        ready, pending = ray.wait(futures, num_returns=len(futures), timeout=timeout)
        if pending:
            if ready:
                ray.get(ready)  # raises the error of a rank that failed (a dead worker), if any
            late = set(pending)
            silent = []
            for part in parts:
                ranks = part.ranks or list(range(len(part.futures)))
                missing = tuple(sorted(r for r, f in zip(ranks, part.futures) if f in late))
                if missing:
                    plan = part.group.plan
                    silent.append(Silent(tuple(plan.roles), plan.pool, missing, plan.world_size, part.what))
            raise WorkersNotAnswering(silent, timeout, deadline.label())
    return [ray.get(part.futures) for part in parts]
