"""A device's busy fraction measured on the device: NVML's kernel utilisation, sampled in the worker.

The span-based fraction (``hybridrl.observe.spans``) counts a device busy while the driver waits on a call to its
role, whatever its kernels do meanwhile. Where NVML is importable (``pynvml``, from the ``nvidia-ml-py`` package;
the core does not require it) and the worker's device is CUDA, ``BusySampler`` reads
``nvmlDeviceGetUtilizationRates(handle).gpu`` every ``INTERVAL_S`` in a background thread, and the driver asks
each worker, in one call a step, for the mean over the step's wall-clock window and over each of its phases'
(``RoleWorker.busy_report``). NVML's value is itself the percent of its own sample period (1/6 s to 1 s by
product) in which a kernel ran, so the mean of the samples over 100 is the share of the window with a kernel
running; counting samples above 0 would call a GPU that runs a kernel 10% of the time fully busy. Anywhere else
the span-based value stays.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

log = logging.getLogger(__name__)

#: seconds between two samples of a device's utilisation
INTERVAL_S = 0.05
#: samples kept when no report drops them (an hour at ``INTERVAL_S``): a bound on the sampler's memory
KEEP = 72_000
#: where a step's busy fractions came from (``SpanLog`` logs it when it changes)
NVML, SPANS = "nvml", "spans"

#: the device's utilisation now, in percent (0-100); raises when it cannot be read
Utilisation = Callable[[], float]
#: a wall-clock window (seconds since the epoch): from, to
Window = tuple[float, float]


class BusySampler:
    """Samples ``utilisation`` every ``interval`` seconds (``start``: in a daemon thread) and answers the mean of
    the samples taken in a window, as a fraction. A source that raises stops the sampling: the windows after it
    have no samples, and their fraction is None (the driver keeps the span-based value)."""

    def __init__(self, utilisation: Utilisation, interval: float = INTERVAL_S, clock: Callable[[], float] = time.time,
                 keep: int = KEEP) -> None:
        self.utilisation = utilisation
        self.interval = interval
        self.clock = clock
        self.samples: deque[tuple[float, float]] = deque(maxlen=keep)  # (seconds since the epoch, 0..1)
        self.failed: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> bool:
        """Take one sample now; False once the source has failed."""
        if self.failed is not None:
            return False
        try:
            share = min(1.0, max(0.0, float(self.utilisation()) / 100.0))
        except Exception as exc:  # noqa: BLE001 - any NVML error: no more samples, the spans answer
            self.failed = f"{type(exc).__name__}: {exc}"
            log.warning("device utilisation sampling stopped (%s): busy fractions come from the phase spans",
                        self.failed)
            return False
        with self._lock:
            self.samples.append((self.clock(), share))
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval) and self.sample():
            pass

    def start(self) -> None:
        """Sample in a daemon thread until ``stop`` (a second start is a no-op)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="device-busy", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.interval + 1.0)
            self._thread = None

    def fractions(self, windows: Sequence[Window]) -> list[float | None]:
        """The mean utilisation (0-1) of the samples taken in each window ``(lo, hi)`` (seconds since the epoch),
        None for a window without any. Samples before the earliest window are dropped: the windows asked for
        follow those asked before (a step's, then its phases')."""
        with self._lock:
            first = min((lo for lo, _ in windows), default=None)
            while first is not None and self.samples and self.samples[0][0] < first:
                self.samples.popleft()
            taken = list(self.samples)
        out: list[float | None] = []
        for lo, hi in windows:
            window = [share for t, share in taken if lo <= t <= hi]
            out.append(sum(window) / len(window) if window else None)
        return out


def nvml_target(cuda_index: int, visible: str | None) -> int | str:
    """The NVML handle's key of CUDA device ``cuda_index``: NVML numbers the physical devices, while
    ``CUDA_VISIBLE_DEVICES`` (Ray narrows it to a worker's GPUs) renumbers them for CUDA; its entry is an index
    or a UUID (``GPU-...``)."""
    entries = [e.strip() for e in (visible or "").split(",") if e.strip()]
    if not entries:
        return cuda_index
    entry = entries[cuda_index] if cuda_index < len(entries) else entries[0]
    return int(entry) if entry.isdigit() else entry


def nvml_utilisation(device: str) -> Utilisation | None:
    """This process's GPU's utilisation through NVML, or None: not a CUDA worker, no ``pynvml``, or a device NVML
    cannot read (a MIG slice reports no utilisation)."""
    if device != "cuda":
        return None
    try:
        import pynvml  # nvidia-ml-py: optional
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        target = nvml_target(_cuda_index(), os.environ.get("CUDA_VISIBLE_DEVICES"))
        handle = (pynvml.nvmlDeviceGetHandleByIndex(target) if isinstance(target, int)
                  else pynvml.nvmlDeviceGetHandleByUUID(target))
        pynvml.nvmlDeviceGetUtilizationRates(handle)  # one read now: a device that cannot answer is None here
    except Exception as exc:  # noqa: BLE001 - NVMLError and friends: the spans answer instead
        log.info("no NVML utilisation for this device (%s): busy fractions come from the phase spans", exc)
        return None
    return lambda: float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)


def _cuda_index() -> int:
    """The CUDA device this process uses, without initialising CUDA (``LOCAL_RANK`` until torch has)."""
    import torch

    if torch.cuda.is_initialized():
        return int(torch.cuda.current_device())
    return int(os.environ.get("LOCAL_RANK", "0") or 0)


def device_sampler(device: str) -> BusySampler | None:
    """A started sampler of this worker's device, or None where NVML does not apply (``nvml_utilisation``)."""
    utilisation = nvml_utilisation(device)
    if utilisation is None:
        return None
    sampler = BusySampler(utilisation)
    sampler.start()
    return sampler


def sampled_busy(groups: Mapping[str, Any], windows: Sequence[Window],
                 guests: Mapping[str, tuple[str, tuple[int, ...]]] | None = None
                 ) -> dict[tuple[str, int], list[float | None]]:
    """``(pool, rank) -> NVML busy fraction of each window`` for the devices whose worker sampled them, in one call
    per worker group (NVML reads the whole device: where several processes share one, the largest answer of each
    window); a group that cannot answer is left out (a metric never stops training). A pool in ``guests`` (on
    another pool's devices: ``SpanLog.guests``) reports under the host's ranks."""
    out: dict[tuple[str, int], list[float | None]] = {}
    for group in {id(g): g for g in groups.values()}.values():
        try:
            answers = group.call_all("busy_report", list(windows))
        except Exception:  # noqa: BLE001 - a metric must never stop training
            continue
        for rank, values in enumerate(answers):
            if values is None:
                continue
            pool = group.plan.pool
            host, ranks = (guests or {}).get(pool, (pool, ()))
            key = (host, ranks[rank] if rank < len(ranks) else rank)
            have = out.setdefault(key, [None] * len(windows))
            for i, value in enumerate(values):
                if value is not None:
                    have[i] = max(have[i] or 0.0, float(value))
    return out


def merge_busy(spans: Mapping[tuple[str, int], float], sampled: Mapping[tuple[str, int], float]
               ) -> tuple[dict[tuple[str, int], float], int]:
    """Each device's NVML fraction where it was sampled, else its span-based one; and how many were sampled."""
    merged = {key: sampled.get(key, value) for key, value in spans.items()}
    return merged, sum(1 for key in spans if key in sampled)


def source_line(sampled: int, total: int) -> str:
    """The log line that says where the busy fractions come from."""
    if sampled == 0:
        return f"device busy fractions: from the phase spans on all {total} device(s) (no NVML sampling)"
    return f"device busy fractions: NVML-sampled on {sampled} of {total} device(s), the rest from the phase spans"
