"""One run per folder: ``<trainer.out>/.lock``, an advisory ``flock`` the driver holds for the run's life.

Two drivers writing one folder interleave their metrics and overwrite each other's checkpoints, and an
``--overwrite`` that moves a live run aside sends its later checkpoints into the new run's folder. So the driver
takes an exclusive ``flock`` on ``.lock`` before it writes anything and keeps it until its process ends; the file
holds who took it (host, pid, start time, as JSON) so a refusal can name the holder. The kernel drops a
``flock`` when its process dies, however it dies: a lock file whose lock nobody holds was left by a run that is
gone, and is taken over (said in one line). ``hybridrl export`` only looks (``holder``): it writes nothing.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from hybridrl.errors import HybridRLError

LOCK_FILE = ".lock"


class RunLocked(HybridRLError, RuntimeError):
    """The folder is held by a live run."""

    exit_status = 2


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) a run folder's lock."""

    host: str
    pid: int
    since: float

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.since))
        return f"host {self.host}, pid {self.pid}, since {when}"

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        try:
            data = json.loads(text)
            return cls(str(data["host"]), int(data["pid"]), float(data["since"]))
        except (ValueError, KeyError, TypeError):
            return None


@dataclass
class RunLock:
    """A held lock; ``took_over`` names the gone run whose lock file this one replaced (None: a fresh one)."""

    folder: Path
    fd: int
    inode: int
    took_over: Holder | None = None

    def note(self) -> str | None:
        if self.took_over is None:
            return None
        return (f"took over the lock of {self.folder} left by a run that is gone "
                f"({self.took_over.describe()})")

    def release(self) -> None:
        """Drop the lock, clearing the record: the next run finds a lock file no run left behind."""
        if self.fd >= 0:
            _HELD.pop(str(self.folder.resolve()), None)
            try:
                os.ftruncate(self.fd, 0)
            except OSError:  # a full or read-only disk: the record stays, the next run takes it over
                pass
            os.close(self.fd)  # closing the only descriptor drops the flock
            self.fd = -1


#: the locks this process holds, by folder: a driver may check its folder twice (pre-flight, then start).
_HELD: dict[str, RunLock] = {}


def _read(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, 4096).decode(errors="replace")


def _refusal(folder: Path, holder: Holder | None, what: str) -> str:
    who = holder.describe() if holder is not None else "a process that left no record in its .lock"
    return (f"'{folder}' is in use by a live run ({who}): {what}. Wait for it to end, stop it, or choose "
            "another folder")


def acquire(folder: str | Path, what: str = "a second run cannot use it") -> RunLock:
    """Take ``folder``'s lock (creating the folder, 0700, and its ``.lock``) for this process's life. Raises
    ``RunLocked`` naming the holder when a live process holds it; taking it from a gone run is recorded in
    ``took_over``. Taking it again in the process that holds it returns the held lock."""
    from hybridrl.run.file_modes import private_dir

    folder = private_dir(folder)
    path = folder / LOCK_FILE
    key = str(folder.resolve())
    held = _HELD.get(key)
    if held is not None:
        try:
            if os.stat(path).st_ino == held.inode:
                return held
        except FileNotFoundError:
            pass
        held.release()  # the folder was moved aside (--overwrite): its lock goes with it
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = Holder.parse(_read(fd))
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise RunLocked(_refusal(folder, holder, what)) from None
        raise
    previous = Holder.parse(_read(fd))
    me = Holder(socket.gethostname(), os.getpid(), time.time())
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, json.dumps({"host": me.host, "pid": me.pid, "since": me.since}).encode())
    os.fsync(fd)
    lock = RunLock(folder, fd, os.fstat(fd).st_ino, previous)
    _HELD[key] = lock
    return lock


def release(folder: str | Path) -> None:
    """Drop this process's lock of ``folder``, if it holds one (a run that ended)."""
    held = _HELD.get(str(Path(folder).resolve()))
    if held is not None:
        held.release()


def holder(folder: str | Path) -> Holder | None:
    """The live run holding ``folder`` (None: none, or one this process holds), found without writing: a shared
    ``flock`` that is refused means an exclusive one is held."""
    path = Path(folder) / LOCK_FILE
    if str(Path(folder).resolve()) in _HELD:
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None  # no lock file: no run since locks exist; unreadable: nothing to tell
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return Holder.parse(_read(fd)) or Holder("?", 0, 0.0)
            raise
        return None
    finally:
        os.close(fd)


def refuse_if_live(folder: str | Path, what: str) -> str | None:
    """The refusal to print when a live run holds ``folder`` (None: it may be used)."""
    found = holder(folder)
    return None if found is None else _refusal(Path(folder), found if found.pid else None, what)
