"""Which ranks of a pool form one vLLM engine replica (engine-free).

A pool of ``world_size`` ranks hosts ``world_size // tp`` replicas; consecutive ranks form one tensor-parallel
group (the layout vLLM builds itself over an existing process group: ``ExternalDP x TP``). The peers of one
replica get the same prompts and sample the same tokens; only the first rank of a replica returns them.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    def data_parallel(self) -> DataParallelInfo:
        return DataParallelInfo(dp_rank=self.replica, dp_size=self.replicas, returns_output=self.tp_rank == 0)
