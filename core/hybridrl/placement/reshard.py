"""The bytes each weight sync (actor -> rollout) moves, per step, from the plan and the model's shape.

Follows what the bridges and the FSDP engine do (``hybridrl.weights.bridges``, ``TrainEngine.export_weights*``):

* **gather**: with more than one trainer rank, the export all-gathers the FSDP shards, one parameter tensor at a
  time (``gather_collectives``): every trainer device receives the ``(n-1)/n`` of the weights it does not hold
  (over NVLink inside a node, over the network from the shards held on other nodes). The gathered copy travels
  in the compute dtype on GPUs and in the fp32 master dtype on CPU; one rank exports its live fp32 shards as they
  are.
* **in_process** (actor and rollout in one process): every device copies one whole copy into its rollout
  engine; nothing crosses a process, let alone a node.
* **broadcast** (split pools): the trainer's exporting rank (rank 0) broadcasts one copy, in the compute dtype
  on GPUs (the master dtype on CPU), to every rollout rank; each rollout node other than the sender's receives
  it at least once over the network (a ring or tree broadcast enters each node once).
* **object_store**: the exporting rank puts a full fp32 copy into Ray's object store, every rollout rank
  reads it (host memory; over the network for ranks on other nodes).

A pipelined run syncs every ``trainer.sync_every`` steps, so the bytes per step are divided by it.
This is an estimate of volume, not of time: how long it takes depends on the links (figures: the README).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridrl.config import RunConfig
from hybridrl.placement.memory import DTYPE_BYTES, GIB, ModelShape
from hybridrl.placement.plan import PlacementPlan
from hybridrl.weights.bridges import resolve_transport


@dataclass(frozen=True)
class ReshardEstimate:
    """One weight sync of ``plan`` and how often it runs. Bytes are per sync unless named per step."""

    transport: str
    wire_dtype: str
    weight_bytes: float  # one whole copy of the actor's weights as it travels
    trainer_pool: str
    rollout_pool: str
    trainer_ranks: int
    rollout_ranks: int
    gather_bytes: float  # received by each trainer device to assemble the whole weights (all-gather)
    gather_remote_bytes: float  # of which from devices on other nodes
    delivered_bytes: float  # reaching the rollout ranks: copied in place (in_process) or received over the transport
    kept_bytes: float  # what each rollout device keeps of a copy (its tensor-parallel slice)
    remote_nodes: int  # rollout nodes other than the exporting rank's (broadcast, object store)
    cross_node_bytes: float  # crossing between nodes, at least (gather from other nodes + into remote nodes)
    busiest_node_bytes: float  # entering the node that receives the most from the others (its links bound the time)
    syncs_per_step: float
    sender: str = ""  # the exporting device ("node0:0")
    gather_collectives: int = 0  # all-gathers of one export: one per parameter tensor with several trainer ranks

    @property
    def per_step(self) -> float:
        """Bytes that reach the rollout per training step."""
        return self.delivered_bytes * self.syncs_per_step

    @property
    def cross_node_per_step(self) -> float:
        return self.cross_node_bytes * self.syncs_per_step


def estimate_reshard(cfg: RunConfig, plan: PlacementPlan, shape: ModelShape) -> ReshardEstimate | None:
    """The weight sync of ``plan`` for a model of ``shape``; None when the run has no actor -> rollout sync."""
    if "actor" not in plan.role_pool or "rollout" not in plan.role_pool:
        return None
    transport = resolve_transport(cfg.roles.rollout.weight_transport, plan)
    trainer, rollout = plan.group_of("actor"), plan.group_of("rollout")
    n, cuda = trainer.world_size, plan.cluster.device == "cuda"
    compute = cfg.model.dtype if cuda else "float32"  # the FSDP engine computes in fp32 on CPU
    gathered = compute if n > 1 else "float32"  # one rank exports its live fp32 shards
    wire = {"in_process": gathered, "broadcast": compute, "object_store": "float32",
            "cuda_ipc": compute}.get(transport, gathered)
    weight = float(shape.param_count() * DTYPE_BYTES[wire])
    gather_dtype_bytes = float(shape.param_count() * DTYPE_BYTES[gathered])
    gather = gather_dtype_bytes * (n - 1) / n if n > 1 else 0.0
    sender = trainer.devices[0]
    on_node = {d.node: sum(1 for e in trainer.devices if e.node == d.node) for d in trainer.devices}
    into_node: dict[int, float] = {}  # bytes entering each node from other nodes, per sync
    # the all-gather: a device receives 1/n of the weights from each other rank, those on other nodes remotely
    for d in trainer.devices:
        into_node[d.node] = into_node.get(d.node, 0.0) + gather_dtype_bytes * (n - on_node[d.node]) / n
    gather_remote = sum(into_node.values()) / n if n > 1 else 0.0
    tp = max(1, cfg.roles.rollout.tensor_parallel)
    if transport in ("in_process", "cuda_ipc"):  # each rank hands the engine(s) on its device the whole tensors
        delivered, remote_nodes = weight * trainer.world_size, 0
    else:  # one copy for every rollout rank; it enters each node other than the sender's at least once
        delivered = weight * rollout.world_size
        remote = {d.node for d in rollout.devices} - {sender.node}
        remote_nodes = len(remote)
        for node in remote:
            into_node[node] = into_node.get(node, 0.0) + weight
    sync_every = plan.pipelined_sync_every or 1
    return ReshardEstimate(transport, wire, weight, trainer.pool, rollout.pool, n, rollout.world_size, gather,
                           gather_remote, delivered, weight / tp, remote_nodes, sum(into_node.values()),
                           max(into_node.values(), default=0.0), 1.0 / sync_every, str(sender),
                           shape.tensor_count() if n > 1 else 0)


def _size(value: float) -> str:
    if value >= 0.5 * GIB:
        return f"{value / GIB:.1f} GiB"
    if value >= 2**20:
        return f"{value / 2**20:.1f} MiB"
    return f"{value / 2**10:.1f} KiB" if value else "0 B"


def render_reshard(est: ReshardEstimate, shape: ModelShape) -> str:
    """What one sync moves, where, and how often; the lines ``hybridrl plan`` prints under the memory table."""
    syncs = ("1 sync per step" if est.syncs_per_step == 1 else
             f"1 sync every {round(1 / est.syncs_per_step)} steps (pipelined, trainer.sync_every)")
    lines = [f"reshard actor -> rollout ({est.transport}; {shape.describe()} as {est.wire_dtype}: "
             f"{_size(est.weight_bytes)} a copy; {syncs}):"]
    if est.trainer_ranks > 1:
        remote = f", {_size(est.gather_remote_bytes)} of it from other nodes" if est.gather_remote_bytes else ""
        lines.append(f"  gather: each of the {est.trainer_ranks} devices of pool '{est.trainer_pool}' receives "
                     f"{_size(est.gather_bytes)} of the others' FSDP shards (all-gather{remote})")
    sliced = est.kept_bytes < est.weight_bytes
    kept = f"keeps {_size(est.kept_bytes)} (its tensor-parallel slice)" if sliced else "keeps it whole"
    if est.transport == "in_process":
        lines.append(f"  copy:   each of the {est.trainer_ranks} devices hands {_size(est.weight_bytes)} to the "
                     f"rollout engine in its process, which {kept}")
    else:
        how = "broadcasts" if est.transport == "broadcast" else "puts into Ray's object store"
        into = (f"; >= {_size(est.weight_bytes)} into each of {est.remote_nodes} other node(s)"
                if est.remote_nodes else "; all on its node")
        lines.append(f"  send:   actor rank 0 ({est.sender}) {how} {_size(est.weight_bytes)} for each of the "
                     f"{est.rollout_ranks} rollout rank(s) of pool '{est.rollout_pool}': "
                     f"{_size(est.delivered_bytes)} delivered{into}; each rank {kept}")
    reach = "" if est.transport == "in_process" else f"; {_size(est.per_step)} reach the rollout ranks"
    busiest = (f" (>= {_size(est.busiest_node_bytes * est.syncs_per_step)} into the busiest node)"
               if est.cross_node_bytes else "")
    lines.append(f"  per step: >= {_size(est.cross_node_per_step)} cross between nodes{busiest}{reach}")
    return "\n".join(lines)
