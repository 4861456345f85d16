"""Which ranks of a pool form one SGLang engine replica, and which GPUs that engine sees (engine-free).

Same layout as the vLLM plugin: ``world_size // tp`` replicas of ``tp`` consecutive ranks. SGLang starts its own
scheduler process per tensor-parallel rank, so only the first rank of a replica (the *leader*) starts an
``sglang.Engine``; it must see the GPUs of all its peers (Ray narrows each worker to its own), so the leader
gathers the peers' visible devices and starts the engine with them. The other ranks host no engine: they
return no output and their weight imports are no-ops (the leader feeds every tensor-parallel rank). The layout
(``leader``, ``peers`` included) is the core's ``hybridrl.engines.rollout_kit.ReplicaLayout``; the devices are here.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridrl.engines.rollout_kit import ReplicaLayout


def engine_devices(layout: ReplicaLayout, visible_per_rank: Sequence[str | None]) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` for the leader's engine: the first visible device of each peer, in peer order.

    ``visible_per_rank[r]`` is rank ``r``'s ``CUDA_VISIBLE_DEVICES`` (``None``: not set, every GPU visible).
    Returns ``None`` when nothing needs changing (one rank per engine, or no rank is narrowed). Refuses a
    replica whose peers share a GPU or where only some peers are narrowed (no consistent numbering)."""
    if len(visible_per_rank) != layout.world_size:
        raise ValueError(f"{len(visible_per_rank)} device lists for a pool of {layout.world_size}")
    if layout.tp == 1:
        return None
    lists = [visible_per_rank[r] for r in layout.peers]
    if all(v is None or v == "" for v in lists):
        return None
    if any(v is None or v == "" for v in lists):
        raise ValueError(f"replica {layout.replica}: some ranks have CUDA_VISIBLE_DEVICES and some do not: {lists}")
    firsts = [str(v).split(",")[0].strip() for v in lists]
    if len(set(firsts)) != len(firsts):
        raise ValueError(f"replica {layout.replica}: its ranks share GPUs {firsts}; each tensor-parallel rank "
                         "needs a device of its own")
    return ",".join(firsts)
