"""The plugin surface: everything a backend author implements or reuses, in one package.

- ``contracts``: ``TrainEngine`` and ``RolloutEngine``, the context and options they are built with.
- ``batch``: ``Batch``, the tensors that travel between the roles.
- ``capabilities``: the optional methods a backend may declare (``supports=``).
- ``spec``: ``BackendSpec``, the record a plugin registers (options, memory model, OOM fixes, capabilities).
- ``memory_model``: the protocol a backend's memory model implements for the plan and ``auto``.
- ``train_kit`` / ``rollout_kit``: helpers every train / rollout engine needs (devices, seeds, packing).
- ``sleep``: what a colocated rollout releases when it sleeps and what each wake brings back.

The names below are the contracts; import the rest from their modules.
"""

from hybridrl.data_parallel import DataParallelInfo
from hybridrl.engines.batch import Batch
from hybridrl.engines.contracts import (
    EngineContext,
    GeneratedTokens,
    LossScale,
    NamedTensor,
    Objective,
    RolloutEngine,
    SamplingParams,
    TrainEngine,
    TrainingOptions,
    WeightBucket,
)

__all__ = ["Batch", "DataParallelInfo", "EngineContext", "GeneratedTokens", "LossScale", "NamedTensor",
           "Objective", "RolloutEngine", "SamplingParams", "TrainEngine", "TrainingOptions", "WeightBucket"]
