"""``hybridrl.testing``: the conformance kit for backend authors.

It proves that a registered backend meets the contracts the core relies on (``hybridrl.engines``,
``hybridrl.weights.bridges``), against tiny models the kit builds itself and a plain transformers forward pass.

Two ways to run it (see docs/plugins.md):

* ``pytest --hybridrl-backend=NAME`` (the pytest plugin, ``pytest11`` entry point ``hybridrl.testing.plugin``):
  the battery for every named backend, its kind taken from the registry;
* in a test file of your own::

      from hybridrl.testing import RolloutEngineContract

      class TestMyRollout(RolloutEngineContract):
          backend = "mine"

Environments have a battery of their own, ``EnvironmentContract`` (``environment = "name"``), played by a
scripted policy instead of a model.

The names below load lazily, so that the pytest plugin (imported by every pytest run in an environment
where hybridrl is installed) costs nothing until the kit is used.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "RolloutEngineContract": "hybridrl.testing.rollout_contract",
    "TrainEngineContract": "hybridrl.testing.train_contract",
    "BridgeContract": "hybridrl.testing.bridge_contract",
    "EnvironmentContract": "hybridrl.testing.environment_contract",
    "ScriptedPolicy": "hybridrl.testing.environment_contract",
    "KitModels": "hybridrl.testing.models",
    "KitModelSpec": "hybridrl.testing.models",
    "build_kit_models": "hybridrl.testing.models",
    "ReferenceModel": "hybridrl.testing.reference",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'hybridrl.testing' has no attribute '{name}'")
