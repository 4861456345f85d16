"""What the driver does when a step goes wrong: a worker process died, the update was not finite, the user
pressed Ctrl-C. Each ends the run with a message that says what happened and where the last checkpoint is."""

from __future__ import annotations

import math
import signal
import threading
from contextlib import contextmanager
from typing import Any, Iterator

#: metric keys whose non-finite value makes a step bad (besides any ``<role>/skipped_step`` > 0).
FINITE_KEYS = ("reward/mean", "actor/loss", "critic/vf_loss")


class WorkerDiedError(RuntimeError):
    """A worker process of the run is gone (killed, out of memory, segfault, node lost)."""


class BadStepsError(RuntimeError):
    """Too many steps in a row whose update was skipped or whose loss was not finite."""


def bad_step_reasons(metrics: dict[str, float]) -> list[str]:
    """Why a step's update cannot be trusted: an engine skipped its optimiser step (a non-finite gradient
    norm, reported as ``<role>/skipped_step``), or a loss or the reward is NaN/inf."""
    reasons = []
    for key, value in metrics.items():
        if key.endswith("/skipped_step") and value > 0:
            reasons.append(f"{key.split('/')[0]} skipped its update (non-finite gradient norm)")
    for key in FINITE_KEYS:
        if key in metrics and not math.isfinite(float(metrics[key])):
            reasons.append(f"{key} is {metrics[key]}")
    return reasons


class BadStepGuard:
    """Counts bad steps in a row; the ``max_bad``-th raises ``BadStepsError`` (0: never stop)."""

    def __init__(self, max_bad: int) -> None:
        self.max_bad = max_bad
        self.in_row = 0

    def observe(self, metrics: dict[str, float]) -> list[str]:
        """Adds ``trainer/bad_step`` and ``trainer/bad_steps_in_row`` to ``metrics``; returns the reasons."""
        reasons = bad_step_reasons(metrics)
        self.in_row = self.in_row + 1 if reasons else 0
        metrics["trainer/bad_step"] = float(bool(reasons))
        metrics["trainer/bad_steps_in_row"] = float(self.in_row)
        return reasons

    def check(self, step: int, reasons: list[str]) -> None:
        if reasons and self.max_bad and self.in_row >= self.max_bad:
            raise BadStepsError(f"{self.in_row} bad steps in a row (trainer.max_bad_steps={self.max_bad}), the last "
                                f"at step {step}: {'; '.join(reasons)}. Updates were skipped, so the weights are "
                                "those before the first bad step; check the reward function, the learning rate "
                                "and the data")


def describe_dead_worker(groups: dict[str, Any], device_kind: str, exc: BaseException) -> str:
    """Which worker died: its roles, rank, device. Found from the error's actor id, else by pinging every
    worker (a dead one answers with an error at once)."""
    import ray

    actor_id = getattr(exc, "actor_id", None)
    unique = {id(g): g for g in groups.values()}.values()
    dead: list[tuple[Any, int]] = []
    for group in unique:
        for rank, worker in enumerate(group.workers):
            if actor_id is not None and _actor_id(worker) == actor_id:
                dead.append((group, rank))
    if not dead:
        for group in unique:
            for rank, worker in enumerate(group.workers):
                try:
                    ray.get(worker.peak_memory_mb.remote(), timeout=30)
                except Exception:  # noqa: BLE001 - any failure to answer marks it dead
                    dead.append((group, rank))
    if not dead:
        return "a worker process died (could not tell which)"
    parts = []
    for group, rank in dead:
        plan = group.plan
        device = plan.devices[rank] if rank < len(plan.devices) else "?"
        parts.append(f"role {'+'.join(plan.roles)} (pool '{plan.pool}'), rank {rank} of {plan.world_size}, "
                     f"{device_kind} device {device}")
    return "the worker process of " + "; ".join(parts) + " died"


def _actor_id(worker: Any) -> str | None:
    try:
        return worker._actor_id.hex()
    except AttributeError:
        return None


def is_worker_death(exc: BaseException) -> bool:
    try:
        from ray.exceptions import RayActorError
    except ImportError:  # pragma: no cover - ray is a core dependency
        return False
    return isinstance(exc, RayActorError)


class StopRequest:
    """Set by the first Ctrl-C (SIGINT) while training: the step in flight finishes, a checkpoint is saved,
    the run ends cleanly. A second Ctrl-C interrupts at once (the default ``KeyboardInterrupt``)."""

    def __init__(self) -> None:
        self.requested = False

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True
        signal.signal(signal.SIGINT, signal.default_int_handler)
        print("\ninterrupt: finishing this step, then saving a checkpoint (Ctrl-C again to stop at once)", flush=True)


@contextmanager
def stop_on_interrupt() -> Iterator[StopRequest]:
    """Install the SIGINT handler for the training loop (main thread only; elsewhere Ctrl-C is untouched)."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = signal.signal(signal.SIGINT, request._handle)
    try:
        yield request
    finally:
        signal.signal(signal.SIGINT, previous)
