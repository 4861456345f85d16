"""``trainer.out``, the run folder: whether a run may start in it, and moving a previous run aside.

A run never mixes with another one and never deletes one. It continues the run in its folder (a resume
from a checkpoint there), or starts in a folder that holds no previous run: absent, empty, or holding only
what a run writes before its first step (``config.json``, the tiny models, an empty ``samples.jsonl``).
Anything else (metrics, phase spans, samples, checkpoints, tracker folders, files that are not a run's) is refused,
unless ``hybridrl train --overwrite``, which renames the folder to a sibling ``<name>.old-<time>`` first.
Everything here runs in pre-flight, before anything is written.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from hybridrl.observe.spans import SPANS_FILE
from hybridrl.run import checkpoint as ckpt
from hybridrl.run.faults import not_writable
from hybridrl.run.run_lock import LOCK_FILE, refuse_if_live
from hybridrl.runtime.device_map import DEVICE_MAP_FILE

#: what a run writes before its first step; a folder holding only these has nothing to lose.
START_UP_ENTRIES = frozenset({"config.json", "init_model", "reward_model", "samples.jsonl", DEVICE_MAP_FILE})
#: what a run records as it trains; a folder holding any of these holds a previous run.
RECORD_ENTRIES = frozenset({"metrics.jsonl", ckpt.CHECKPOINTS, "tensorboard", "wandb", "mlruns", "report"})


def previous_run(out: Path) -> list[str]:
    """What in ``out`` would be lost or mixed if a new run started there (empty: nothing). Each item names
    an entry: ``metrics.jsonl (12 rows)``, ``checkpoints/ (step_000010)``, ``notes.txt (not a run's)``."""
    if not out.is_dir():
        return []
    held = []
    for entry in sorted(out.iterdir()):
        name = entry.name
        if name in ("samples.jsonl", "metrics.jsonl", SPANS_FILE):
            rows = _rows(entry)
            if rows:
                held.append(f"{name} ({rows} row{'s' if rows != 1 else ''})")
        elif name == ckpt.CHECKPOINTS:
            steps = [p.name for p in sorted(entry.iterdir())] if entry.is_dir() else [""]
            if steps:
                held.append(f"{name}/ ({', '.join(steps[:4])}{' ...' if len(steps) > 4 else ''})")
        elif name in RECORD_ENTRIES:
            held.append(f"{name}{'/' if entry.is_dir() else ''}")
        elif name == "config.json" and _is_run_config(entry):
            continue
        elif name in START_UP_ENTRIES and entry.is_dir():
            continue  # the tiny models: rebuilt from the config, or refused by their builder if foreign
        elif name == DEVICE_MAP_FILE:
            continue  # written anew at each start
        elif name == LOCK_FILE:
            continue  # who ran here last (hybridrl.run.run_lock): no record of its own
        else:
            held.append(f"{name}{'/' if entry.is_dir() else ''} (not a run's)")
    return held


def _rows(path: Path) -> int:
    try:
        with path.open("rb") as f:
            return sum(1 for line in f if line.strip())
    except OSError:
        return 1  # unreadable: count it as held, never as nothing


def _is_run_config(path: Path) -> bool:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and {"model", "data", "trainer"} <= data.keys()


def aside_name(out: Path) -> Path:
    """The sibling an ``--overwrite`` moves ``out`` to: ``<name>.old-YYYYmmdd-HHMMSS`` (``-2``, ``-3`` ... if taken)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = out.with_name(f"{out.name}.old-{stamp}")
    n = 2
    while target.exists():
        target = out.with_name(f"{out.name}.old-{stamp}-{n}")
        n += 1
    return target


def move_aside(out: Path) -> Path:
    """Rename ``out`` to ``aside_name(out)`` (same parent, so one atomic rename; nothing is copied or removed),
    holding its lock meanwhile: a run that started in it since the pre-flight is not moved under its feet
    (``RunLocked``)."""
    from hybridrl.run.run_lock import acquire

    old = acquire(out, "--overwrite would move it aside under its feet")
    target = aside_name(out)
    try:
        os.rename(out, target)
    finally:
        old.release()
    return target


@dataclass
class RunFolderPlan:
    """What pre-flight decided about ``trainer.out``: the checkpoint to resume (None: a new run), whether the
    previous run there is moved aside first (``--overwrite``), the problems that refuse the run, the notes
    to print (damaged checkpoints passed over)."""

    out: Path
    resume_from: Path | None = None
    move_aside: list[str] = field(default_factory=list)  # what is moved (empty: nothing)
    problems: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    allow_unverified: bool = False  # trainer.resume_unverified


def plan_run_folder(out: str | Path, resume: str, overwrite: bool = False,
                    resume_unverified: bool = False) -> RunFolderPlan:
    """Decide, without writing anything, whether and how a run may use ``out`` (see the module docstring);
    ``resume_unverified`` (``trainer.resume_unverified``) trusts checkpoints without a manifest."""
    out = Path(out)
    plan = RunFolderPlan(out, allow_unverified=resume_unverified)
    if out.exists() and not out.is_dir():
        plan.problems.append(("trainer.out", f"'{out}' exists and is not a folder"))
        return plan
    live = refuse_if_live(out, "--overwrite would move it aside under its feet" if overwrite else
                          "a second run in it would mix its metrics and checkpoints with the live one's")
    if live:
        plan.problems.append(("trainer.out", live))
        return plan
    for folder in (out, ckpt.checkpoints_root(out)):
        if folder == out or folder.is_dir():
            why = not_writable(folder)
            if why:
                plan.problems.append(("trainer.out", f"{why}: the run writes its metrics and checkpoints there"))
                return plan
    held = previous_run(out)
    if overwrite:
        if resume not in ("auto", "never") and held and _inside(Path(resume), out):
            plan.problems.append(("trainer.resume", f"'{resume}' is inside trainer.out '{out}', which --overwrite "
                                                    "moves aside; resume from it without --overwrite"))
            return plan
        plan.move_aside = held
        if resume not in ("auto", "never"):
            plan.resume_from = _resolve(resume, out, plan)
        return plan
    plan.resume_from = _resolve(resume, out, plan)
    if plan.problems or not held or (plan.resume_from is not None and _inside(plan.resume_from, out)):
        return plan
    if resume == "never":
        why = "trainer.resume=never starts a new run"
    elif plan.resume_from is not None:
        why = f"trainer.resume names another run's checkpoint ({plan.resume_from})"
    else:
        why = "it has no checkpoint to resume from"
    plan.problems.append(("trainer.out", f"'{out}' holds a previous run ({', '.join(held)}) and {why}, which would "
                                         f"mix with it or replace it; pass --overwrite to move it aside (to "
                                         f"'{aside_name(out)}') and start afresh, or choose another trainer.out"))
    return plan


def _resolve(resume: str, out: Path, plan: RunFolderPlan) -> Path | None:
    skipped: list[tuple[Path, str]] = []
    try:
        found = ckpt.resolve_resume(resume, out, skipped, plan.allow_unverified)
    except ckpt.CheckpointError as exc:
        plan.problems.append(("trainer.resume", str(exc).removeprefix("trainer.resume: ")))
        found = None
    plan.notes += [f"skipped the {'unverified' if why == ckpt.UNVERIFIED else 'damaged'} checkpoint {path}: {why}"
                   for path, why in skipped]
    if found is not None and skipped:
        plan.notes.append(f"resuming from {found}, the newest intact checkpoint"
                          + (" with a manifest" if any(why == ckpt.UNVERIFIED for _, why in skipped) else ""))
    return found


def _inside(path: Path, folder: Path) -> bool:
    return path.resolve().is_relative_to(folder.resolve())
