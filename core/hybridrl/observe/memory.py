"""Memory measured while a run trains, per role, to set against the plan's estimate (``placement.memory``)."""

from __future__ import annotations

from typing import Any


def peak_memory_metrics(groups: dict[str, Any]) -> dict[str, float]:
    """``memory/<role>/peak_mb``: the largest peak over the ranks of the processes hosting each role, to set
    against the estimate, and ``perf/peak_mem_mb``, the largest of them. Roles fused into one process share its
    memory and report the same number. CUDA: torch's peak allocated bytes; CPU: the process's peak resident set."""
    out: dict[str, float] = {}
    seen: dict[int, float] = {}
    for role, group in groups.items():
        if id(group) not in seen:
            try:
                seen[id(group)] = float(max(group.call_all("peak_memory_mb")))
            except Exception:  # noqa: BLE001 - a metric must never stop training
                continue
        out[f"memory/{role}/peak_mb"] = seen[id(group)]
    if seen:
        out["perf/peak_mem_mb"] = max(seen.values())
    return out
