"""The driver's side of checkpoints, resume and faults around ``Trainer.fit``.

A checkpoint holds every trainable role's engine state (``TrainEngine.save_checkpoint`` into ``<role>/``,
all ranks at once) and the driver's ``Stateful`` state (``Trainer.state_dict``: the step, the prompt loader's
position, the KL controller, the bad-step counter, the driver's RNG). Rollout, reference and reward-model
engines hold no state of their own: after a resume the rollout gets the restored actor weights through the
normal weight sync. ``Checkpointer`` writes and reads them (the layout is ``hybridrl.run.checkpoint``'s);
``StepGuard`` turns Ctrl-C, a dead worker and bad steps into clean stops with a message.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from hybridrl.placement.plan import PlacementPlan
from hybridrl.roles import trainable_roles
from hybridrl.run import checkpoint as ckpt
from hybridrl.run.faults import BadStepGuard, RunFailure, StopRequest, explain_failure, stop_on_interrupt
from hybridrl.runtime.group import WorkerGroup

log = logging.getLogger(__name__)


class Stateful(Protocol):
    """What the checkpointer saves and restores of the driver (torchtitan's ``Stateful``)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def trained_roles(groups: dict[str, WorkerGroup]) -> list[str]:
    """The roles of this run whose engines hold training state (``roles.trainable_roles``)."""
    return [r for r in trainable_roles() if r in groups]


class Checkpointer:
    """Saves and restores a run under ``<out>/checkpoints``. ``summary`` is what ``driver.json`` records
    besides the step (backends of the trained roles, model path, dtype, options), read by export and by the
    pre-flight check of a resume. ``every``: save every N steps and at step ``last`` (``maybe_save``; 0: only
    when asked, ``save``)."""

    def __init__(self, out: str | Path, keep: int, summary: dict[str, Any], every: int = 0,
                 last: int | None = None, allow_unverified: bool = False) -> None:
        self.out = Path(out)
        self.allow_unverified = allow_unverified  # trainer.resume_unverified: older driver states load too
        self.keep = keep
        self.summary = summary
        self.every, self.last = every, last
        self.last_saved_step: int | None = None
        self.resumed_from: Path | None = None

    def save(self, step: int, driver: Stateful, groups: dict[str, WorkerGroup]) -> Path:
        """A complete checkpoint of the state after ``step`` steps, published atomically."""
        def write(tmp: Path) -> dict[str, Any]:
            for role in trained_roles(groups):
                groups[role].broadcast(role, "save_checkpoint", str((tmp / role).resolve()))
            ckpt.save_driver_state(tmp, driver.state_dict())
            return dict(self.summary)

        folder = ckpt.save_checkpoint(self.out, step, write, self.keep)
        self.last_saved_step = step
        log.info("checkpoint: %s", folder)
        return folder

    def due(self, step: int) -> bool:
        """Whether a checkpoint is due after ``step`` steps (``trainer.save_every``, and the last step)."""
        return self.every > 0 and (step % self.every == 0 or step == self.last)

    def maybe_save(self, step: int, driver: Stateful, groups: dict[str, WorkerGroup]) -> Path | None:
        """``save`` when a checkpoint is due after ``step`` steps; the folder, or None when none was."""
        return self.save(step, driver, groups) if self.due(step) else None

    def restore(self, folder: Path, driver: Stateful, groups: dict[str, WorkerGroup]) -> None:
        """Load every trained role's state and the driver's, and drop the metrics rows logged after the
        checkpoint (those steps run again); call before the first weight sync."""
        roles = trained_roles(groups)
        missing = [r for r in roles if not (folder / r).is_dir()]
        if missing:
            raise ckpt.CheckpointError(f"checkpoint '{folder}' has no state for role(s) {', '.join(missing)} "
                                       "(saved by a run with another algorithm?)")
        state = ckpt.load_driver_state(folder, self.allow_unverified)
        for role in roles:
            groups[role].broadcast(role, "load_checkpoint", str((folder / role).resolve()))
        driver.load_state_dict(state)
        step = int(state["step"])
        dropped = ckpt.trim_metrics(self.out, step)
        self.resumed_from, self.last_saved_step = folder, step
        log.info("resumed from %s (step %d%s)", folder, step,
                 f"; dropped {dropped} metrics row(s) logged after it" if dropped else "")

    def last_checkpoint_message(self) -> str:
        latest, _ = ckpt.newest_intact(self.out, checksums=False)  # sizes against the manifest: cheap, at a fault
        if latest is None:
            return "No checkpoint was saved (set trainer.save_every to save one every N steps)."
        return f"The last checkpoint, {latest}, is intact: rerun the same command to resume from it."


class StepGuard:
    """Around the training loop: the first Ctrl-C asks for a clean stop (the step in flight finishes), a dead
    worker becomes ``WorkerDiedError`` naming its role, rank and device, and steps whose update was skipped
    are counted (``trainer.max_bad_steps`` in a row stop the run)."""

    def __init__(self, max_bad_steps: int, plan: PlacementPlan, checkpointer: Checkpointer) -> None:
        self.bad = BadStepGuard(max_bad_steps)
        self.plan = plan
        self.checkpointer = checkpointer
        self._stop: StopRequest | None = None
        self.stopped_by: int | None = None  # the signal that stopped the last loop (SIGINT, SIGTERM), if any

    @property
    def stop_requested(self) -> bool:
        return self._stop is not None and self._stop.requested

    @property
    def stop_signal(self) -> int | None:
        """The signal that asked for the stop (SIGINT, SIGTERM), during the loop or after it."""
        return self._stop.signum if self._stop is not None else self.stopped_by

    @contextmanager
    def guarding(self, groups: dict[str, WorkerGroup], step: Any) -> Iterator[None]:
        """``step()`` gives the step under way, for the message of a dead worker."""
        with stop_on_interrupt() as stop:
            self._stop = stop
            try:
                with self.explaining(groups, lambda: f"during step {step()}", step):
                    yield
            finally:
                self.stopped_by = stop.signum
                self._stop = None

    @contextmanager
    def explaining(self, groups: dict[str, WorkerGroup] | Callable[[], dict[str, WorkerGroup]], where: Any,
                   step: Any = None) -> Iterator[None]:
        """Out of memory (``hybridrl.run.oom``), a dead worker (also behind a peer's collective error), a failed
        collective or a full disk becomes one error naming it and the last checkpoint
        (``hybridrl.run.faults.explain_failure``); ``where()`` says when ('during step 3', 'during start-up'),
        ``step()`` the step under way (None: start-up); ``groups`` may be a callable (the groups once started)."""
        try:
            yield
        except Exception as exc:
            from hybridrl.run.oom import OutOfMemoryStop, memory_stop

            if isinstance(exc, (OutOfMemoryStop, RunFailure)):  # explained already, by a guard inside this one
                raise
            oom = memory_stop(exc, self.plan, step() if step is not None else None,
                              self.checkpointer.last_checkpoint_message())
            if oom is not None:
                raise oom from exc
            found = groups() if callable(groups) else groups
            from hybridrl.run.node_loss import node_loss_failure

            lost = node_loss_failure(exc, found or {}, where(), self.checkpointer.last_checkpoint_message())
            if lost is not None:  # a node gone: named before its ranks are (explain_failure)
                raise lost from exc
            failure = explain_failure(exc, found, self.plan.cluster.device, where(), self.checkpointer.out,
                                      self.checkpointer.last_checkpoint_message())
            if failure is not None:
                raise failure from exc
            raise

    def observe(self, step: int, metrics: dict[str, float]) -> list[str]:
        """Right after a step: mark it bad or not (metrics ``trainer/bad_step``, ``trainer/bad_steps_in_row``)."""
        reasons = self.bad.observe(metrics)
        if reasons:
            log.warning("step %d: bad step (%s); its update was skipped", step, "; ".join(reasons))
        return reasons

    def check(self, step: int, reasons: list[str]) -> None:
        """Raise ``BadStepsError`` after ``trainer.max_bad_steps`` bad steps in a row."""
        self.bad.check(step, reasons)
