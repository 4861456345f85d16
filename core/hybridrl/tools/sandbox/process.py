"""Running one child for one call: a hard wall-clock deadline, the output read in bounded chunks, and the
child's whole process group killed when the call ends.

Why not ``subprocess.communicate(timeout=...)``: it reads the whole output into memory before anything can cut
it (an endless ``print`` grows the caller by gigabytes), and after a timeout it waits for the pipe to close,
which a grandchild holding stdout can delay for as long as it lives. Here the pipe is read with ``select``
against one deadline; the output beyond ``limit_bytes`` stops the call; at the deadline the group is killed and
the pipe closed on our side, whoever still holds its other end.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

_CHUNK = 65536


@dataclass(frozen=True)
class Outcome:
    """How a child ended. ``output``: the kept start and end of what it printed (stdout and stderr together);
    ``returncode`` None when it was killed by us (deadline or output limit)."""

    output: str
    returncode: int | None
    timed_out: bool = False
    output_capped: bool = False
    seconds: float = 0.0


class BoundedOutput:
    """The first and the last ``keep`` bytes of a stream, and how many bytes went by."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.head = bytearray()
        self.tail: deque[bytes] = deque()
        self.tail_bytes = 0
        self.total = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.keep - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if not chunk:
            return
        self.tail.append(chunk)
        self.tail_bytes += len(chunk)
        while self.tail and self.tail_bytes - len(self.tail[0]) >= self.keep:
            self.tail_bytes -= len(self.tail.popleft())

    def text(self, max_chars: int) -> str:
        tail = b"".join(self.tail)
        if self.total == len(self.head) + len(tail):  # nothing dropped: cut by characters
            return shorten(bytes(self.head + tail).decode("utf-8", "replace"), max_chars)
        head_text = bytes(self.head).decode("utf-8", "replace")[:max_chars // 2]
        tail_text = tail[-self.keep:].decode("utf-8", "replace")[-(max_chars - max_chars // 2):]
        left_out = self.total - len(head_text.encode()) - len(tail_text.encode())
        return f"{head_text}\n... ({left_out} bytes left out) ...\n{tail_text}"


def shorten(text: str, limit: int) -> str:
    """``text`` cut to about ``limit`` characters, keeping its start and its end (where a traceback's message is)."""
    if len(text) <= limit:
        return text
    head = limit // 2
    tail = limit - head
    return f"{text[:head]}\n... ({len(text) - limit} characters left out) ...\n{text[-tail:]}"


def run_child(argv: Sequence[str], stdin: int, timeout_s: float, max_chars: int, limit_bytes: int,
              env: Mapping[str, str], cwd: str, pass_fds: Sequence[int] = (), user: int | None = None) -> Outcome:
    """Run ``argv`` in a new session (its own process group) with ``stdin`` (a file descriptor) and return
    its outcome by ``timeout_s`` seconds from now plus the time a kill takes, whatever the child does.
    ``user``: a uid (and gid) to start it as, with no supplementary groups (the host's root only)."""
    as_user = {} if user is None else {"user": user, "group": user, "extra_groups": []}
    start = time.monotonic()
    end = start + timeout_s
    proc = subprocess.Popen(list(argv), stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=dict(env), cwd=cwd, start_new_session=True, pass_fds=tuple(pass_fds),
                            close_fds=True, **as_user)
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    os.set_blocking(fd, False)
    out = BoundedOutput(max(4 * max_chars, 256))
    timed_out = capped = False
    selector = selectors.DefaultSelector()
    selector.register(fd, selectors.EVENT_READ)
    try:
        while True:
            left = end - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            if not selector.select(left):
                continue
            try:
                chunk = os.read(fd, _CHUNK)
            except BlockingIOError:
                continue
            if not chunk:
                break  # every holder of the pipe closed it
            out.add(chunk)
            if out.total > limit_bytes:
                capped = True
                break
        if not (timed_out or capped) and not _exited(proc.pid, end):
            timed_out = True
    finally:
        selector.close()
        kill_group(proc)
        proc.stdout.close()
        try:
            proc.wait(2.0)
        except subprocess.TimeoutExpired:  # not ours to wait for any longer; Popen reaps it later
            pass
    killed = timed_out or capped
    return Outcome(out.text(max_chars), None if killed else proc.returncode, timed_out, capped,
                   time.monotonic() - start)


def _exited(pid: int, end: float) -> bool:
    """Whether ``pid`` exits by ``end``, left unreaped (a zombie still holds its process group's id, so the
    group can be killed after it without hitting a process that reused the number)."""
    while True:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(0.005)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child's process group (it leads its own session), and the child itself."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.kill()
    except ProcessLookupError:
        pass
