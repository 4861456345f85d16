"""Metric trackers (console, jsonl), registered through the tracker hook like any plugin's."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Protocol

from hybridrl import hookimpl

CONSOLE_KEYS = ("reward/mean", "response_length/mean", "actor/kl_loss", "actor/entropy", "timing/step")


class Tracker(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class JsonlTracker:
    """One JSON object per step in ``<out>/metrics.jsonl`` (always on), flushed every step so a crash
    loses nothing already logged."""

    def __init__(self, out_dir: str, config: dict[str, Any] | None = None, resume: bool = False) -> None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        self.path = Path(out_dir) / "metrics.jsonl"
        self._file = self.path.open("a" if resume else "w")

    def log(self, metrics: dict[str, float], step: int) -> None:
        row = {"step": step, **{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

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


@hookimpl
def hybridrl_register_trackers(registry):
    registry.add_tracker("jsonl", JsonlTracker)
    registry.add_tracker("console", ConsoleTracker)
