"""What each node's host memory holds between phases, beside the device memory plan (``hybridrl.placement.memory``).

Offloading moves state off the device, not out of the machine: ``options.offload: optimizer`` keeps a trained
role's AdamW moments in host memory, ``all`` its weights too, and a colocated rollout asleep keeps its weights
there (vLLM and SGLang copy them to the host unless ``sleep_level: kv_cache``). Every process also holds its
libraries and buffers. On a 125 GiB host a 7B actor's moments alone are 57 GiB, so a plan that fits the device
can still have the kernel kill a worker; ``host_needs`` counts it per node and ``host_problems`` says when it
does not fit, before anything starts (the auto choices skip settings whose host memory does not fit).

The host memory is declared (``cluster.host_memory_gb``, ``hybridrl plan --host-memory``) or, for a run on this
one machine, read from ``/proc/meminfo``. Checkpoint loading is transient and not counted.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field

from hybridrl.config import RunConfig
from hybridrl.placement.memory import GIB, MemoryEstimate, RoleMemory
from hybridrl.placement.plan import PlacementPlan

#: resident host memory of one worker process (Python, torch and the CUDA libraries, communication buffers).
HOST_PROCESS_GIB = 3.0
#: share of a node's host memory the plan may fill (the rest: the OS, Ray's object store, page cache).
HOST_USABLE_SHARE = 0.9


@dataclass
class HostNeed:
    """Host bytes one node of a pool holds between phases, by what holds them."""

    pool: str
    devices_per_node: int
    parts: dict[str, float] = field(default_factory=dict)  # "actor optimizer" -> bytes per node
    host_bytes: float | None = None  # the node's host memory, when known

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    @property
    def fits(self) -> bool | None:
        return None if self.host_bytes is None else self.total <= HOST_USABLE_SHARE * self.host_bytes


def _role_parts(m: RoleMemory, colocated: bool, sleep_level: str) -> dict[str, float]:
    """Host bytes per device that one role keeps while it does not work (a rollout's weights asleep where its
    memory model says it copies them there: ``RoleMemory.host_copy_asleep``)."""
    if m.kind == "rollout":
        keeps_weights_on_host = colocated and m.host_copy_asleep and sleep_level != "kv_cache"
        return {"rollout weights asleep": m.weights} if keeps_weights_on_host else {}
    parts: dict[str, float] = {}
    if m.offload in ("optimizer", "all") and m.optimizer:
        parts[f"{m.role} optimizer"] = m.optimizer
    if m.offload == "all":
        parts[f"{m.role} weights"] = m.weights
    return parts


def host_needs(cfg: RunConfig, plan: PlacementPlan, est: MemoryEstimate, host_bytes: float | None) -> list[HostNeed]:
    """The host memory of one node of each pool (its busiest node: the most devices of the pool)."""
    needs: list[HostNeed] = []
    sleep_level = str((cfg.roles.rollout.options or {}).get("sleep_level", "")) if "rollout" in plan.role_pool else ""
    for pool in est.pools:
        devices = plan.pools.get(pool.pool, [])
        per_node = max(Counter(d.node for d in devices).values(), default=1)
        need = HostNeed(pool.pool, per_node, host_bytes=host_bytes)
        colocated = len(pool.roles) > 1
        for m in (r for r in est.roles if r.pool in (pool.pool, *pool.shared_by)):
            for name, value in _role_parts(m, colocated, sleep_level).items():
                need.parts[name] = need.parts.get(name, 0.0) + value * per_node
        # each of the pool's process groups runs one process on every device of the pool
        need.parts["worker processes"] = HOST_PROCESS_GIB * GIB * pool.processes * per_node
        needs.append(need)
    return needs


def host_problems(needs: list[HostNeed]) -> list[str]:
    """A warning for each pool whose node would run out of host memory, with the keys that lower it."""
    out = []
    for need in needs:
        if need.fits is False:
            largest = max(need.parts, key=need.parts.__getitem__)
            out.append(f"pool '{need.pool}' keeps ~{need.total / GIB:.1f} GiB in the host memory of a node "
                       f"({render_parts(need)}), more than {HOST_USABLE_SHARE:.0%} of its "
                       f"{need.host_bytes / GIB:.0f} GiB: the kernel would kill a worker. Largest: {largest}; "
                       "offload less (roles.<role>.options.offload), keep the rollout's weights on the device "
                       "(roles.rollout.options.sleep_level=kv_cache), or spread the pool over more nodes")
    return out


def render_parts(need: HostNeed) -> str:
    return ", ".join(f"{name} {value / GIB:.1f}" for name, value in need.parts.items() if value)


def render_host(needs: list[HostNeed]) -> list[str]:
    """One line per pool for the memory table."""
    lines = []
    for need in needs:
        limit = (f" of {need.host_bytes / GIB:.0f} GiB{'  ok' if need.fits else '  DOES NOT FIT'}"
                 if need.host_bytes is not None else " (host memory not declared: cluster.host_memory_gb)")
        lines.append(f"host memory per node, pool {need.pool} ({need.devices_per_node} device(s) a node): "
                     f"~{need.total / GIB:.1f} GiB [{render_parts(need)}]{limit}")
    return lines


def host_memory_bytes(declared_gib: float | None, local: bool) -> float | None:
    """The declared host memory per node, else this machine's when the run is on it alone, else None."""
    if declared_gib is not None:
        return declared_gib * GIB
    return local_host_memory_bytes() if local else None


def local_host_memory_bytes() -> float | None:
    """This machine's physical memory (``MemTotal``), None where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return float(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None
