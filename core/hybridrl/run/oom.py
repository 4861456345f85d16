"""Out of memory is an answer: where it happened, what the plan expected there, what the device held, and the
keys that would make it fit, cheapest first, in one message instead of a worker's traceback.

A worker turns an out-of-memory error of any engine call (a trainer phase, the rollout's start, wake or
generation) into ``hybridrl.observe.memory.DeviceOutOfMemory``; the rollout refuses to start a KV cache below
the step's floor with ``hybridrl.rollout.kv_budget.KVCacheTooSmall``. ``memory_stop`` finds either inside the
error the driver got (Ray wraps it) and builds ``OutOfMemoryStop``; the run then ends like on any other fault:
the last complete checkpoint is left as it was and every worker is shut down.
"""

from __future__ import annotations

from typing import Any

from hybridrl.errors import HybridRLError
from hybridrl.observe.memory import DeviceOutOfMemory, is_out_of_memory

GIB_MB = 1024.0


class OutOfMemoryStop(HybridRLError, RuntimeError):
    """The run stopped because a device ran out of memory; the message says where and what fixes it."""


def _chain(exc: BaseException | None):
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = getattr(exc, "cause", None) or exc.__cause__ or exc.__context__


def find_memory_error(exc: BaseException) -> BaseException | None:
    """The ``DeviceOutOfMemory`` / ``KVCacheTooSmall`` (or another out-of-memory error) inside ``exc``."""
    found = None
    for item in _chain(exc):
        if isinstance(item, DeviceOutOfMemory) or type(item).__name__ == "KVCacheTooSmall":
            return item
        if found is None and is_out_of_memory(item) and not _is_wrapper(item):
            found = item
    return found


def _is_wrapper(exc: BaseException) -> bool:
    return type(exc).__name__ in ("RayTaskError", "RayActorError") or type(exc).__name__.startswith("RayTaskError")


def memory_stop(exc: BaseException, plan: Any = None, step: int | None = None,
                checkpoint_note: str = "") -> OutOfMemoryStop | None:
    """``OutOfMemoryStop`` with the whole answer when ``exc`` is an out-of-memory error, else None. ``plan`` is
    the run's ``PlacementPlan`` (its ``memory`` holds the estimate the pre-flight made), ``step`` the step under
    way (None: while the engines start)."""
    if not is_out_of_memory(exc):
        return None
    error = find_memory_error(exc)
    if error is None:
        return None
    return OutOfMemoryStop(describe(error, plan, step, checkpoint_note))


def describe(error: BaseException, plan: Any = None, step: int | None = None, checkpoint_note: str = "") -> str:
    report = dict(getattr(error, "report", {}) or {})
    role, phase = report.get("role"), report.get("phase")
    if type(error).__name__ == "KVCacheTooSmall":
        role, phase = role or "rollout", phase or "build"
    if phase == "build" or step is None:
        when = "while the engines were built"
    else:
        when = f"in phase {phase} of step {step}"
    lines = [f"out of memory {when}: {_where(plan, role, report)}"]
    lines.append(f"  planned: {_planned(plan, role, phase)}; measured: {_measured(report)}")
    reason = report.get("reason") or (str(error).splitlines() or [type(error).__name__])[0]
    lines.append(f"  error: {reason[:600]}")
    fixes = fixes_for(plan, role, phase)
    if fixes:
        lines.append("  keys that would fix it, cheapest first: " + "; ".join(fixes))
    if checkpoint_note:
        lines.append(f"  {checkpoint_note}")
    return "\n".join(lines)


def _where(plan: Any, role: str | None, report: dict[str, Any]) -> str:
    rank = report.get("rank", 0)
    device = report.get("device", "?")
    if plan is None or role is None or role not in plan.role_pool:
        return f"role {role or '?'}, rank {rank}, {device}"
    group = plan.group_of(role)
    name = group.devices[rank] if isinstance(rank, int) and rank < len(group.devices) else "?"
    return f"role {role} (pool '{group.pool}'), rank {rank} of {group.world_size}, {device} device {name}"


def _pool_estimate(plan: Any, role: str | None):
    est = getattr(plan, "memory", None)
    if est is None or role is None or role not in plan.role_pool:
        return None, None
    return est, next((p for p in est.pools if p.pool == plan.role_pool[role]), None)


def _planned(plan: Any, role: str | None, phase: str | None) -> str:
    est, pool = _pool_estimate(plan, role)
    if pool is None:
        return "no estimate"
    key = "gen" if phase in ("wake", "build", "reshard", "sleep") or phase not in pool.phases else phase
    key = key if key in pool.phases else pool.peak_phase
    value = pool.phases[key]
    device = f" of the {est.device_bytes / 2**30:.1f} GiB device" if est.device_bytes else ""
    amount = f"{value / 2**30:.1f} GiB" if value >= 2**30 else f"{value / 2**20:.0f} MiB"
    return f"{amount} in {key}{device}"


def _measured(report: dict[str, Any]) -> str:
    if "used_mb" not in report:
        return "not measured (no CUDA device in that process)"
    parts = [f"{report['used_mb'] / GIB_MB:.1f} GiB in use of {report['total_mb'] / GIB_MB:.1f} GiB"]
    if "allocated_mb" in report:
        parts.append(f"torch {report['allocated_mb'] / GIB_MB:.1f} GiB allocated, {report['reserved_mb'] / GIB_MB:.1f} "
                     f"GiB reserved (peak {report.get('peak_reserved_mb', 0.0) / GIB_MB:.1f})")
    return ", ".join(parts)


#: phases in which the rollout works (or is being woken, built, synced or put to sleep).
ROLLOUT_PHASES = ("wake", "gen", "build", "reshard", "sleep")


def fixes_for(plan: Any, role: str | None, phase: str | None) -> list[str]:
    """Config keys that lower the memory of ``phase``, cheapest first, from the settings the estimate was made
    with: the failing role's backend's own keys (``BackendSpec.oom_fixes``), what the roles beside it can give up
    (their state offloaded), then more devices. The core names no backend's option."""
    est = getattr(plan, "memory", None)
    roles = {m.role: m for m in est.roles} if est is not None else {}
    hooks = dict(getattr(est, "oom_fixes", {}) or {})
    fixes: list[str] = []
    from hybridrl.rollout.memory import TENSOR_PARALLEL_FIX

    if role == "rollout" or phase in ROLLOUT_PHASES:
        own = _own(hooks, roles, "rollout", phase or "gen")
        more_devices = [f for f in own if f == TENSOR_PARALLEL_FIX]  # dearer than offloading the trainers
        fixes += [f for f in own if f not in more_devices]
        fixes += _relief(plan, hooks, roles, exclude="rollout")
        fixes += more_devices
        fixes.append("data.prompts_per_step lower (fewer sequences in flight)")
        return fixes
    if role is None:
        return fixes
    fixes += _own(hooks, roles, role, phase or "") or [f"roles.{role}.micro_batch lower"]
    fixes += [f for f in _relief(plan, hooks, roles) if f not in fixes]
    pool = plan.role_pool.get(role) if plan is not None else None
    if pool is not None:
        fixes.append(f"pools.{pool}.devices_per_node={2 * len(plan.pools[pool])} (shards over more devices)")
    return fixes


def _own(hooks: dict[str, Any], roles: dict[str, Any], role: str, phase: str) -> list[str]:
    hook = hooks.get(role)
    return list(hook(role, roles.get(role), phase)) if hook is not None else []


def _relief(plan: Any, hooks: dict[str, Any], roles: dict[str, Any], exclude: str | None = None) -> list[str]:
    """What the train roles can give up for another's phase, frozen roles first (no optimizer to keep)."""
    from hybridrl.roles import role_spec

    placed = [r for r in getattr(plan, "role_pool", {}) if r != exclude and role_spec(r).kind == "train"]
    out: list[str] = []
    for role in sorted(placed, key=lambda r: role_spec(r).trainable):
        hook = hooks.get(role)
        if hook is not None:
            out += hook(role, roles.get(role), None)
    return out
