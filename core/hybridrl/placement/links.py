"""The placement checked against the links between its devices (``hybridrl.placement.topology``).

Warned before the run starts, not refused (the run works, only slower): a tensor-parallel group (the rollout's
``tensor_parallel``, a train backend's ``options.tensor_parallel``) whose devices are not all joined by NVLink,
a pipeline-parallel group (``options.pipeline_parallel``) whose neighbouring stages are not, and a colocated
pool whose devices on one node are not (the trainer's collectives and the engine share them). Train roles'
ranks are taken in Megatron's order: tensor-parallel ranks consecutive, then data-parallel, then pipeline stages.
Links that are unknown are not warned about.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from hybridrl.placement.plan import Device, PlacementPlan
from hybridrl.placement.topology import FAST_LINKS, NET, SELF, UNKNOWN, Topology
from hybridrl.roles import role_spec

#: how many bad pairs a warning names
SHOWN_PAIRS = 3


def _size(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1


def parallel_sizes(cfg: Any, plan: PlacementPlan) -> dict[str, tuple[int, int]]:
    """role -> (tensor_parallel, pipeline_parallel) of every placed role (1 where unset)."""
    out = {}
    for role in plan.role_pool:
        rcfg = getattr(cfg.roles, role, None)
        if rcfg is None:
            continue
        options = getattr(rcfg, "options", None) or {}
        if role_spec(role).kind == "rollout":
            out[role] = (_size(getattr(rcfg, "tensor_parallel", 1)), 1)
        else:
            out[role] = (_size(options.get("tensor_parallel")), _size(options.get("pipeline_parallel")))
    return out


def tensor_groups(world: int, tp: int) -> list[list[int]]:
    return [list(range(start, min(start + tp, world))) for start in range(0, world, tp)] if tp > 1 else []


def pipeline_groups(world: int, tp: int, pp: int) -> list[list[int]]:
    """Megatron's pipeline groups: rank ``r``'s stages are ``r, r + tp*dp, r + 2*tp*dp ...``."""
    if pp <= 1 or world % (tp * pp):
        return []
    stride = world // pp
    return [[first + k * stride for k in range(pp)] for first in range(stride)]


def _bad_pairs(topology: Topology, devices: list[Device], pairs: list[tuple[int, int]]
               ) -> list[tuple[int, int, str]]:
    out = []
    for a, b in pairs:
        kind = topology.link(devices[a], devices[b])
        if kind not in FAST_LINKS and kind not in (UNKNOWN, SELF):
            out.append((a, b, kind))
    return out


def _ranks(ranks: list[int]) -> str:
    contiguous = ranks == list(range(ranks[0], ranks[0] + len(ranks)))
    return f"ranks {ranks[0]}-{ranks[-1]}" if contiguous and len(ranks) > 2 else f"ranks {', '.join(map(str, ranks))}"


def _pairs_text(devices: list[Device], bad: list[tuple[int, int, str]]) -> str:
    shown = [f"{devices[a]} and {devices[b]} ({kind}{' between nodes' if kind == NET else ''})"
             for a, b, kind in bad[:SHOWN_PAIRS]]
    more = f" and {len(bad) - SHOWN_PAIRS} more pair(s)" if len(bad) > SHOWN_PAIRS else ""
    return "; ".join(shown) + more


def _group_warning(what: str, why: str, devices: list[Device], groups: list[list[int]],
                   pairs_of: Any, topology: Topology) -> list[str]:
    """One warning for the groups of one kind of one role: the first bad group named, the others counted."""
    bad_groups = [(g, bad) for g in groups if (bad := _bad_pairs(topology, devices, pairs_of(g)))]
    if not bad_groups:
        return []
    group, bad = bad_groups[0]
    others = f" ({len(bad_groups)} of its {len(groups)} groups are like it)" if len(bad_groups) > 1 else ""
    return [f"{what} group {_ranks(group)} ({', '.join(str(devices[r]) for r in group)}) has no NVLink between "
            f"{_pairs_text(devices, bad)}{others}: {why}"]


def link_warnings(cfg: Any, plan: PlacementPlan, topology: Topology) -> list[str]:
    """Sentences naming each parallel group and colocated pool whose devices are not all joined by NVLink."""
    if not topology.known:
        return []
    out: list[str] = []
    for role, (tp, pp) in parallel_sizes(cfg, plan).items():
        devices = plan.group_of(role).devices
        pool = plan.role_pool[role]
        out += _group_warning(f"{role} (pool '{pool}') tensor-parallel (tensor_parallel={tp})",
                              "every layer's all-reduce crosses these links",
                              devices, tensor_groups(len(devices), tp),
                              lambda g: [(a, b) for i, a in enumerate(g) for b in g[i + 1:]], topology)
        out += _group_warning(f"{role} (pool '{pool}') pipeline-parallel (pipeline_parallel={pp})",
                              "each micro-batch's activations cross these links between stages",
                              devices, pipeline_groups(len(devices), tp, pp),
                              lambda g: list(zip(g, g[1:])), topology)
    for pool, devices in plan.pools.items():
        roles = [r for r, p in plan.role_pool.items() if p == pool]
        if len(roles) < 2 or len(devices) < 2:
            continue
        by_node: dict[int, list[int]] = {}
        for rank, d in enumerate(devices):
            by_node.setdefault(d.node, []).append(rank)
        pairs = [(a, b) for ranks in by_node.values() for i, a in enumerate(ranks) for b in ranks[i + 1:]]
        bad = _bad_pairs(topology, devices, pairs)
        if bad:
            out.append(f"colocated pool '{pool}' ({' + '.join(roles)}) has no NVLink between "
                       f"{_pairs_text(devices, bad)}: the trainer's collectives over the pool cross these links")
    return out


def render_links(plan: PlacementPlan, topology: Topology) -> str:
    """The links inside each pool, node by node (``links (NVML on gpu-01):`` then a line per pool and node)."""
    if not topology.known:
        return f"links: {topology.source or 'unknown'}"
    lines = [f"links ({topology.source}):" if topology.source else "links:"]
    for pool, devices in plan.pools.items():
        by_node: dict[int, list[Device]] = {}
        for d in devices:
            by_node.setdefault(d.node, []).append(d)
        for node, on_node in by_node.items():
            kinds = Counter(topology.link(a, b) for i, a in enumerate(on_node) for b in on_node[i + 1:])
            indices = [d.index for d in on_node]
            contiguous = len(indices) > 1 and indices == list(range(indices[0], indices[0] + len(indices)))
            label = f"node{node}:" + (f"{indices[0]}-{indices[-1]}" if contiguous else ",".join(map(str, indices)))
            if not kinds:
                text = "one device"
            elif len(kinds) == 1:
                text = f"{next(iter(kinds))} between all {sum(kinds.values())} pair(s)"
            else:
                text = ", ".join(f"{kind} {n} pair(s)" for kind, n in kinds.most_common())
            lines.append(f"  pool '{pool}' {label}: {text}")
        if len(by_node) > 1:
            lines.append(f"  pool '{pool}': {len(by_node)} nodes, over the network between them")
    return "\n".join(lines)


def rank_links(topology: Topology, devices: list[Device], rank: int) -> dict[str, str]:
    """The link from ``rank`` to each other rank of its group on the same node (``device_map.json``'s ``links``)."""
    me = devices[rank]
    return {str(r): topology.link(me, d) for r, d in enumerate(devices) if r != rank and d.node == me.node}
