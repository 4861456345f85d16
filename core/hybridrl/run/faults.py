"""What the driver does when a step goes wrong: a worker process died (also when it shows only as a
collective error on its peers), the disk is full or not writable, the update was not finite, the user
pressed Ctrl-C or the scheduler sent SIGTERM. Each ends the run with one message that says what happened and
where the last checkpoint is, instead of a traceback."""

from __future__ import annotations

import errno
import logging
import math
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hybridrl.errors import HybridRLError

log = logging.getLogger(__name__)

#: metric keys whose non-finite value makes a step bad (besides any ``<role>/skipped_step`` > 0).
FINITE_KEYS = ("reward/mean", "actor/loss", "critic/vf_loss")


class RunFailure(HybridRLError, RuntimeError):
    """A run stopped by a fault it names (the CLI prints the message and exits with status 1)."""


class WorkerDiedError(RunFailure):
    """A worker process of the run is gone (killed, out of memory, segfault, node lost)."""


class BadStepsError(RunFailure):
    """Too many steps in a row whose update was skipped or whose loss was not finite."""


class CollectiveError(RunFailure):
    """A collective operation (gloo, NCCL) failed or timed out while every worker still answers."""


class WorkerHangError(RunFailure):
    """Workers that did not answer within ``trainer.step_timeout_s``: stopped, deadlocked, or in a collective that
    hangs (``hybridrl.runtime.deadline``)."""


class DiskError(RunFailure):
    """The run could not write its metrics or samples: no space left, or a folder that is not writable."""


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


def dead_workers(groups: dict[str, Any], exc: BaseException | None = None, timeout_s: float = 10.0
                 ) -> list[tuple[Any, int]]:
    """``(group, rank)`` of every worker that is gone: named by the error's actor id, or found by pinging every
    worker at once. A dead actor's ping fails at once; a busy one (still in a collective, say) just does not
    answer within ``timeout_s`` and counts as alive."""
    import ray
    from ray.exceptions import RayActorError

    unique = list({id(g): g for g in groups.values()}.values())
    actor_id = getattr(exc, "actor_id", None)
    named = [(g, r) for g in unique for r, w in enumerate(g.workers)
             if actor_id is not None and _actor_id(w) == actor_id]
    if named:
        return named
    pings = {w.peak_memory_mb.remote(): (g, r) for g in unique for r, w in enumerate(g.workers)}
    ready, _ = ray.wait(list(pings), num_returns=len(pings), timeout=timeout_s)
    dead = []
    for ref in ready:
        try:
            ray.get(ref)
        except RayActorError:
            dead.append(pings[ref])
        except Exception:  # noqa: BLE001 - it answered (with an error): alive
            pass
    return sorted(dead, key=lambda gr: (unique.index(gr[0]), gr[1]))


def describe_workers(found: list[tuple[Any, int]], device_kind: str) -> str:
    parts = []
    for group, rank in found:
        plan = group.plan
        device = plan.devices[rank] if rank < len(plan.devices) else "?"
        parts.append(f"role {'+'.join(plan.roles)} (pool '{plan.pool}'), rank {rank} of {plan.world_size}, "
                     f"{device_kind} device {device}")
    return "the worker process of " + "; ".join(parts) + " died"


def describe_dead_worker(groups: dict[str, Any], device_kind: str, exc: BaseException) -> str:
    """Which worker died: its roles, rank, device (``dead_workers``)."""
    found = dead_workers(groups, exc)
    return describe_workers(found, device_kind) if found else "a worker process died (could not tell which)"


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


#: what a collective error says in gloo's, NCCL's and torch.distributed's words (lower case).
COLLECTIVE_MARKERS = ("gloo", "nccl", "connection closed by peer", "connection reset by peer", "broken pipe",
                      "distbackenderror", "processgroup", "timed out", "timeout", "tcpstore")


def is_collective_error(exc: BaseException) -> bool:
    """A remote call failed inside a collective operation: the usual sign of a peer that died (gloo's
    'Connection closed by peer', NCCL's errors) or of a collective that timed out."""
    from ray.exceptions import RayTaskError

    distributed = any(type(e).__name__ in ("DistBackendError", "DistNetworkError", "DistError") for e in _chain(exc))
    if not (distributed or isinstance(exc, RayTaskError)):  # a collective runs in a worker: its error is remote
        return False
    cause = getattr(exc, "cause", None)  # the worker's own exception: its message, not Ray's copy of its traceback
    cause = cause if isinstance(cause, BaseException) else exc
    text = f"{type(cause).__name__} {cause}".lower()
    return any(marker in text for marker in COLLECTIVE_MARKERS)


def first_line(exc: BaseException) -> str:
    """The last line of a remote error that says what happened (Ray prints the worker's traceback first)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException) and str(cause).strip():
        exc = cause
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}"[:500]


# --- disks ---------------------------------------------------------------------------------------------

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_NOT_WRITABLE = {errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
                 errno.EPERM: "permission denied"}
_TEXT = (("no space left on device", "no space left on device"), ("disk quota exceeded", "no space left on device"),
         ("read-only file system", "not writable (read-only file system)"),
         ("permission denied", "not writable (permission denied)"))


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, its causes and contexts, the cause a Ray error carries and DCP's per-rank failures."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__, getattr(e, "cause", None)]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f for f in failures.values() if isinstance(f, BaseException)]
    return


def nearest_existing(path: Path) -> Path:
    """``path``, or its closest ancestor that exists."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def not_writable(path: Path) -> str | None:
    """Why nothing can be created in ``path`` (or, when it does not exist yet, in the folder that would hold
    it): 'read-only file system' or 'permission denied'; None when it can. Where ``access()`` says yes (always,
    for root), an empty folder is made and removed there: a filesystem that takes none (``/proc``) says so."""
    where = nearest_existing(path)
    if os.access(where, os.W_OK | os.X_OK):
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".hybridrl-probe-", dir=where))
        except OSError as exc:
            return f"'{where}' is not writable ({(exc.strerror or str(exc)).lower()})"
        return None
    try:  # access() says why only through errno; statvfs tells a read-only mount from permissions
        read_only = bool(os.statvfs(where).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    return f"'{where}' is not writable ({os.strerror(errno.EROFS if read_only else errno.EACCES).lower()})"


def disk_problem(path: str | Path, exc: BaseException | None = None) -> str | None:
    """Why writing under ``path`` failed, if the disk is the cause: 'no space left on device (N MiB free of M)'
    or 'not writable (...)'; None when it is not. Read from the error (its errno, or its text when it crossed
    a process boundary) and from the filesystem itself: torch's writers report a full disk only as
    'enforce fail at inline_container.cc'."""
    for e in _chain(exc) if exc is not None else ():
        code = getattr(e, "errno", None)
        if code in _NO_SPACE:
            return f"no space left on device{_free(path)}"
        if code in _NOT_WRITABLE:
            return f"not writable ({_NOT_WRITABLE[code]})"
    text = str(exc).lower() if exc is not None else ""
    for marker, what in _TEXT:
        if marker in text:
            return what + (_free(path) if what.startswith("no space") else "")
    if exc is not None and not _looks_like_a_write(exc):
        return None
    why = not_writable(Path(path))
    if why:
        return why.split("' is ", 1)[-1]
    usage = shutil.disk_usage(nearest_existing(Path(path)))
    if usage.free < max(64 << 20, usage.total // 100):
        return f"no space left on device{_free(path)}"
    return None


def _looks_like_a_write(exc: BaseException) -> bool:
    """An error that a failed write can be behind (worth asking the filesystem about)."""
    if any(isinstance(e, OSError) or type(e).__name__ == "CheckpointException" for e in _chain(exc)):
        return True
    text = str(exc).lower()
    return any(word in text for word in ("inline_container", "write", "checkpointexception", "i/o error"))


def _free(path: str | Path) -> str:
    try:
        usage = shutil.disk_usage(nearest_existing(Path(path)))
    except OSError:
        return ""
    return f" ({usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.0f} MiB)"


# --- explaining a failure --------------------------------------------------------------------------------

def explain_failure(exc: Exception, groups: dict[str, Any], device_kind: str, where: str, out: str | Path,
                    last_checkpoint: str) -> RunFailure | None:
    """The fault behind ``exc`` as one message (None: not a fault of the run's environment, let it through):
    a worker that died, also when a peer's collective error is all that surfaced; a collective that failed
    while every worker answers; workers that did not answer within ``trainer.step_timeout_s``; a disk that is
    full or not writable. ``where``: 'during step 3'."""
    from hybridrl.runtime.deadline import WorkersNotAnswering

    if isinstance(exc, WorkersNotAnswering):
        return WorkerHangError(f"{exc.describe()} {where}: stopped, deadlocked or stuck in a collective, so the run "
                               f"stops and its workers are torn down. {last_checkpoint}")
    if is_worker_death(exc) or is_collective_error(exc):
        found = dead_workers(groups, exc) if groups else []
        if found:
            seen = "" if is_worker_death(exc) else "; its peers saw it as a collective error"
            return WorkerDiedError(f"{describe_workers(found, device_kind)} {where}{seen}. {last_checkpoint}"
                                   f"\n  ({first_line(exc)})")
        if is_worker_death(exc):
            return WorkerDiedError(f"a worker process died {where} (could not tell which). {last_checkpoint}"
                                   f"\n  ({first_line(exc)})")
        return CollectiveError(f"a collective operation failed {where} while every worker still answers "
                               f"(a network fault, or a collective that timed out). {last_checkpoint}"
                               f"\n  ({first_line(exc)})")
    if any(isinstance(e, OSError) and getattr(e, "errno", None) in (*_NO_SPACE, *_NOT_WRITABLE) for e in _chain(exc)):
        target = next((getattr(e, "filename", None) for e in _chain(exc) if getattr(e, "filename", None)), None)
        why = disk_problem(target or out, exc)
        return DiskError(f"cannot write {target or f'into {out}'} {where}: {why}. {last_checkpoint} Free some "
                         "space (or choose another trainer.out) and rerun the same command.")
    return None


# --- signals ---------------------------------------------------------------------------------------------

#: exit status after a signal, as a shell reports a process it killed (128 + the signal's number).
EXIT_STATUS = {signal.SIGINT: 130, signal.SIGTERM: 143}


class Terminated(BaseException):
    """SIGTERM raised at once (what ``KeyboardInterrupt`` is for SIGINT): outside the training loop, or on a
    second signal inside it."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def signal_name(signum: int | None) -> str:
    return "Ctrl-C" if signum in (None, signal.SIGINT) else signal.Signals(signum).name


def _raise_now(signum: int, frame: Any) -> None:
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Terminated(signum)


def on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextmanager
def signals_raise() -> Iterator[None]:
    """SIGTERM raises ``Terminated`` like SIGINT raises ``KeyboardInterrupt``, so that start-up and the steps'
    surroundings unwind (and stop the workers) instead of being killed (Ray's own driver handler calls exit
    from wherever it lands, which aborts in its C++ core)."""
    if not on_main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_now)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def signals_deferred(note: Callable[[int], None] | None = None) -> Iterator[list[int]]:
    """Hold SIGINT and SIGTERM while the run stops its workers and its Ray (a second Ctrl-C landing in
    ``ray.shutdown`` used to leave Ray's agents running); the signals received are yielded, in order."""
    received: list[int] = []
    if not on_main_thread():
        yield received
        return

    def hold(signum: int, frame: Any) -> None:
        received.append(signum)
        (note or (lambda s: log.warning("%s: stopping the workers first, one moment", signal_name(s))))(signum)

    previous = {s: signal.signal(s, hold) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield received
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


class StopRequest:
    """Set by the first Ctrl-C (SIGINT) or SIGTERM while training: the step in flight finishes, a checkpoint is
    saved, the run ends cleanly (exit status 130 or 143). A second signal stops at once (``KeyboardInterrupt``
    or ``Terminated``)."""

    def __init__(self) -> None:
        self.signum: int | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = signum
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, _raise_now)
        log.warning("%s: finishing this step, then saving a checkpoint (%s again to stop at once)",
                    signal_name(signum), "Ctrl-C" if signum == signal.SIGINT else "the signal")


@contextmanager
def stop_on_interrupt() -> Iterator[StopRequest]:
    """Install the SIGINT and SIGTERM handlers for the training loop (main thread only; elsewhere signals
    are untouched)."""
    request = StopRequest()
    if not on_main_thread():
        yield request
        return
    previous = {s: signal.signal(s, request._handle) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield request
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
