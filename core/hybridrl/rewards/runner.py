"""Where rule rewards run: inline in the driver, or in a pool of processes with a timeout on every call.

Both runners take ``(prompt, response, fields)`` items and return one ``Outcome`` per item: a score, or a
failure (the function raised or returned no finite number: ``error``; it ran past ``timeout_s``: ``timeout``).
Neither ever raises for a bad reward: counting failures and deciding when they are fatal is the scorer's job.

The pool (``ProcessRunner``) keeps ``workers`` spawned processes, each rebuilding the ``RuleSpec``'s functions
once. A batch is cut into chunks handed to idle workers; a worker answers item by item, so the driver knows
which call is running and since when. A call past its deadline gets its worker killed (nothing else can stop a
hung C extension or a regex that backtracks forever) and replaced, and the rest of its chunk is handed on.
Spawned, not forked: the driver holds Ray's threads, which a fork would copy in whatever state they are.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Sequence

from hybridrl.rewards.calling import RewardError, RewardFailure
from hybridrl.rewards.rules import Rules, RuleSpec

log = logging.getLogger(__name__)

Item = tuple[str, str, dict[str, Any]]  # prompt, response, fields


@dataclass(frozen=True)
class Outcome:
    score: float = 0.0
    error: str | None = None
    timeout: bool = False

    @property
    def failed(self) -> bool:
        return self.error is not None


def score_item(rules: Rules, item: Item) -> Outcome:
    try:
        return Outcome(rules.score(*item))
    except RewardFailure as exc:
        return Outcome(0.0, str(exc))
    except SystemExit as exc:  # a reward calling sys.exit(): a failure like any other (Ctrl-C is not caught)
        return Outcome(0.0, f"raised SystemExit: {exc}")


def warm_up(spec: RuleSpec) -> None:
    """Call each function's ``warmup()`` if it has one (``math`` imports sympy there), so that the first
    scored response does not pay for it against its timeout."""
    from hybridrl.plugins.registry import load_object

    for term in spec.all_terms():
        warm = getattr(load_object(term.target), "warmup", None)
        if callable(warm):
            warm()


class InlineRunner:
    """Calls the rewards in the driver, one after another: no process hop, but no timeout either."""

    mode = "inline"

    def __init__(self, spec: RuleSpec, timeout_s: float | None = None) -> None:
        self.rules = Rules(spec)
        self.timeout_s = timeout_s
        warm_up(spec)

    def run(self, items: Sequence[Item]) -> list[Outcome]:
        return [score_item(self.rules, item) for item in items]

    def close(self) -> None:
        pass


# --- the pool ------------------------------------------------------------------------------------

def _worker_main(conn: Connection, spec: RuleSpec, running: Any) -> None:
    """A pool process: build the rules, then score chunks until told to stop. ``running`` (shared memory)
    holds the position in the chunk of the call under way and when it started, for the driver's deadline;
    the outcomes of a chunk go back in one message."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle (it finishes the step)
    try:
        rules = Rules(spec)
        warm_up(spec)
    except BaseException as exc:  # noqa: BLE001 - reported to the driver, which raises it
        conn.send(("init_error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return
        if chunk is None:
            return
        results = []
        for position, item in enumerate(chunk):
            running[0], running[1] = position, time.monotonic()
            outcome = score_item(rules, item)
            results.append((outcome.score, outcome.error))
        conn.send(("done", results))


class RewardPoolError(RewardError):
    """The pool itself cannot work (a worker cannot rebuild the rewards, or does not start)."""


class _Worker:
    """One pool process and what the driver knows of it: ready or starting, the item indices of the chunk
    handed to it, and (shared with it) which of them is running since when."""

    def __init__(self, ctx: Any, spec: RuleSpec, start_timeout_s: float) -> None:
        parent, child = ctx.Pipe()
        self.conn: Connection = parent
        self.running = ctx.Array("d", 2, lock=False)  # position in the chunk, start (time.monotonic)
        self.process = ctx.Process(target=_worker_main, args=(child, spec, self.running), daemon=True,
                                   name="hybridrl-reward")
        self.process.start()
        child.close()
        self.ready = False
        self.chunk: list[int] = []
        self.start_deadline = time.monotonic() + start_timeout_s

    def deadline(self, timeout_s: float) -> float:
        """When the call under way runs out of time (while starting: when it must be ready)."""
        return self.running[1] + timeout_s if self.chunk else self.start_deadline

    def exit_code(self) -> int | None:
        self.process.join(timeout=1)
        return self.process.exitcode

    def kill(self) -> None:
        try:
            self.process.kill()
            self.process.join(timeout=5)
        except Exception:  # noqa: BLE001 - already gone
            pass
        self.conn.close()


class ProcessRunner:
    """A pool of ``workers`` processes scoring with a ``timeout_s`` per call (see the module docstring)."""

    mode = "process"

    def __init__(self, spec: RuleSpec, workers: int, timeout_s: float, start_timeout_s: float = 120.0) -> None:
        self.spec = spec
        self.timeout_s = float(timeout_s)
        self.start_timeout_s = float(start_timeout_s)
        self._ctx = mp.get_context("spawn")
        self.workers = [_Worker(self._ctx, spec, self.start_timeout_s) for _ in range(max(1, workers))]
        self.restarts = 0

    # --- lifecycle -------------------------------------------------------------------------------
    def start(self) -> "ProcessRunner":
        """Wait until every worker has loaded the rewards (else the first batch pays for it)."""
        self.run([])
        return self

    def close(self) -> None:
        for worker in self.workers:
            try:
                worker.conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        for worker in self.workers:
            worker.process.join(timeout=2)
            if worker.process.is_alive():
                worker.kill()
            else:
                worker.conn.close()
        self.workers = []

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self.restarts += 1
        self.workers[self.workers.index(worker)] = _Worker(self._ctx, self.spec, self.start_timeout_s)

    # --- scoring ---------------------------------------------------------------------------------
    def run(self, items: Sequence[Item]) -> list[Outcome]:
        """One outcome per item. An empty ``items`` just waits for every worker to be ready."""
        if not self.workers:
            raise RewardPoolError("the reward pool is closed")
        outcomes: list[Outcome | None] = [None] * len(items)
        chunk_size = max(1, -(-len(items) // (4 * len(self.workers))))
        pending = deque(range(len(items)))

        def fail_running(worker: _Worker, outcome: Outcome) -> None:
            """The call under way failed the whole worker: record it, hand the rest of the chunk on, replace it."""
            position = int(worker.running[0])
            outcomes[worker.chunk[position]] = outcome
            pending.extendleft(reversed(worker.chunk[:position] + worker.chunk[position + 1:]))
            worker.chunk = []
            self._replace(worker)

        while True:
            for worker in list(self.workers):  # hand chunks to idle workers
                if pending and worker.ready and not worker.chunk:
                    worker.chunk = [pending.popleft() for _ in range(min(chunk_size, len(pending)))]
                    worker.running[0], worker.running[1] = 0, time.monotonic()
                    try:
                        worker.conn.send([items[i] for i in worker.chunk])
                    except (OSError, BrokenPipeError):
                        pending.extendleft(reversed(worker.chunk))
                        worker.chunk = []
                        self._replace(worker)
            watched = [w for w in self.workers if w.chunk or not w.ready]
            if not watched:
                break
            timeout = max(0.0, min(w.deadline(self.timeout_s) for w in watched) - time.monotonic())
            answered = set(wait([w.conn for w in watched], timeout=timeout))
            for worker in watched:
                if worker.conn not in answered:
                    continue
                try:
                    message = worker.conn.recv()
                except (EOFError, OSError):  # died: os._exit, a segfault, the OOM killer
                    code = worker.exit_code()
                    if not worker.chunk:
                        raise RewardPoolError(f"a reward pool process died at start (exit code {code})") from None
                    fail_running(worker, Outcome(0.0, f"the reward process died (exit code {code}) scoring this "
                                                      "response"))
                    continue
                if message[0] == "init_error":
                    raise RewardPoolError(f"a reward pool process cannot load the rule rewards: {message[1]}")
                if message[0] == "ready":
                    worker.ready = True
                    continue
                for index, (score, error) in zip(worker.chunk, message[1]):
                    outcomes[index] = Outcome(score, error)
                worker.chunk = []
            now = time.monotonic()
            for worker in [w for w in self.workers if w.conn not in answered and w.deadline(self.timeout_s) <= now]:
                if worker.chunk:
                    fail_running(worker, Outcome(0.0, f"timed out after {self.timeout_s:g}s (roles.reward.timeout_s)",
                                                 timeout=True))
                elif not worker.ready:
                    raise RewardPoolError(f"a reward pool process did not start within {self.start_timeout_s:g}s")
        return [o if o is not None else Outcome(0.0, "not scored") for o in outcomes]


def default_workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))
