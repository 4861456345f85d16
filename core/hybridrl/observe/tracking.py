"""Metric trackers, registered through the tracker hook like any plugin's.

Every tracker is built as ``cls(out_dir, config_dict)`` and called ``log(metrics, step)`` / ``close()``;
metric names stay flat (``reward/mean``), the trainer step is the x-axis, and the run's config is logged
once. ``console`` and ``jsonl`` need nothing; ``tensorboard`` writes ``<out>/tensorboard``; ``wandb`` and
``mlflow`` import their package only when selected and say which package to install when it is missing.
"""

from __future__ import annotations

import inspect
import json
import math
import numbers
import os
from pathlib import Path
from typing import Any, Protocol

from hybridrl import hookimpl

CONSOLE_KEYS = ("reward/mean", "val/reward/mean", "response_length/mean", "actor/kl_loss", "actor/entropy",
                "timing/step")


class Tracker(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class JsonlTracker:
    """One JSON object per step in ``<out>/metrics.jsonl`` (always on), flushed every step so a crash
    loses nothing already logged."""

    def __init__(self, out_dir: str, config: dict[str, Any] | None = None, resume: bool = False) -> None:
        from hybridrl.run.file_modes import open_private, private_dir

        private_dir(out_dir)
        self.path = Path(out_dir) / "metrics.jsonl"
        self._file = open_private(self.path, "a" if resume else "w")  # 0600: the run's owner reads it

    def log(self, metrics: dict[str, float], step: int) -> None:
        row = {"step": step, **{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                for k, v in metrics.items()}}
        try:
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()
        except OSError as exc:  # a write error does not say which file: name it (a full disk ends the run)
            raise OSError(exc.errno, exc.strerror, str(self.path)) from exc

    def close(self) -> None:
        self._file.close()


class ConsoleTracker:
    """A short line per step with the metrics people watch; written through tqdm so the bar stays intact."""

    def __init__(self, out_dir: str, config: dict[str, Any] | None = None, resume: bool = False) -> None:
        pass

    def log(self, metrics: dict[str, float], step: int) -> None:
        from tqdm import tqdm

        parts = [f"step {step}"]
        for key in CONSOLE_KEYS:
            if key in metrics:
                parts.append(f"{key}={metrics[key]:.4g}")
        tqdm.write("  ".join(parts))

    def close(self) -> None:
        pass


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of ``metrics`` as floats (strings, None, NaN and inf are left out)."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, numbers.Real) and math.isfinite(float(value)):
            out[key] = float(value)
    return out


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": "1"}``; lists as JSON (for trackers whose params are flat strings)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value if isinstance(value, str) else json.dumps(value)
    return out


def require(module: str, tracker: str, install: str) -> Any:
    """Import ``module`` for ``tracker``, or raise an ImportError that says what to install."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"the '{tracker}' tracker needs the '{module}' package, which is not installed: "
                          f"pip install {install}  (or drop '{tracker}' from trainer.trackers)") from exc


class TensorBoardTracker:
    """Scalars in ``<out>/tensorboard`` (``tensorboard --logdir <out>/tensorboard``); the config as a text
    summary at step 0."""

    #: module -> pip name, checked before the run starts (``hybridrl.run.checks.tracker_problems``).
    requires = {"tensorboard": "tensorboard"}

    def __init__(self, out_dir: str, config: dict[str, Any] | None = None, resume: bool = False) -> None:
        require("tensorboard", "tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(out_dir) / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.log_dir))
        if config is not None and not resume:
            text = json.dumps(config, indent=2, sort_keys=True)
            self.writer.add_text("config", "    " + text.replace("\n", "\n    "), global_step=0)  # a code block

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in scalars(metrics).items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()  # a step takes seconds: flushing each keeps the dashboard live for nothing

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A Weights & Biases run under ``<out>/wandb`` (project: ``$WANDB_PROJECT`` or ``hybridrl``; name: the
    out folder's). ``WANDB_MODE=offline`` works without a network (``wandb sync`` uploads later). A resumed
    run continues the same W&B run (its id is kept in ``<out>/wandb_run_id``)."""

    #: module -> pip name, checked before the run starts (``hybridrl.run.checks.tracker_problems``).
    requires = {"wandb": "wandb"}

    def __init__(self, out_dir: str, config: dict[str, Any] | None = None, resume: bool = False) -> None:
        wandb = require("wandb", "wandb", "wandb")
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        id_file = out / "wandb_run_id"
        kwargs: dict[str, Any] = {}
        if resume and id_file.is_file():
            kwargs = {"id": id_file.read_text().strip(), "resume": "allow"}
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "hybridrl"), name=out.resolve().name,
                              dir=str(out), config=config or {}, **kwargs)
        id_file.write_text(self.run.id)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(scalars(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """An MLflow run in a local file store at ``<out>/mlruns`` (``mlflow ui --backend-store-uri <out>/mlruns``)
    unless ``MLFLOW_TRACKING_URI`` names another; experiment ``$MLFLOW_EXPERIMENT_NAME`` or ``hybridrl``. The
    config goes in once as flattened params and as the artifact ``config.json``."""

    #: module -> pip name, checked before the run starts (``hybridrl.run.checks.tracker_problems``).
    requires = {"mlflow": "mlflow-skinny"}

    MAX_BATCH = 100  # params/metrics per request the tracking API accepts

    def __init__(self, out_dir: str, config: dict[str, Any] | None = None, resume: bool = False) -> None:
        require("mlflow", "mlflow", "mlflow-skinny  (the tracking client; or the full mlflow)")
        from mlflow.tracking import MlflowClient

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            # MLflow 3 keeps the file store behind an opt-in; a run folder is exactly where one belongs
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (out / "mlruns").resolve().as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "hybridrl")
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        id_file = out / "mlflow_run_id"
        if resume and id_file.is_file():
            self.run_id = id_file.read_text().strip()
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(experiment_id, run_name=out.resolve().name).info.run_id
            id_file.write_text(self.run_id)
            if config is not None:
                self._log_config(config)

    def _log_config(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(k, v[:6000]) for k, v in flatten(config).items()]
        for i in range(0, len(params), self.MAX_BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + self.MAX_BATCH])
        self.client.log_dict(self.run_id, config, "config.json")

    def log(self, metrics: dict[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        rows = [Metric(k, v, now, step) for k, v in scalars(metrics).items()]
        for i in range(0, len(rows), self.MAX_BATCH):
            self.client.log_batch(self.run_id, metrics=rows[i:i + self.MAX_BATCH])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def build_trackers(registry: Any, names: list[str], out_dir: str, config: dict[str, Any],
                   resume: bool) -> list[Tracker]:
    """The configured trackers (``trainer.trackers``); a resumed run appends to what they already logged.
    Every registered tracker takes ``(out_dir, config)``; one that also takes ``resume`` is told so."""
    from hybridrl.config.secrets import redacted

    config = redacted(config)  # a tracker may upload it (W&B, MLflow): never a secret in clear
    trackers = []
    for name in names:
        cls = registry.get("tracker", name)
        kwargs = {"resume": True} if resume and "resume" in inspect.signature(cls).parameters else {}
        trackers.append(cls(out_dir, config, **kwargs))
    return trackers


@hookimpl
def hybridrl_register_trackers(registry):
    registry.add_tracker("jsonl", JsonlTracker)
    registry.add_tracker("console", ConsoleTracker)
    registry.add_tracker("tensorboard", TensorBoardTracker)
    registry.add_tracker("wandb", WandbTracker)
    registry.add_tracker("mlflow", MlflowTracker)
