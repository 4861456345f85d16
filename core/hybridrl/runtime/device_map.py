"""The device map: where Ray placed each rank of each worker group (node id, node address, the device it got).

The plan's devices are logical (``node1:0``); the placement groups decide the machines (``PoolPlacement``).
Each worker reports its location once it runs; the driver logs the map, writes it to
``<trainer.out>/device_map.json`` and keeps it on the groups, so that a lost node is named by its address and
id with the roles and ranks that ran there (``lost_node_ranks``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridrl.runtime.group import WorkerGroup

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerLocation:
    """Where one worker process runs: its node (Ray's id and the node's address), the accelerator ids Ray gave
    it (GPU indices on that node; empty on CPU), its process id, the torch threads it computes with and its
    node's CPU cores (CPU slots of a node share them: the device-map advisor's data-parallel scaling)."""

    node_id: str
    node_ip: str
    gpu_ids: tuple[str, ...]
    pid: int
    threads: int = 0  # torch intra-op threads (0: not recorded)
    cores: int = 0  # the node's CPU count (0: not recorded)

    def device(self) -> str:
        return f"GPU {','.join(self.gpu_ids)}" if self.gpu_ids else "CPU"

    def describe(self) -> str:
        return f"{self.node_ip} [node {self.node_id[:8]}] {self.device()}"


def this_worker_location() -> WorkerLocation:
    """The calling Ray worker's location (call inside a worker: outside one, Ray would start a cluster)."""
    import os

    import ray
    import torch

    context = ray.get_runtime_context()
    gpus = tuple(str(g) for g in context.get_accelerator_ids().get("GPU", []))
    return WorkerLocation(context.get_node_id(), ray.util.get_node_ip_address(), gpus, os.getpid(),
                          torch.get_num_threads(), os.cpu_count() or 0)


def map_rows(groups: Iterable[WorkerGroup], topology: Any = None) -> list[dict[str, Any]]:
    """One row per rank of every group: the plan's device and where the rank runs; with a known topology
    (``hybridrl.placement.topology``), ``links``: the link to each other rank of the group on its node."""
    from hybridrl.placement.links import rank_links

    rows = []
    for group in groups:
        for rank, location in enumerate(group.locations):
            row = {"group": group.plan.name, "pool": group.plan.pool, "roles": list(group.plan.roles),
                   "rank": rank, "planned": str(group.plan.devices[rank]), **asdict(location)}
            if topology is not None and topology.known:
                row["links"] = rank_links(topology, group.plan.devices, rank)
            rows.append(row)
    return rows


def render_device_map(groups: Iterable[WorkerGroup]) -> str:
    """The map as lines, consecutive ranks of a group on one node joined (``ranks 0-7``)."""
    lines = ["device map (where Ray placed each rank):"]
    for group in groups:
        runs: list[tuple[int, int, WorkerLocation]] = []
        for rank, loc in enumerate(group.locations):
            if runs and runs[-1][2].node_id == loc.node_id and runs[-1][1] == rank - 1:
                runs[-1] = (runs[-1][0], rank, runs[-1][2])
            else:
                runs.append((rank, rank, loc))
        for first, last, loc in runs:
            ranks = f"rank {first}" if first == last else f"ranks {first}-{last}"
            gpus = (",".join(g for r in range(first, last + 1) for g in group.locations[r].gpu_ids))
            where = f"{loc.node_ip} [node {loc.node_id[:8]}] " + (f"GPU {gpus}" if gpus else "CPU")
            lines.append(f"  {group.plan.name} {ranks}/{group.plan.world_size} -> {where}")
    return "\n".join(lines)


#: the file in ``trainer.out`` (written anew at each start: a run folder holding it alone has nothing to lose)
DEVICE_MAP_FILE = "device_map.json"


def write_device_map(out: str | Path, groups: Iterable[WorkerGroup], topology: Any = None) -> Path:
    path = Path(out) / DEVICE_MAP_FILE
    path.write_text(json.dumps(map_rows(groups, topology), indent=2))
    return path


def lost_node_ranks(groups: Iterable[WorkerGroup], node_ids: set[str]) -> list[tuple[WorkerGroup, int]]:
    """``(group, rank)`` of every rank that ran on one of ``node_ids``."""
    return [(g, r) for g in groups for r, loc in enumerate(g.locations) if loc.node_id in node_ids]


# --- a node lost ----------------------------------------------------------------------------------------

#: how long to wait for Ray to declare a node dead once a collective failed (Ray's GCS declares a node dead
#: after ``health_check_failure_threshold`` missed checks, 5 x 3 s by default).
NODE_DEATH_WAIT_S = 30.0


def dead_nodes(groups: Iterable[WorkerGroup], wait_s: float = 0.0) -> set[str]:
    """The ids of the nodes that ran a rank of ``groups`` and that Ray no longer counts alive; waits up to
    ``wait_s`` for one to be declared dead (a raylet that vanished is noticed only by missed health checks)."""
    import time

    import ray

    placed = {loc.node_id for g in groups for loc in g.locations}
    deadline = time.monotonic() + wait_s
    while True:
        try:
            alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        except Exception:  # noqa: BLE001 - the GCS itself is gone (the head was lost): nothing to name by id
            return set()
        gone = placed - alive
        if gone or time.monotonic() >= deadline:
            return gone
        time.sleep(0.5)


def describe_lost_nodes(groups: Iterable[WorkerGroup], node_ids: set[str]) -> str:
    """'node 10.0.0.2 [node 1a2b3c4d] was lost, with role actor+ref (pool 'main') ranks 1, 3 of 4': every
    rank that ran on the lost nodes, by group, so that the user knows what to replace or shrink."""
    groups = list(groups)
    parts = []
    for node_id in sorted(node_ids):
        ranks = [(g, r) for g, r in lost_node_ranks(groups, {node_id})]
        ip = next((g.locations[r].node_ip for g, r in ranks), "?")
        by_group: dict[str, list[int]] = {}
        sizes: dict[str, tuple[str, int]] = {}
        for group, rank in ranks:
            key = f"role {'+'.join(group.plan.roles)} (pool '{group.plan.pool}')"
            by_group.setdefault(key, []).append(rank)
            sizes[key] = (key, group.plan.world_size)
        held = "; ".join(f"{key} rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))} of {sizes[key][1]}"
                         for key, r in by_group.items())
        parts.append(f"node {ip} [node {node_id[:8]}] was lost, with {held}")
    return "; ".join(parts)
