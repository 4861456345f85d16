"""Run checkpoints on disk: layout, atomic publication, retention, and finding the one to resume from.

Layout under ``<trainer.out>/checkpoints/``::

    step_000010/             a complete checkpoint (only ever appears by a rename, never half-written)
        actor/  critic/      each trainer's own format (``TrainEngine.save_checkpoint``: sharded, per rank)
        driver.pt            the driver's state between steps (step, data position, KL controller, RNG ...)
        manifest.json        every other file's size and CRC-32, taken when the save completed
        driver.json          a readable summary, written last inside the temporary folder
    .tmp-step_000012/        a save in progress (removed when the save fails; never resumed from)
    latest                   the name of the newest complete checkpoint, replaced atomically after the rename

A crash, a full disk or Ctrl-C during a save therefore leaves the previous checkpoint and ``latest`` as they
were. A checkpoint damaged later (a truncated shard, a file overwritten) is found by comparing its files with
the manifest before it is loaded (``damage``); resuming then falls back to the newest intact one. A checkpoint
without a manifest cannot be verified and is not trusted unless asked (``trainer.resume_unverified``,
``hybridrl export --unverified``), and a file that holds more than tensors and plain data is never loaded
(``hybridrl.run.trusted_files``). The folder must be on a filesystem every worker can write (each rank writes
its own shards). Folders are 0700 and files 0600 (``hybridrl.run.file_modes``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from hybridrl.errors import HybridRLError
from hybridrl.run.faults import disk_problem
from hybridrl.run.file_modes import make_private_tree, open_private, private_dir

CHECKPOINTS = "checkpoints"
LATEST = "latest"
DRIVER_STATE = "driver.pt"
DRIVER_SUMMARY = "driver.json"
MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp-"
FORMAT_VERSION = 1
#: why a checkpoint without a manifest is not trusted (``damage``); the opt-in is ``trainer.resume_unverified``.
UNVERIFIED = (f"{MANIFEST} is missing, so its files cannot be checked against what was saved "
              "(trainer.resume_unverified=true, or export --unverified, trusts it)")
_STEP_DIR = re.compile(r"step_(\d+)")


class CheckpointError(HybridRLError, RuntimeError):
    """No usable checkpoint where one was asked for, or one that does not fit this run."""


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def checkpoints_root(out: str | Path) -> Path:
    return Path(out) / CHECKPOINTS


def is_complete(path: Path) -> bool:
    """A published checkpoint: its name is ``step_N`` (not a temporary one) and its summary was written."""
    return _STEP_DIR.fullmatch(path.name) is not None and (path / DRIVER_SUMMARY).is_file() \
        and (path / DRIVER_STATE).is_file()


def complete_checkpoints(out: str | Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every complete checkpoint of a run, oldest first."""
    root = checkpoints_root(out)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _STEP_DIR.fullmatch(child.name)
        if m and child.is_dir() and is_complete(child):
            found.append((int(m.group(1)), child))
    return sorted(found)


def latest_checkpoint(out: str | Path) -> Path | None:
    """The folder ``latest`` names when it is complete (it may name an older step than another folder: a run
    resumed from an earlier checkpoint continues from there), else the newest complete one, else None."""
    root = checkpoints_root(out)
    pointer = root / LATEST
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if is_complete(named):
            return named
    found = complete_checkpoints(out)
    return found[-1][1] if found else None


def find_checkpoint(out: str | Path, step: int | None = None) -> Path:
    """The checkpoint of ``step`` (default: the latest) of the run in ``out``; ``CheckpointError`` if none."""
    found = complete_checkpoints(out)
    if not found:
        raise CheckpointError(f"no complete checkpoint under '{checkpoints_root(out)}'")
    if step is None:
        latest = latest_checkpoint(out)
        assert latest is not None
        return latest
    for s, path in found:
        if s == step:
            return path
    raise CheckpointError(f"no checkpoint of step {step} under '{checkpoints_root(out)}' "
                          f"(steps: {', '.join(str(s) for s, _ in found)})")


def resolve_resume(resume: str, out: str | Path, skipped: list[tuple[Path, str]] | None = None,
                   allow_unverified: bool = False) -> Path | None:
    """What ``trainer.resume`` points at: ``never`` -> None; ``auto`` -> the newest intact checkpoint in
    ``out`` (None on a fresh run); a path -> that checkpoint folder, or the newest intact one of that run
    folder. Damaged checkpoints passed over are appended to ``skipped`` as ``(folder, why)``; a damaged
    checkpoint named by its own path is an error, as is a run folder with no intact one. A checkpoint without a
    manifest counts as damaged unless ``allow_unverified`` (``trainer.resume_unverified``)."""
    if resume == "never":
        return None
    if resume == "auto":
        found, passed = newest_intact(out, allow_unverified=allow_unverified)
        _extend(skipped, passed)
        if found is None and passed:
            raise CheckpointError(f"every checkpoint under '{checkpoints_root(out)}' is damaged: {_listed(passed)}")
        return found
    path = Path(resume)
    if is_complete(path):
        why = damage(path, allow_unverified=allow_unverified)
        if why:
            raise CheckpointError(f"trainer.resume: checkpoint '{path}' "
                                  f"{'cannot be trusted' if why == UNVERIFIED else 'is damaged'}: {why}")
        return path
    run = path if path.is_dir() and (path / CHECKPOINTS).is_dir() else \
        path.parent if path.is_dir() and path.name == CHECKPOINTS else None
    if run is not None:
        found, passed = newest_intact(run, allow_unverified=allow_unverified)
        _extend(skipped, passed)
        if found is None:
            raise CheckpointError(f"trainer.resume: no intact checkpoint under '{checkpoints_root(run)}'"
                                  + (f" ({_listed(passed)})" if passed else ""))
        return found
    if path.exists():
        raise CheckpointError(f"trainer.resume: '{path}' is neither a complete checkpoint (step_N/ with "
                              f"{DRIVER_SUMMARY}) nor a run folder holding {CHECKPOINTS}/")
    raise CheckpointError(f"trainer.resume: '{path}' does not exist")


def _extend(into: list | None, items: list) -> None:
    if into is not None:
        into.extend(items)


def _listed(passed: list[tuple[Path, str]]) -> str:
    return "; ".join(f"{folder.name}: {why}" for folder, why in passed)


def newest_intact(out: str | Path, checksums: bool = True, allow_unverified: bool = False
                  ) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The checkpoint to continue ``out``'s run from: the one ``latest`` names if intact, else the newest
    intact one of an earlier step (a folder of a later step than ``latest`` names belongs to a line of the run
    that was abandoned for an earlier checkpoint). Returns it (None if there is none) and the damaged ones
    passed over, with why."""
    found = complete_checkpoints(out)
    if not found:
        return None, []
    latest = latest_checkpoint(out)
    assert latest is not None
    limit = next(step for step, path in found if path == latest)
    passed: list[tuple[Path, str]] = []
    for step, path in sorted(found, reverse=True):
        if step > limit:
            continue
        why = damage(path, checksums, allow_unverified)
        if why is None:
            return path, passed
        passed.append((path, why))
    return None, passed


def save_checkpoint(out: str | Path, step: int, write: Callable[[Path], dict[str, Any]], keep: int) -> Path:
    """Write a checkpoint of ``step`` through ``write(tmp_dir) -> summary`` into a temporary folder, rename it
    to ``step_N``, point ``latest`` at it, then keep only the newest ``keep`` (0: all). Any exception
    (a full disk, a worker failing, Ctrl-C) removes the temporary folder and leaves the previous checkpoint
    and ``latest`` untouched, then propagates; one caused by the disk (full, not writable) becomes a
    ``CheckpointError`` that says so and names the folder."""
    root = checkpoints_root(out)
    name = step_dir_name(step)
    tmp, final = root / f"{TMP_PREFIX}{name}", root / name
    try:
        private_dir(root)
        shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a crashed save of the same step
        tmp.mkdir(mode=0o700)
        summary = write(tmp)
        summary = {"format_version": FORMAT_VERSION, "step": step, "saved_at": time.time(), **summary}
        make_private_tree(tmp)  # what the workers wrote under their umask: the owner's only
        write_manifest(tmp)
        _write_atomic(tmp / DRIVER_SUMMARY, json.dumps(summary, indent=2))
        if final.exists():  # the same step saved again (a resumed run re-saving): the new one replaces it
            old = root / f"{TMP_PREFIX}old-{name}"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException as exc:
        why = disk_problem(root, exc) if isinstance(exc, Exception) else None  # before the cleanup frees space
        shutil.rmtree(tmp, ignore_errors=True)
        if why is None:
            raise
        previous = latest_checkpoint(out)
        raise CheckpointError(f"cannot save the checkpoint of step {step} in '{root}': {why}. "
                              + (f"The previous checkpoint, {previous}, is intact. " if previous else "")
                              + "Free some space (or lower trainer.keep_checkpoints, or choose another trainer.out) "
                              "and rerun the same command.") from exc
    _write_atomic(root / LATEST, name)
    prune(out, keep)
    return final


def prune(out: str | Path, keep: int) -> list[Path]:
    """Remove all but the newest ``keep`` complete checkpoints (never the one ``latest`` names) and the
    temporary folders of crashed saves. Returns what was removed."""
    root = checkpoints_root(out)
    removed: list[Path] = []
    for child in root.iterdir() if root.is_dir() else ():
        if child.name.startswith(TMP_PREFIX):
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
    found = complete_checkpoints(out)
    latest = latest_checkpoint(out)
    if keep > 0:
        for _, path in found[:-keep]:
            if path != latest:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


# --- manifest: what the save wrote, to tell an intact checkpoint from a damaged one ------------------------

_CHUNK = 16 << 20


def file_crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)  # releases the GIL: files are checked on several threads at once
    return f"{crc:08x}"


def _files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                  if p.is_file() and p.name not in (MANIFEST, DRIVER_SUMMARY) and not p.name.startswith(TMP_PREFIX))


def _threads() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="hybridrl-crc")


def write_manifest(folder: Path) -> None:
    """Record the size and CRC-32 of every file of a checkpoint being written (CRC-32, as zip archives and
    torch's own files use: it catches truncation and changed bytes, and reads at disk speed)."""
    names = _files(folder)
    with _threads() as pool:
        crcs = list(pool.map(file_crc32, (folder / n for n in names)))
    files = {n: {"bytes": (folder / n).stat().st_size, "crc32": c} for n, c in zip(names, crcs)}
    _write_atomic(folder / MANIFEST, json.dumps({"format": 1, "files": files}, indent=1))


def damage(folder: Path, checksums: bool = True, allow_unverified: bool = False) -> str | None:
    """Why a complete checkpoint cannot be trusted (None: intact): its summary does not parse; it has no manifest
    (``UNVERIFIED``, unless ``allow_unverified``); a file of its manifest is missing, of another size, or
    (``checksums``) of other contents than when it was saved; or a file in it holds more than tensors and
    plain data (``hybridrl.run.trusted_files``: checked without loading it; ``allow_unverified`` admits the
    NumPy RNG state of checkpoints saved before the driver state was plain data)."""
    try:
        summary = json.loads((folder / DRIVER_SUMMARY).read_text())
        if not isinstance(summary, dict) or "step" not in summary:
            raise ValueError("no step")
    except (OSError, ValueError) as exc:
        return f"{DRIVER_SUMMARY} does not parse ({exc})"
    try:
        manifest = json.loads((folder / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        if not allow_unverified:
            return UNVERIFIED
        return _untrusted(folder, allow_unverified) or _driver_state_problem(folder, allow_unverified)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{MANIFEST} does not parse ({exc})"
    problems = []
    sized = []
    for name, entry in manifest.items():
        path = folder / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            problems.append(f"{name} is missing")
            continue
        if size != entry["bytes"]:
            problems.append(f"{name} is {size} bytes, {entry['bytes']} when saved"
                            + (" (truncated)" if size < entry["bytes"] else ""))
        else:
            sized.append(name)
    if checksums and not problems:
        with _threads() as pool:
            crcs = dict(zip(sized, pool.map(file_crc32, (folder / n for n in sized))))
        problems += [f"{n} has other contents than when saved (CRC-32 {crcs[n]}, {manifest[n]['crc32']} when saved)"
                     for n in sized if crcs[n] != manifest[n]["crc32"]]
    if not problems:
        return _untrusted(folder, allow_unverified)
    return "; ".join(problems[:3]) + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else "")


def _untrusted(folder: Path, allow_old: bool) -> str | None:
    """The first file of ``folder`` that loading could make run code, as the refusal (None: none)."""
    from hybridrl.run.trusted_files import refusal, unsafe_files

    found = unsafe_files(folder, allow_old=allow_old)
    return None if not found else refusal(found[0][0], found[0][1])


def _driver_state_problem(folder: Path, allow_old: bool) -> str | None:
    """A checkpoint without a manifest is checked by loading its driver state (plain data only)."""
    try:
        load_driver_state(folder, allow_old)
    except Exception as exc:  # noqa: BLE001 - whatever loading raises, the checkpoint is unusable
        first_line = str(exc).splitlines()[0] if str(exc) else ""
        return f"{DRIVER_STATE} does not load ({type(exc).__name__}: {first_line})"
    return None


def _write_atomic(path: Path, text: str) -> None:
    """Write to a sibling temporary file, fsync, rename over ``path``: readers see the old or the new text."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}")
    with open_private(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# --- driver state ------------------------------------------------------------------------------------------

def rng_state() -> dict[str, Any]:
    """The driver's RNG states (Python, NumPy when present, torch CPU), as plain data: NumPy's array of keys
    becomes a tensor, so the file loads with ``weights_only=True``."""
    import random

    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    except ImportError:  # pragma: no cover - numpy ships with torch's usual installs
        pass
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import random

    python = state["python"]  # (version, tuple of ints, gauss): a list after a round trip through some loaders
    random.setstate((python[0], tuple(python[1]), python[2]))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        saved = state["numpy"]
        if isinstance(saved, dict):
            keys = saved["keys"].numpy().astype(np.uint32)
            np.random.set_state((saved["kind"], keys, saved["pos"], saved["has_gauss"], saved["cached_gaussian"]))
        else:  # a checkpoint saved before the state was plain data (loaded under trainer.resume_unverified)
            np.random.set_state(saved)


def save_driver_state(folder: Path, state: dict[str, Any]) -> None:
    torch.save(state, folder / DRIVER_STATE)


def load_driver_state(folder: Path, allow_old: bool = False) -> dict[str, Any]:
    """The driver state of a checkpoint: tensors and plain data only (``CheckpointError`` naming the file for
    anything else, before any of it is built; ``allow_old``: also the NumPy RNG state of older checkpoints)."""
    from hybridrl.run.trusted_files import UntrustedFileError, load_plain

    try:
        return load_plain(folder / DRIVER_STATE, allow_old=allow_old)
    except UntrustedFileError as exc:
        raise CheckpointError(str(exc)) from None


def trim_metrics(out: str | Path, step: int) -> int:
    """Drop the rows of ``metrics.jsonl`` (and ``samples.jsonl``) past ``step``: steps logged after the
    checkpoint a run resumes from are run again and logged again. Returns how many metrics rows were dropped."""
    trim_step_rows(Path(out) / "samples.jsonl", step)
    return trim_step_rows(Path(out) / "metrics.jsonl", step)


def trim_step_rows(path: Path, step: int) -> int:
    """Keep the JSON lines of ``path`` whose ``step`` is at most ``step`` (and drop a line cut by a crash)."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            row_step = json.loads(line).get("step", 0)
        except json.JSONDecodeError:  # a line cut by a crash
            dropped += 1
            continue
        if row_step > step:
            dropped += 1
        else:
            kept.append(line)
    if dropped:
        _write_atomic(path, "".join(line + "\n" for line in kept))
    return dropped
