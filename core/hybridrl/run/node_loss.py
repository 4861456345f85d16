"""A node of the Ray cluster lost mid-run (its machine went, its raylet was killed): say which node, which roles
and ranks ran there, and where to resume from, instead of gloo's "Connection reset by peer".

What surfaces first at the driver is either the dead rank's own call (``RayActorError``, once Ray's GCS has
declared the node dead) or a surviving rank's collective failing against the vanished peer (a ``RayTaskError``
carrying gloo's or NCCL's words, or a collective timeout). Either way the driver asks Ray which of the nodes
the run placed ranks on (the device map, ``hybridrl.runtime.device_map``) are no longer alive, waiting up to
``NODE_DEATH_WAIT_S`` for the GCS to notice, and names them with every rank that ran there.
"""

from __future__ import annotations

from typing import Any

from hybridrl.run.faults import WorkerDiedError, first_line, is_collective_error, is_worker_death
from hybridrl.runtime.device_map import NODE_DEATH_WAIT_S, dead_nodes, describe_lost_nodes


class NodeLostError(WorkerDiedError):
    """A node of the cluster went with the ranks that ran on it."""


def may_be_node_loss(exc: BaseException) -> bool:
    """An error a lost node can be behind (worth waiting for Ray's verdict on the nodes): a Ray actor that
    died, or a remote collective that failed or timed out (``hybridrl.run.faults``)."""
    return is_worker_death(exc) or is_collective_error(exc)


def node_loss_failure(exc: BaseException, groups: dict[str, Any], where: str, last_checkpoint: str,
                      wait_s: float = NODE_DEATH_WAIT_S) -> NodeLostError | None:
    """``NodeLostError`` when a node that ran ranks of the run is dead, None otherwise (another fault: let
    the next explanation have it). ``where``: 'during step 3'."""
    unique = list({id(g): g for g in groups.values()}.values())
    if not unique or not any(g.locations for g in unique) or not may_be_node_loss(exc):
        return None
    lost = dead_nodes(unique, wait_s)
    if not lost:
        return None
    return NodeLostError(f"{describe_lost_nodes(unique, lost)} {where}. {last_checkpoint} On the nodes that are "
                         "left, give the pools fewer nodes (pools.<name>.nodes) or replace the node first: FSDP "
                         "resumes on another number of ranks."
                         f"\n  ({first_line(exc)})")
