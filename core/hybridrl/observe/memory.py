"""Memory measured while a run trains, per role and per phase, to set against the plan's estimate
(``placement.memory``), and out-of-memory errors turned into a report of where they happened.

``DeviceMemoryMeter`` watches every engine call of one worker. On a GPU it records the device's memory in
use (``cudaMemGetInfo``: every allocator, the CUDA contexts, a rollout's mapped weights and KV cache, the other
processes on the device) at the end of the call, plus what the caching allocator reserved above that during
the call (``max_memory_reserved``, reset at the call's start and after each release of torch's cache inside
it, ``release_cache_metered``): the device peak of the phase. torch's own
``max_memory_allocated`` is not that figure (it misses everything outside torch's allocator and still counts
a sleeping engine's unmapped memory). An out-of-memory error inside a call becomes ``DeviceOutOfMemory``, which
carries the role, the phase, the device and what was in use, so the driver can answer with one message
(``hybridrl.run.oom``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from hybridrl.errors import HybridRLError

MIB = float(2**20)
#: the engine method each phase of a role's ``roles.RoleSpec.phases`` runs, by mode.
METHOD_MODES = {"compute_log_probs": "forward", "compute_values": "forward", "compute_scores": "forward",
                "update": "train", "generate": "generate"}
#: what error messages of CUDA, torch, vLLM's cumem allocator and SGLang's memory saver say on out of memory.
OOM_MARKERS = ("out of memory", "cuda_error_out_of_memory", "outofmemoryerror", "cudaerrormemoryallocation")


def phase_of(role: str, method: str) -> str:
    """The step phase (``timing/<phase>``) an engine call belongs to: ``update`` of the actor is
    ``update_actor``, ``compute_log_probs`` of the reference ``ref`` ...; other calls keep their names."""
    from hybridrl.roles import role_spec

    if method in ("wake", "sleep", "build", "reshard"):
        return method
    mode = METHOD_MODES.get(method)
    for phase in role_spec(role).phases:
        if phase.mode == mode:
            return phase.name
    return f"{role}.{method}"


def is_out_of_memory(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what caused it, through Ray's wrapping) is a device out-of-memory error."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, DeviceOutOfMemory) or type(exc).__name__ in ("OutOfMemoryError", "KVCacheTooSmall"):
            return True
        text = str(exc).lower()
        if isinstance(exc, (RuntimeError, MemoryError, ValueError)) and any(m in text for m in OOM_MARKERS):
            return True
        exc = getattr(exc, "cause", None) or exc.__cause__ or exc.__context__
    return False


class DeviceOutOfMemory(HybridRLError, RuntimeError):
    """An engine call ran out of device memory; ``report`` says which role, phase, rank, device, and what the
    device held (MiB), and ``reason`` the original error's first line."""

    def __init__(self, report: dict[str, Any]) -> None:
        self.report = dict(report)
        super().__init__(f"out of memory: role {report.get('role')} in {report.get('phase')} on "
                         f"{report.get('device')} rank {report.get('rank')}: {report.get('reason')}")

    def __reduce__(self):  # Ray pickles exceptions raised in workers
        return (type(self), (self.report,))


def device_memory() -> dict[str, float]:
    """This process's view of its GPU in MiB: in use (all processes), total, and torch's allocator."""
    import torch

    free, total = torch.cuda.mem_get_info()
    return {"used_mb": (total - free) / MIB, "total_mb": total / MIB,
            "allocated_mb": torch.cuda.memory_allocated() / MIB, "reserved_mb": torch.cuda.memory_reserved() / MIB}


#: the phase's device peak up to each release of torch's cache during the current engine call
#: (``release_cached_device_memory``): torch's peak counters restart after a release, so the cache given back
#: is not counted again on top of what is mapped after it (a rollout's weights waking in ``reshard``).
_peaks_before_release: list[float] = []
#: torch's peak allocated bytes over the process's life: the meter restarts torch's counters at every phase, so
#: the process's peak (``memory/<role>/peak_mb``, ``allocated_peak_mb``) is carried across the restarts here
_allocated_peak_bytes = 0


def _restart_peak_counters() -> None:
    """``torch.cuda.reset_peak_memory_stats()``, the process's allocated peak kept (``allocated_peak_mb``)."""
    global _allocated_peak_bytes
    import torch

    _allocated_peak_bytes = max(_allocated_peak_bytes, torch.cuda.max_memory_allocated())
    torch.cuda.reset_peak_memory_stats()


def allocated_peak_mb() -> float:
    """The most torch's allocator held at once in this process, across the meter's restarts of its counters."""
    import torch

    return max(_allocated_peak_bytes, torch.cuda.max_memory_allocated()) / MIB


def _device_peak_mb() -> float:
    """The device peak since torch's counters last restarted: in use now outside torch's cache, plus the most
    torch's cache held meanwhile."""
    import torch

    now = device_memory()
    return now["used_mb"] - now["reserved_mb"] + torch.cuda.max_memory_reserved() / MIB


def release_cache_metered() -> None:
    """``torch.cuda.empty_cache()`` with the meter's peak kept true across it (see ``_peaks_before_release``)."""
    import torch

    _peaks_before_release.append(_device_peak_mb())
    torch.cuda.empty_cache()
    _restart_peak_counters()


class DeviceMemoryMeter:
    """The device peak of each phase this worker ran since the last ``report`` (see the module docstring)."""

    def __init__(self, device: str, rank: int = 0) -> None:
        self.device = device
        self.rank = rank
        self.peaks: dict[str, float] = {}
        self.last: dict[str, float] = {}

    @property
    def cuda(self) -> bool:
        if self.device != "cuda":
            return False
        import torch

        return torch.cuda.is_available() and torch.cuda.is_initialized()

    @contextmanager
    def watch(self, role: str, method: str) -> Iterator[None]:
        phase = phase_of(role, method)
        cuda = self.cuda
        before = 0.0
        if cuda:
            _restart_peak_counters()
            _peaks_before_release.clear()
            before = device_memory()["used_mb"]
        try:
            yield
        except Exception as exc:
            if is_out_of_memory(exc) and not isinstance(exc, DeviceOutOfMemory):
                raise DeviceOutOfMemory(self.oom_report(role, phase, exc)) from exc
            raise
        if self.device == "cuda" and (cuda or self.cuda):
            peak = max(before, _device_peak_mb(), *_peaks_before_release)
            _peaks_before_release.clear()
            self.peaks[phase] = max(self.peaks.get(phase, 0.0), peak)
            self.last = device_memory()

    def oom_report(self, role: str, phase: str, exc: BaseException) -> dict[str, Any]:
        report: dict[str, Any] = {"role": role, "phase": phase, "rank": self.rank, "device": self.device,
                                  "reason": _first_line(exc), "time": time.time()}
        if self.cuda:
            try:
                import torch

                report.update(device_memory())
                report["peak_reserved_mb"] = torch.cuda.max_memory_reserved() / MIB
                report["cuda_device"] = torch.cuda.current_device()
            except Exception:  # noqa: BLE001 - the report must not hide the error it reports
                pass
        return report

    def report(self, reset: bool = True) -> dict[str, float]:
        """``{phase: device peak MiB}`` since the last report."""
        out = dict(self.peaks)
        if reset:
            self.peaks = {}
        return out


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    cause = getattr(exc, "cause", None)
    if not text and cause is not None:
        text = str(cause).strip()
    return (text.splitlines() or [type(exc).__name__])[0][:400]


def peak_memory_metrics(groups: dict[str, Any]) -> dict[str, float]:
    """``memory/<role>/peak_mb``: the largest peak over the ranks of the processes hosting each role, to set
    against the estimate, and ``perf/peak_mem_mb``, the largest of them. Roles fused into one process share its
    memory and report the same number. CUDA: torch's peak allocated bytes; CPU: the process's peak resident set.
    And, on GPUs, the device peak of every phase since the last step, the largest over the ranks:
    ``memory/phase/<phase>/device_peak_mb`` and ``memory/device_peak_mb``."""
    out: dict[str, float] = {}
    seen: dict[int, float] = {}
    phases: dict[str, float] = {}
    for role, group in groups.items():
        if id(group) not in seen:
            try:
                seen[id(group)] = float(max(group.call_all("peak_memory_mb")))
                for report in group.call_all("memory_report"):
                    for phase, mb in (report or {}).items():
                        phases[phase] = max(phases.get(phase, 0.0), float(mb))
            except Exception:  # noqa: BLE001 - a metric must never stop training
                continue
        out[f"memory/{role}/peak_mb"] = seen[id(group)]
    if seen:
        out["perf/peak_mem_mb"] = max(seen.values())
    for phase, mb in phases.items():
        out[f"memory/phase/{phase}/device_peak_mb"] = mb
    if phases:
        out["memory/device_peak_mb"] = max(phases.values())
    return out
