"""Placement: pools of devices, roles mapped onto pools, and the resolved device map.

Pure logic, no Ray: the same code checks a plan against a declared cluster on a laptop and places the
real run. Roles on one pool are colocated; roles whose backends are of the same *process family* are fused
into one process per device, and a device may hold at most ``cluster.max_colocate_count`` processes.

A plan's devices are logical (``node1:3``: the fourth device of the pool's second node). How Ray is asked
to place them is the plan's ``placements``: the devices of a node that talk over NVLink (a trainer's
collectives, one tensor-parallel engine) form one ``STRICT_PACK`` placement group, so they land on one
machine; everything else (CPU slots over gloo/TCP, independent engine replicas) is one ``SPREAD`` group per
pool, where Ray picks the nodes. Which machine each rank landed on is the *device map*
(``hybridrl.runtime.launch``), read from Ray once the workers run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridrl.config import ConfigError, RunConfig
from hybridrl.plugins.registry import BackendEntry, Registry, RegistryError
from hybridrl.roles import role_spec


def role_phase_names(role: str) -> tuple[str, ...]:
    """The phases of a step (``timing/<phase>``) in which ``role`` works, with its part of the weight sync."""
    spec = role_spec(role)
    return tuple(p.name for p in spec.phases) + ((f"reshard-{spec.reshard}",) if spec.reshard else ())


@dataclass(frozen=True)
class NodeHost:
    """A node of a live Ray cluster: its id, its address and its devices (GPUs, or CPUs as slots)."""

    node_id: str
    ip: str
    devices: int
    head: bool = False

    def describe(self, kind: str = "device") -> str:
        return f"{self.ip}{' (head)' if self.head else ''} [node {self.node_id[:8]}, {self.devices} {kind}(s)]"


@dataclass(frozen=True)
class ClusterSpec:
    nodes: int
    devices_per_node: int
    device: str  # "cpu" or "cuda"
    declared: bool = False
    #: the nodes of the Ray cluster the spec was read from (empty for a declared cluster or this machine)
    hosts: tuple[NodeHost, ...] = ()

    @property
    def total(self) -> int:
        return self.nodes * self.devices_per_node

    def describe(self) -> str:
        kind = "GPU" if self.device == "cuda" else "CPU slot"
        text = f"{self.nodes} node(s) x {self.devices_per_node} {kind}(s){' (declared)' if self.declared else ''}"
        return text + (f": {', '.join(h.describe(kind) for h in self.hosts)}" if self.hosts else "")


@dataclass(frozen=True)
class Device:
    node: int
    index: int

    def __str__(self) -> str:
        return f"node{self.node}:{self.index}"


@dataclass
class ProcessGroupPlan:
    """One process per device of a pool, hosting the fused roles of one process family."""

    pool: str
    family: str
    roles: dict[str, str]  # role -> backend
    devices: list[Device]
    slot: int  # which process on the device (0 .. max_colocate_count-1)

    @property
    def world_size(self) -> int:
        return len(self.devices)

    @property
    def name(self) -> str:
        return f"{self.pool}/{'+'.join(self.roles)}"


#: Ray placement-group strategies a pool is placed with (``PoolPlacement``).
STRICT_PACK, SPREAD = "STRICT_PACK", "SPREAD"


@dataclass(frozen=True)
class PoolPlacement:
    """How Ray is asked to place a pool: one placement group per entry of ``bundle_sets`` (each the pool
    positions, in rank order, of the devices it reserves), all with ``strategy``, and why."""

    pool: str
    strategy: str  # STRICT_PACK: the group's devices share one node; SPREAD: Ray spreads them over nodes
    bundle_sets: tuple[tuple[int, ...], ...]
    reason: str

    def describe(self) -> str:
        groups = len(self.bundle_sets)
        shape = f"{groups} group(s) of {len(self.bundle_sets[0])}" if self.strategy == STRICT_PACK else \
            f"1 group of {len(self.bundle_sets[0])}"
        return f"pool '{self.pool}': {self.strategy}, {shape} ({self.reason})"


@dataclass
class PlacementPlan:
    cluster: ClusterSpec
    pools: dict[str, list[Device]]
    groups: list[ProcessGroupPlan]
    role_pool: dict[str, str] = field(default_factory=dict)
    pipelined_staleness: int | None = None  # trainer.max_staleness when trainer.pipelined, else None
    pipelined_sync_every: int | None = None  # trainer.sync_every when trainer.pipelined, else None
    memory_table: str | None = None  # the memory estimate (placement.memory.render_memory), printed with the map
    memory: Any = None  # that estimate (placement.memory.MemoryEstimate): an out-of-memory answer quotes it
    placements: dict[str, PoolPlacement] = field(default_factory=dict)  # pool -> how Ray places it
    topology: Any = None  # the links between the devices (placement.topology.Topology), when read
    links_table: str | None = None  # those links inside each pool (placement.links.render_links), printed with the map
    shares: dict[str, str] = field(default_factory=dict)  # pool -> the pool whose devices it runs on too

    def device_set(self, pool: str) -> str:
        """The pool that owns ``pool``'s devices: itself, or the one it shares (``pools.<name>.share``)."""
        return self.shares.get(pool, pool)

    def same_devices(self, role_a: str, role_b: str) -> bool:
        """Whether the two roles run on the same devices: one pool (colocated, time-shared) or two pools of which
        one shares the other's devices (fractional: both resident at once)."""
        a, b = self.role_pool.get(role_a), self.role_pool.get(role_b)
        return a is not None and b is not None and self.device_set(a) == self.device_set(b)

    def fractional(self, role_a: str, role_b: str) -> bool:
        """Same devices, different pools: both roles resident at once, running side by side."""
        return self.same_devices(role_a, role_b) and not self.colocated(role_a, role_b)

    def per_device(self, pool: str) -> int:
        """Ranks of ``pool`` on each of its devices (``pools.<name>.per_device``)."""
        devices = self.pools[pool]
        return max(1, len(devices) // max(1, len(set(devices))))

    def unique_devices(self, pool: str) -> list[Device]:
        """The pool's devices, each once, in rank order."""
        return list(dict.fromkeys(self.pools[pool]))

    def pools_on_devices_of(self, pool: str) -> list[str]:
        """``pool`` and every pool on the same devices (the one it shares, those sharing it), in config order."""
        return [p for p in self.pools if self.device_set(p) == self.device_set(pool)]

    def processes_per_device(self, pool: str) -> int:
        """Processes on each device of ``pool``: its process groups and those of every pool on the same devices."""
        members = set(self.pools_on_devices_of(pool))
        return sum(self.per_device(g.pool) for g in self.groups if g.pool in members)

    def nodes_of(self, role: str) -> list[int]:
        """The (logical) nodes a role's devices are on, in rank order, each once."""
        return list(dict.fromkeys(d.node for d in self.group_of(role).devices))

    def group_of(self, role: str) -> ProcessGroupPlan:
        for group in self.groups:
            if role in group.roles:
                return group
        raise KeyError(role)

    def colocated(self, role_a: str, role_b: str) -> bool:
        return self.role_pool.get(role_a) == self.role_pool.get(role_b)

    def same_process(self, role_a: str, role_b: str) -> bool:
        return self.group_of(role_a) is self.group_of(role_b)

    def split_roles(self) -> list[str]:
        """Roles that run on a pool of their own (at the same time as the others)."""
        shared = {p for p in self.role_pool.values() if list(self.role_pool.values()).count(p) > 1}
        return sorted(r for r, p in self.role_pool.items() if p not in shared)

    def rows(self) -> list[tuple[str, str, str, str]]:
        """(device, pool, process slot, roles with backend and rank) for printing."""
        out = []
        for pool, devices in self.pools.items():
            for rank, device in enumerate(devices):
                for group in self.groups:
                    if group.pool == pool:
                        roles = ", ".join(f"{r}[{b}] rank {rank}/{group.world_size}" for r, b in group.roles.items())
                        out.append((str(device), pool, f"proc {group.slot} ({group.family})", roles))
        return out

    def phase_rows(self) -> list[tuple[str, str]]:
        """(device, the phases each role on it runs) for printing; roles a plugin adds show no phases."""
        out = []
        for pool, devices in self.pools.items():
            for device in devices:
                cells = []
                for group in self.groups:
                    if group.pool == pool:
                        cells += [f"{r}[{', '.join(role_phase_names(r) or ('?',))}]" for r in group.roles]
                out.append((str(device), ", ".join(cells)))
        return out

    def device_runs(self, pool: str) -> list[tuple[str, int, int]]:
        """The pool's devices as runs for printing: ``(label, first rank, last rank)``, consecutive nodes that
        hold the same device indices joined (``node0-3:0-7`` is 32 devices, ranks 0-31)."""
        devices, copies = self.unique_devices(pool), self.per_device(pool)
        by_node: dict[int, list[int]] = {}
        for d in devices:
            by_node.setdefault(d.node, []).append(d.index)
        runs: list[tuple[list[int], list[int]]] = []
        for node, indices in by_node.items():
            if runs and runs[-1][1] == indices and runs[-1][0][-1] == node - 1:
                runs[-1][0].append(node)
            else:
                runs.append(([node], indices))
        out, rank = [], 0
        for nodes, indices in runs:
            span = f"{nodes[0]}" if len(nodes) == 1 else f"{nodes[0]}-{nodes[-1]}"
            contiguous = indices == list(range(indices[0], indices[0] + len(indices)))
            idx = (f"{indices[0]}" if len(indices) == 1 else
                   f"{indices[0]}-{indices[-1]}" if contiguous else ",".join(map(str, indices)))
            count = len(nodes) * len(indices) * copies
            out.append((f"node{span}:{idx}", rank, rank + count - 1))
            rank += count
        return out

    def render(self) -> str:
        header = ("device", "pool", "process", "roles")
        rows: list[tuple[str, ...]] = [header]
        for pool in self.pools:
            for label, first, last in self.device_runs(pool):
                ranks = f"rank {first}" if first == last else f"ranks {first}-{last}"
                for group in self.groups:
                    if group.pool == pool:
                        roles = ", ".join(f"{r}[{b}] {ranks}/{group.world_size}" for r, b in group.roles.items())
                        rows.append((label, pool, f"proc {group.slot} ({group.family})", roles))
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = [f"cluster: {self.cluster.describe()}"]
        for i, row in enumerate(rows):
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
        modes = []
        for pool in self.pools:
            roles = [r for r, p in self.role_pool.items() if p == pool]
            modes.append(f"{pool}: {' + '.join(roles) or '(unused)'}{' (colocated)' if len(roles) > 1 else ''}")
        lines.append("pools: " + "; ".join(modes))
        for pool, host in self.shares.items():
            lines.append(f"fractional: pool '{pool}' runs on the devices of pool '{host}', both resident at once "
                         f"({self.processes_per_device(pool)} processes per device)")
        for pool in self.pools:
            if self.per_device(pool) > 1:
                lines.append(f"pool '{pool}': {self.per_device(pool)} ranks per device (independent replicas side "
                             "by side)")
        if "actor" in self.role_pool and "rollout" in self.role_pool:
            how = "in-process" if self.same_process("actor", "rollout") else (
                "colocated, separate processes" if self.colocated("actor", "rollout") else
                "fractional devices, separate processes" if self.fractional("actor", "rollout") else
                "split pools (broadcast)")
            apart = not self.same_devices("actor", "rollout")
            if apart and set(self.nodes_of("rollout")) - {self.nodes_of("actor")[0]}:
                how += ", between nodes"
            lines.append(f"reshard actor -> rollout: {how}")
        if self.placements:
            lines.append("ray placement groups:")
            lines += [f"  {p.describe()}" for p in self.placements.values()]
        lines.append("phases per device:")
        phase_rows = []
        for pool in self.pools:
            cells = []
            for group in self.groups:
                if group.pool == pool:
                    cells += [f"{r}[{', '.join(role_phase_names(r) or ('?',))}]" for r in group.roles]
            phase_rows += [(label, ", ".join(cells)) for label, _, _ in self.device_runs(pool)]
        width = max((len(d) for d, _ in phase_rows), default=0)
        lines += [f"  {device.ljust(width)}  {phases}" for device, phases in phase_rows]
        if self.pipelined_staleness is not None and "rollout" in self.role_pool:
            every = self.pipelined_sync_every or 1
            lines.append(f"pipelined: pool '{self.role_pool['rollout']}' generates step k+1 while step k trains "
                         f"(weights sent every {every} update(s): batches at most {every} update(s) stale)")
        if self.links_table:
            lines.append(self.links_table)
        if self.memory_table:
            lines.append(self.memory_table)
        return "\n".join(lines)


def resolve_backends(cfg: RunConfig, registry: Registry, check_engines: bool = True
                     ) -> tuple[dict[str, BackendEntry], list[tuple[str, str]]]:
    """Backend entry for every pooled role, and the problems found (unknown backend, engine missing)."""
    entries: dict[str, BackendEntry] = {}
    problems: list[tuple[str, str]] = []
    for role, rcfg in cfg.role_configs().items():
        name = rcfg.backend or (cfg.roles.actor.backend if role == "ref" else None)
        if name is None:
            problems.append((f"roles.{role}.backend", "required for a role placed on a pool"))
            continue
        try:
            entry = registry.backend(role_spec(role).kind, name)
        except RegistryError as exc:
            problems.append((f"roles.{role}.backend", str(exc)))
            continue
        if check_engines and (problem := entry.engine_problem()):
            problems.append((f"roles.{role}.backend", f"backend '{name}' from {entry.plugin} is {problem}"))
        entries[role] = entry
    return entries, problems


def engine_warnings(backends: dict[str, BackendEntry]) -> list[str]:
    """Backends whose engine is not installed here: a plan needs only the registry's metadata (a laptop plans for
    a GPU cluster), a training run refuses them (``resolve_backends``)."""
    out = []
    for role, entry in backends.items():
        problem = entry.engine_problem()
        if problem:
            out.append(f"roles.{role}.backend: backend '{entry.name}' from {entry.plugin} is {problem}; the plan "
                       "does not need it, hybridrl train on this machine would refuse it")
    return out


def configured_pools(cfg: RunConfig) -> dict[str, str | None]:
    """Each role's pool as the config names it: its own ``pool``, else the actor's (roles placed with the
    actor by default) or the first pool. Unknown names are left for ``plan_placement`` to refuse."""
    default_pool = next(iter(cfg.pools), None)
    actor_pool = cfg.roles.actor.pool or default_pool
    return {role: rcfg.pool or (actor_pool if role_spec(role).default_pool == "actor" else default_pool)
            for role, rcfg in cfg.role_configs().items()}


def plan_placement(cfg: RunConfig, cluster: ClusterSpec, backends: dict[str, BackendEntry]) -> PlacementPlan:
    """Assign pools to devices and fuse colocated roles into processes. Raises ``ConfigError``."""
    problems: list[tuple[str, str]] = []
    role_pool: dict[str, str] = {}
    for role, pool in configured_pools(cfg).items():
        if pool is None or pool not in cfg.pools:
            problems.append((f"roles.{role}.pool", f"unknown pool '{pool}' (pools: {', '.join(cfg.pools) or 'none'})"))
            continue
        role_pool[role] = pool
        entry = backends.get(role)
        if entry is not None and cluster.device not in entry.devices:
            problems.append((f"roles.{role}.backend", f"backend '{entry.name}' runs on {'/'.join(entry.devices)}, "
                                                      f"the cluster has {cluster.device}"))

    used = [p for p in cfg.pools if p in role_pool.values()]
    shares = {p: cfg.pools[p].share for p in used if cfg.pools[p].share is not None}
    for pool, host in shares.items():
        if host not in used:
            problems.append((f"pools.{pool}.share", f"pool '{host}' has no role: place a role on it, or give pool "
                                                    f"'{pool}' devices of its own"))
    need = sum(cfg.pools[p].size for p in used if p not in shares)
    if need > cluster.total:
        detail = ", ".join(f"{p}={cfg.pools[p].nodes}x{cfg.pools[p].devices_per_node}" for p in used)
        problems.append(("pools", f"the pools ask for {need} devices ({detail}) but the cluster has {cluster.total} "
                                  f"({cluster.describe()})"))
    for name, pool in cfg.pools.items():
        if pool.devices_per_node > cluster.devices_per_node:
            problems.append((f"pools.{name}.devices_per_node",
                             f"{pool.devices_per_node} devices per node, a node has {cluster.devices_per_node}"))
        if pool.nodes > cluster.nodes:
            problems.append((f"pools.{name}.nodes", f"{pool.nodes} nodes, the cluster has {cluster.nodes}"))
    if problems:
        raise ConfigError(problems)

    pools = _allocate(cfg, [p for p in used if p not in shares], cluster)
    pools = {p: list(pools[shares[p]]) if p in shares else pools[p] for p in used}
    for p in used:  # several ranks per device: rank r on the pool's device r // per_device
        copies = cfg.pools[p].per_device
        if copies > 1:
            pools[p] = [d for d in pools[p] for _ in range(copies)]
            others = sorted(r for r, q in role_pool.items() if q == p and r != "rollout")
            if others:
                problems.append((f"pools.{p}.per_device", f"{copies} processes per device suit independent rollout "
                                                          f"replicas; pool '{p}' also holds {', '.join(others)}: "
                                                          "give the rollout a pool of its own (share to stay on "
                                                          "the same devices)"))
            if cfg.roles.rollout.tensor_parallel > 1:
                problems.append((f"pools.{p}.per_device", "replicas side by side on one device are one device "
                                                          "each: roles.rollout.tensor_parallel must be 1"))
    groups: list[ProcessGroupPlan] = []
    for pool in used:
        families: dict[str, dict[str, str]] = {}
        for role, p in role_pool.items():
            if p != pool:
                continue
            entry = backends.get(role)
            family = entry.process_family if entry else "any"
            if family == "any":
                family = next(iter(families), "any")
            families.setdefault(family, {})[role] = entry.name if entry else "-"
        if len(families) > cfg.cluster.max_colocate_count:
            desc = "; ".join(f"{fam}: {', '.join(f'{r}[{b}]' for r, b in roles.items())}"
                             for fam, roles in families.items())
            problems.append((f"roles (pool '{pool}')",
                             f"colocated roles need {len(families)} processes per device because their backends "
                             f"cannot share a process ({desc}); cluster.max_colocate_count is "
                             f"{cfg.cluster.max_colocate_count}"))
        for slot, (family, roles) in enumerate(families.items()):
            groups.append(ProcessGroupPlan(pool, family, roles, pools[pool], slot))
    if problems:
        raise ConfigError(problems)
    pipelined = cfg.trainer.pipelined
    plan = PlacementPlan(cluster, pools, groups, role_pool,
                         pipelined_staleness=cfg.trainer.max_staleness if pipelined else None,
                         pipelined_sync_every=cfg.trainer.sync_every if pipelined else None, shares=shares)
    plan.placements = {pool: pool_placement(plan, pool, cfg.roles.rollout.tensor_parallel) for pool in used
                       if pool not in shares}  # a sharing pool's processes go into its host's placement groups
    return plan


def pool_placement(plan: PlacementPlan, pool: str, rollout_tp: int = 1) -> PoolPlacement:
    """``STRICT_PACK`` per node where the pool's processes talk over NVLink inside a node (on GPUs: a train
    backend's collectives over more than one device of the node, a tensor-parallel rollout), else one ``SPREAD``
    group: CPU slots talk over TCP wherever they are, independent replicas do not talk at all."""
    devices = plan.unique_devices(pool)
    positions: dict[int, list[int]] = {}
    for i, d in enumerate(devices):
        positions.setdefault(d.node, []).append(i)
    per_node = max(len(p) for p in positions.values())
    reasons = []
    if plan.cluster.device == "cuda" and per_node > 1:
        for group in plan.groups:
            if plan.device_set(group.pool) != pool:
                continue
            trainers = [f"{r}[{b}]" for r, b in group.roles.items() if role_spec(r).kind == "train"]
            if trainers:
                reasons.append(f"{'+'.join(trainers)} run collectives every layer: NVLink inside a node")
            if "rollout" in group.roles and rollout_tp > 1:
                reasons.append(f"rollout tensor_parallel={rollout_tp}: one engine's ranks on one node")
    if reasons:
        return PoolPlacement(pool, STRICT_PACK, tuple(tuple(p) for p in positions.values()), "; ".join(reasons))
    why = ("CPU slots talk over TCP wherever they are" if plan.cluster.device == "cpu" else
           "one device per node" if per_node == 1 else "independent engine replicas")
    return PoolPlacement(pool, SPREAD, (tuple(range(len(devices))),), why)


def _allocate(cfg: RunConfig, used: list[str], cluster: ClusterSpec) -> dict[str, list[Device]]:
    """Give each pool ``nodes`` nodes with ``devices_per_node`` free devices each, first fit."""
    free = {n: list(range(cluster.devices_per_node)) for n in range(cluster.nodes)}
    out: dict[str, list[Device]] = {}
    for name in used:
        pool = cfg.pools[name]
        nodes = [n for n in free if len(free[n]) >= pool.devices_per_node][: pool.nodes]
        if len(nodes) < pool.nodes:
            raise ConfigError([(f"pools.{name}", f"needs {pool.nodes} node(s) with {pool.devices_per_node} free "
                                                 f"device(s) each; the pools before it leave too few "
                                                 f"({cluster.describe()})")])
        devices = []
        for n in nodes:
            take, free[n] = free[n][: pool.devices_per_node], free[n][pool.devices_per_node:]
            devices += [Device(n, i) for i in take]
        out[name] = devices
    return out
