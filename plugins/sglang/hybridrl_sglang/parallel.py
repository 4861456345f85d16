"""Which ranks of a pool form one SGLang engine replica, and which GPUs that engine sees (engine-free).

Same layout as the vLLM plugin: ``world_size // tp`` replicas of ``tp`` consecutive ranks. SGLang starts its own
scheduler process per tensor-parallel rank, so only the first rank of a replica (the *leader*) starts an
``sglang.Engine``; it must see the GPUs of all its peers (Ray narrows each worker to its own), so the leader
gathers the peers' visible devices and starts the engine with them. The other ranks host no engine: they
return no output and their weight imports are no-ops (the leader feeds every tensor-parallel rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from hybridrl.engines import DataParallelInfo


@dataclass(frozen=True)
class ReplicaLayout:
    rank: int
    world_size: int
    tp: int

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"tensor_parallel must be >= 1, got {self.tp}")
        if self.world_size % self.tp:
            raise ValueError(f"the rollout pool has {self.world_size} device(s), not a multiple of "
                             f"tensor_parallel={self.tp}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside a pool of {self.world_size}")

    @property
    def replica(self) -> int:
        """Index of this rank's engine replica (its data-parallel rank)."""
        return self.rank // self.tp

    @property
    def replicas(self) -> int:
        return self.world_size // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def leader(self) -> bool:
        """Whether this rank starts and drives the replica's engine."""
        return self.tp_rank == 0

    @property
    def peers(self) -> list[int]:
        """Pool ranks of this replica, leader first."""
        first = self.replica * self.tp
        return list(range(first, first + self.tp))

    def data_parallel(self) -> DataParallelInfo:
        return DataParallelInfo(dp_rank=self.replica, dp_size=self.replicas, returns_output=self.leader)


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
