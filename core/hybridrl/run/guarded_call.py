"""Calling user code (a reward, an environment) once, in a child process with a deadline, before any worker starts.

User code can hang, call ``sys.exit``/``os._exit`` or kill its own process; called in the driver, each of those
would stop pre-flight forever or end the driver without a word. ``call_in_child`` runs ``fn(*args)`` in a
*spawned* child (never forked: the driver may hold Ray's threads, which a fork copies in whatever state they
are) and returns its value, or raises ``ChildFailure`` with a short reason: ``timed out after 10s``,
``called sys.exit(3)``, ``ended its process with exit status 3``, ``was killed by signal 9 (SIGKILL)``,
``raised KeyError: 'x'``. ``fn`` and ``args`` must pickle (a module-level function, plain data).

Deadlines: the child has ``start_timeout_s`` to start (import and unpickle ``fn`` and its arguments, which is
not the user code's time), then ``timeout_s`` for ``fn``. The child can say what it is about to call with
``note(text)``: each note starts a fresh ``timeout_s`` (one per user call) and the last one comes back with a
failure, so a hang inside the second of several functions is blamed on that one. With ``noted``, the work of
``fn`` before its first note is set-up too (building a registry), under ``start_timeout_s``.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import time
from collections.abc import Callable
from typing import Any

_conn: Any = None  # the child's end of the pipe, while a guarded call runs in this process


class ChildFailure(Exception):
    """The guarded call did not return a value: ``reason`` says how; ``last_note`` what it was doing."""

    def __init__(self, reason: str, last_note: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.last_note = last_note


def note(text: str) -> None:
    """In a guarded child: record what is about to run (a no-op elsewhere)."""
    if _conn is not None:
        _conn.send(("note", text))


def _child_main(conn: Any, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    global _conn
    _conn = conn
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's: it kills the child
    conn.send(("started", None))
    try:
        value = fn(*args)
    except SystemExit as exc:
        conn.send(("failed", f"called sys.exit({exc.code!r})"))
        return
    except BaseException as exc:  # noqa: BLE001 - reported to the driver as one line
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        conn.send(("failed", f"raised {type(exc).__name__}" + (f": {text[:200]}" if text else "")))
        return
    try:
        conn.send(("ok", value))
    except Exception as exc:  # noqa: BLE001 - a value that does not pickle
        conn.send(("failed", f"returned a {type(value).__name__} that cannot be sent back ({exc})"))


def describe_exit(code: int | None) -> str:
    """How a child process ended, from its exit code (negative: the signal that killed it)."""
    if code is None:
        return "ended its process"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown"
        return f"was killed by signal {-code} ({name})"
    return f"ended its process with exit status {code}"


def call_in_child(fn: Callable[..., Any], args: tuple[Any, ...], timeout_s: float,
                  start_timeout_s: float = 60.0, noted: bool = False) -> Any:
    """``fn(*args)`` in a spawned child; its value, or ``ChildFailure`` once the child fails, exits, does not
    start within ``start_timeout_s`` or runs past ``timeout_s`` (see the module's docstring). The child is always
    gone on return."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_child_main, args=(child, fn, args), daemon=True, name="hybridrl-guarded")
    process.start()
    child.close()
    in_call = False  # the deadline is timeout_s (else start_timeout_s)
    deadline = time.monotonic() + start_timeout_s
    last_note: str | None = None
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not parent.poll(remaining):
                raise ChildFailure(f"timed out after {timeout_s:g}s" if in_call else
                                   f"did not start within {start_timeout_s:g}s", last_note)
            try:
                kind, payload = parent.recv()
            except (EOFError, OSError):
                process.join(timeout=5)
                raise ChildFailure(describe_exit(process.exitcode), last_note) from None
            if kind == "note" or (kind == "started" and not noted):
                in_call = True
                deadline = time.monotonic() + timeout_s
                last_note = payload if kind == "note" else last_note
            elif kind == "started":
                deadline = time.monotonic() + start_timeout_s
            elif kind == "ok":
                return payload
            else:
                raise ChildFailure(payload, last_note)
    finally:
        parent.close()
        if process.is_alive():
            process.kill()
        process.join(timeout=5)
