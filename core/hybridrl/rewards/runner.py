"""Where rule rewards run: inline in the driver, or in a pool of processes with a timeout on every call.

Both runners take ``(prompt, response, fields)`` items and return one ``Outcome`` per item: a score, or a
failure (the function raised or returned no finite number: ``error``; it ran past ``timeout_s``: ``timeout``;
it ended its pool process: ``died``). Neither raises for one bad reward: counting failures and deciding when
they are fatal is the scorer's job, except a run of failures of one kind (``streak``,
``hybridrl.rewards.streak``), which stops the batch at once rather than pay a timeout per response.

Inline, a call past ``timeout_s`` is left running on its thread (a thread cannot be killed) and the batch goes on
on a fresh one; ``MAX_HUNG_THREADS`` such calls still running stop the run, so hung threads never pile up.

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
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from hybridrl.rewards.calling import RewardError, RewardFailure
from hybridrl.rewards.rules import Rules, RuleSpec
from hybridrl.rewards.streak import FailureStreak

log = logging.getLogger(__name__)

Item = tuple[str, str, dict[str, Any]]  # prompt, response, fields


@dataclass(frozen=True)
class Outcome:
    score: float = 0.0
    error: str | None = None
    timeout: bool = False
    died: bool = False

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def kind(self) -> str | None:
        """How it failed (``timeout``, ``died``, ``error``), None when it did not: failures of one kind in a row
        are counted by ``hybridrl.rewards.streak``."""
        if self.error is None:
            return None
        return "timeout" if self.timeout else "died" if self.died else "error"


#: inline calls past their deadline still running on their threads that stop the run.
MAX_HUNG_THREADS = 4


def who(spec: RuleSpec, item: Item) -> str:
    """The key and reward that score ``item``, for messages: ``roles.reward.fn 'name'``."""
    source = item[2].get("data_source") if isinstance(item[2], dict) else None
    return f"{spec.key_for(source)} '{spec.describe(source)}'"


def timed_out(timeout_s: float) -> Outcome:
    return Outcome(0.0, f"timed out after {timeout_s:g}s (roles.reward.timeout_s)", timeout=True)


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
    """Calls the rewards in the driver's process, one after another: no process hop. With ``timeout_s``, the
    calls run on a thread the driver waits on with a deadline per call (a call past it scores 0, timed out);
    without, on the driver's own thread."""

    mode = "inline"

    def __init__(self, spec: RuleSpec, timeout_s: float | None = None, streak: FailureStreak | None = None) -> None:
        self.spec = spec
        self.rules = Rules(spec)
        self.timeout_s = timeout_s
        self.streak = streak
        self.hung: list[threading.Thread] = []  # threads left with a call past its deadline
        warm_up(spec)

    def run(self, items: Sequence[Item]) -> list[Outcome]:
        if self.timeout_s is None:
            outcomes = []
            for item in items:
                outcomes.append(score_item(self.rules, item))
                if self.streak is not None:
                    self.streak.observe(outcomes[-1], who(self.spec, item))
            return outcomes
        return self._run_with_deadline(items, self.timeout_s)

    def _run_with_deadline(self, items: Sequence[Item], timeout_s: float) -> list[Outcome]:
        outcomes: list[Outcome | None] = [None] * len(items)
        position = 0
        while position < len(items):
            job = _InlineJob(self.rules, items, outcomes, position)
            try:
                position = self._wait(job, items, outcomes, position, timeout_s)
            finally:
                job.abandon()  # finished, past its deadline, or the run stops: it writes nothing more
        return [o if o is not None else Outcome(0.0, "not scored") for o in outcomes]

    def _wait(self, job: _InlineJob, items: Sequence[Item], outcomes: list[Outcome | None], observed: int,
              timeout_s: float) -> int:
        """Wait for ``job`` (started at ``observed``) until it finishes (returns the end) or a call passes its
        deadline (scored as timed out; returns the position after it)."""
        while True:
            with job.changed:
                if not job.finished:
                    job.changed.wait(timeout=max(0.0, job.started + timeout_s - time.monotonic()))
                finished, current, started = job.finished, job.current, job.started
            observed = self._observe(items, outcomes, observed, len(items) if finished else current)
            if finished:
                return len(items)
            if time.monotonic() >= started + timeout_s:  # the call under way is past its deadline
                job.abandon()
                self.hung = [t for t in self.hung if t.is_alive()] + [job.thread]
                outcomes[current] = timed_out(timeout_s)
                self._observe(items, outcomes, current, current + 1)
                if len(self.hung) >= MAX_HUNG_THREADS:
                    raise RewardError(f"{who(self.spec, items[current])}: {len(self.hung)} calls past "
                                      f"roles.reward.timeout_s={timeout_s:g}s are still running on the driver's "
                                      "threads, which cannot be stopped; use roles.reward.runner=process (a "
                                      "pool whose hung calls are killed)")
                return current + 1

    def _observe(self, items: Sequence[Item], outcomes: list[Outcome | None], start: int, end: int) -> int:
        """Feed the outcomes ``[start, end)`` to the streak, in order; returns ``end``."""
        if self.streak is not None:
            for i in range(start, end):
                outcome = outcomes[i]
                if outcome is not None:
                    self.streak.observe(outcome, who(self.spec, items[i]))
        return max(start, end)

    def close(self) -> None:
        pass


class _InlineJob:
    """Scores ``items[start:]`` on a daemon thread, recording which call runs since when; abandoned, it writes
    nothing more (the driver has scored the hung call and handed the rest to a fresh job)."""

    def __init__(self, rules: Rules, items: Sequence[Item], outcomes: list[Outcome | None], start: int) -> None:
        self.changed = threading.Condition()
        self.current, self.started = start, time.monotonic()
        self.finished = self.abandoned = False
        self.thread = threading.Thread(target=self._score, args=(rules, items, outcomes, start), daemon=True,
                                       name="hybridrl-reward-inline")
        self.thread.start()

    def _score(self, rules: Rules, items: Sequence[Item], outcomes: list[Outcome | None], start: int) -> None:
        for i in range(start, len(items)):
            outcome = score_item(rules, items[i])
            with self.changed:
                if self.abandoned:
                    return
                outcomes[i] = outcome
                if i + 1 < len(items):
                    self.current, self.started = i + 1, time.monotonic()
        with self.changed:
            self.finished = True
            self.changed.notify_all()

    def abandon(self) -> None:
        with self.changed:
            self.abandoned = True


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

    def __init__(self, spec: RuleSpec, workers: int, timeout_s: float, start_timeout_s: float = 120.0,
                 streak: FailureStreak | None = None) -> None:
        self.spec = spec
        self.streak = streak
        self.timeout_s = float(timeout_s)
        self.start_timeout_s = float(start_timeout_s)
        self._ctx = mp.get_context("spawn")
        self.workers = [_Worker(self._ctx, spec, self.start_timeout_s) for _ in range(max(1, workers))]
        self.restarts = 0

    # --- lifecycle -------------------------------------------------------------------------------
    def start(self) -> ProcessRunner:
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

        def observe(index: int) -> None:
            if self.streak is not None:
                self.streak.observe(outcomes[index], who(self.spec, items[index]))

        def fail_running(worker: _Worker, outcome: Outcome) -> None:
            """The call under way failed the whole worker: record it, hand the rest of the chunk on, replace it."""
            position = int(worker.running[0])
            index = worker.chunk[position]
            outcomes[index] = outcome
            pending.extendleft(reversed(worker.chunk[:position] + worker.chunk[position + 1:]))
            worker.chunk = []
            self._replace(worker)
            observe(index)

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
                                                      "response", died=True))
                    continue
                if message[0] == "init_error":
                    raise RewardPoolError(f"a reward pool process cannot load the rule rewards: {message[1]}")
                if message[0] == "ready":
                    worker.ready = True
                    continue
                chunk, worker.chunk = worker.chunk, []
                for index, (score, error) in zip(chunk, message[1]):
                    outcomes[index] = Outcome(score, error)
                    observe(index)
            now = time.monotonic()
            for worker in [w for w in self.workers if w.conn not in answered and w.deadline(self.timeout_s) <= now]:
                if worker.chunk:
                    fail_running(worker, timed_out(self.timeout_s))
                elif not worker.ready:
                    raise RewardPoolError(f"a reward pool process did not start within {self.start_timeout_s:g}s")
        return [o if o is not None else Outcome(0.0, "not scored") for o in outcomes]


def default_workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))
