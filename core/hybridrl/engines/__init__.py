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

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: each contract's module: imported at first use, so that reading the registry and refusing a bad config (which
#: need ``capabilities`` and ``spec``) load no torch
_HOMES = {"Batch": "hybridrl.engines.batch", "DataParallelInfo": "hybridrl.data_parallel",
          **{name: "hybridrl.engines.contracts" for name in (
              "EngineContext", "GeneratedTokens", "LossScale", "NamedTensor", "Objective", "RolloutEngine",
              "SamplingParams", "TrainEngine", "TrainingOptions", "WeightBucket")}}

__all__ = ["Batch", "DataParallelInfo", "EngineContext", "GeneratedTokens", "LossScale", "NamedTensor",
           "Objective", "RolloutEngine", "SamplingParams", "TrainEngine", "TrainingOptions", "WeightBucket"]

if TYPE_CHECKING:
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


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'hybridrl.engines' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value
