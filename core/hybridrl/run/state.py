"""The driver's side of checkpoints, resume and faults: what a run saves between steps, how it comes back,
and the checks around each step of ``Trainer.fit``.

A checkpoint holds every trainable role's engine state (``TrainEngine.save_checkpoint`` into ``<role>/``,
all ranks at once) and the driver's state: the step, the prompt loader's position, the KL controller, the
bad-step counter and the driver's RNG. Rollout, reference and reward-model engines hold no state of their
own: after a resume the rollout gets the restored actor weights through the normal weight sync.
"""

from __future__ import annotations

import dataclasses
import inspect
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from hybridrl.roles import trainable_roles
from hybridrl.run import checkpoint as ckpt
from hybridrl.run.faults import BadStepGuard, StopRequest, WorkerDiedError, describe_dead_worker, is_worker_death, \
    stop_on_interrupt

if TYPE_CHECKING:
    from hybridrl.run.trainer import Trainer



class RunState:
    """Checkpoint, resume and fault handling for one ``Trainer``."""

    def __init__(self, trainer: "Trainer") -> None:
        self.trainer = trainer
        self.tcfg = trainer.cfg.trainer
        self.out = Path(self.tcfg.out)
        self.guard = BadStepGuard(self.tcfg.max_bad_steps)
        self.resumed_from: Path | None = None
        self.last_saved_step: int | None = None
        self.interrupted = False
        self._stop: StopRequest | None = None

    # --- resume ---------------------------------------------------------------------------------------
    def resume_point(self) -> Path | None:
        """The checkpoint pre-flight chose, verified and fitted to this run (``RunSetup.resume_from``)."""
        return self.trainer.setup.resume_from

    def roles(self) -> list[str]:
        return [r for r in trainable_roles() if r in self.trainer.groups]

    def restore(self, folder: Path) -> None:
        """Load every trainer's state and the driver's; call before the first weight sync."""
        state = ckpt.load_driver_state(folder)
        missing = [r for r in self.roles() if not (folder / r).is_dir()]
        if missing:
            raise ckpt.CheckpointError(f"checkpoint '{folder}' has no state for role(s) {', '.join(missing)} "
                                       "(saved by a run with another algorithm?)")
        for role in self.roles():
            self.trainer.groups[role].call_all("call", role, "load_checkpoint", str((folder / role).resolve()))
        t = self.trainer
        t.step = int(state["step"])
        t.loader.load_state_dict(state["loader"])
        if t.kl_ctrl is not None and state.get("kl_ctrl") is not None:
            for key, value in state["kl_ctrl"].items():
                setattr(t.kl_ctrl, key, value)
        self.guard.in_row = int(state.get("bad_steps_in_row", 0))
        ckpt.set_rng_state(state["rng"])
        dropped = ckpt.trim_metrics(self.out, t.step)
        self.resumed_from, self.last_saved_step = folder, t.step
        print(f"resumed from {folder} (step {t.step}"
              + (f"; dropped {dropped} metrics row(s) logged after it" if dropped else "") + ")", flush=True)
        if t.step >= self.tcfg.steps:
            print(f"the run is already at trainer.steps={self.tcfg.steps}: raise it to train on", flush=True)

    def make_trackers(self) -> list[Any]:
        """The configured trackers; a resumed run appends to the metrics it already has."""
        cfg = self.trainer.cfg
        trackers = []
        for name in cfg.trainer.trackers:
            cls = self.trainer.registry.get("tracker", name)
            resume = self.resumed_from is not None and "resume" in inspect.signature(cls).parameters
            kwargs = {"resume": True} if resume else {}
            trackers.append(cls(cfg.trainer.out, cfg.model_dump(mode="json"), **kwargs))
        return trackers

    # --- save -----------------------------------------------------------------------------------------
    def save(self) -> Path:
        """A complete checkpoint of the state after ``trainer.step`` steps (see ``hybridrl.run.checkpoint``)."""
        t = self.trainer

        def write(tmp: Path) -> dict[str, Any]:
            for role in self.roles():
                t.groups[role].call_all("call", role, "save_checkpoint", str((tmp / role).resolve()))
            ckpt.save_driver_state(tmp, {
                "step": t.step, "loader": t.loader.state_dict(),
                "kl_ctrl": dataclasses.asdict(t.kl_ctrl) if t.kl_ctrl is not None else None,
                "bad_steps_in_row": self.guard.in_row, "rng": ckpt.rng_state()})
            return {"roles": {r: t.setup.plan.group_of(r).roles[r] for r in self.roles()},
                    "model_path": str(Path(t.setup.model_path).resolve()), "dtype": t.cfg.model.dtype,
                    "actor_options": _actor_options(t), "seed": t.cfg.trainer.seed,
                    "model_signatures": t.setup.model_signatures, "data_rows": t.loader.num_rows}

        folder = ckpt.save_checkpoint(self.out, t.step, write, self.tcfg.keep_checkpoints)
        self.last_saved_step = t.step
        print(f"checkpoint: {folder}", flush=True)
        return folder

    # --- around each step -----------------------------------------------------------------------------
    @contextmanager
    def guarding(self) -> Iterator[None]:
        """For the training loop: Ctrl-C asks for a clean stop, a dead worker becomes ``WorkerDiedError``."""
        with stop_on_interrupt() as stop:
            self._stop = stop
            try:
                yield
            except Exception as exc:
                if is_worker_death(exc):
                    where = describe_dead_worker(self.trainer.groups, self.trainer.setup.plan.cluster.device, exc)
                    raise WorkerDiedError(f"{where} during step {self.trainer.step + 1}. {self._last_checkpoint()}"
                                          f"\n  ({type(exc).__name__}: {str(exc).strip().splitlines()[0]})") from exc
                raise
            finally:
                self._stop = None

    def observe(self, metrics: dict[str, float]) -> list[str]:
        """Right after a step: mark it bad or not (metrics ``trainer/bad_step``, ``trainer/bad_steps_in_row``)."""
        reasons = self.guard.observe(metrics)
        if reasons:
            print(f"step {self.trainer.step}: bad step ({'; '.join(reasons)}); its update was skipped", flush=True)
        return reasons

    def end_of_step(self, reasons: list[str]) -> bool:
        """After the step is logged: stop on too many bad steps, save when due, honour Ctrl-C. True: stop."""
        self.guard.check(self.trainer.step, reasons)
        every, step = self.tcfg.save_every, self.trainer.step
        if every and (step % every == 0 or step == self.tcfg.steps):
            self.save()
        if self._stop is not None and self._stop.requested:
            self.interrupted = True
            if self.last_saved_step != step and self.roles():
                try:
                    self.save()
                except NotImplementedError as exc:  # a backend without checkpoints (preflight refuses save_every)
                    print(f"could not save a checkpoint: {exc}", flush=True)
            print(f"stopped at step {step} on Ctrl-C; rerun the same command to resume", flush=True)
            return True
        return False

    def _last_checkpoint(self) -> str:
        latest = ckpt.latest_checkpoint(self.out)
        if latest is None:
            return "No checkpoint was saved (set trainer.save_every to save one every N steps)."
        return f"The last checkpoint, {latest}, is intact: rerun the same command to resume from it."


def _actor_options(trainer: "Trainer") -> dict[str, Any]:
    from hybridrl.runtime.launch import role_options

    return role_options(trainer.cfg, "actor")
