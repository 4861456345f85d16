"""The battery ``pytest --hybridrl-backend=NAME`` collects: each contract class, parametrized over the
selected backends (``[name]`` in the test id; bridges ``[trainer-to-rollout]``). Collected only through the
plugin, which knows the selection; classes with nothing selected are deselected."""

from __future__ import annotations

import pytest

from hybridrl.testing.bridge_contract import BridgeContract
from hybridrl.testing.plugin import selection_of
from hybridrl.testing.rollout_contract import RolloutEngineContract
from hybridrl.testing.train_contract import TrainEngineContract


class TestRolloutEngine(RolloutEngineContract):
    """The rollout battery for each selected rollout backend."""


class TestTrainEngine(TrainEngineContract):
    """The train battery for each selected train backend."""


class TestBridge(BridgeContract):
    """The bridge battery for each selected (trainer, rollout) pair."""


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    selection = selection_of(metafunc.config)
    if metafunc.cls is TestRolloutEngine and selection.rollout:
        metafunc.parametrize("backend_name", selection.rollout, ids=selection.rollout, scope="class")
    elif metafunc.cls is TestTrainEngine and selection.train:
        metafunc.parametrize("backend_name", selection.train, ids=selection.train, scope="class")
    elif metafunc.cls is TestBridge and selection.bridges:
        metafunc.parametrize("bridge_pair", selection.bridges, ids=[f"{t}-to-{r}" for t, r in selection.bridges],
                             scope="class")
