from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from _live_run import LiveRun

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"


def _start_local_ray() -> None:
    from hybridrl.runtime.local_ray import LOOPBACK_ENV, start_local_ray

    start_local_ray(os.cpu_count() or 2, {"env_vars": {"TOKENIZERS_PARALLELISM": "false", **LOOPBACK_ENV}})


@pytest.fixture(scope="session")
def _ray_session():
    """One local Ray for the end-to-end tests of a process, started as a run starts its own (loopback only, no
    HTTP servers, its session folder removed at the end)."""
    from hybridrl.runtime.local_ray import stop_local_ray

    _start_local_ray()
    yield
    stop_local_ray()


@pytest.fixture(scope="module")
def ray_local(_ray_session):
    """The session's local Ray, started again when a test of another file in this process shut it down (Ray's
    first call would otherwise start a default cluster of its own); each run removes its placement groups.
    Module-scoped so that a file's module-scoped runs can share it."""
    import ray

    if not ray.is_initialized():
        _start_local_ray()


@pytest.fixture
def run_cli(tmp_path: Path) -> Iterator[Callable[..., LiveRun]]:
    """``run_cli(config, *overrides, own_home=False)`` starts a run; every run started is cleaned up after."""
    runs: list[LiveRun] = []

    def start(config: str, *overrides: str, own_home: bool = False) -> LiveRun:
        runs.append(LiveRun(tmp_path, config, *overrides, own_home=own_home))
        return runs[-1]

    yield start
    for run in runs:
        run.cleanup()
