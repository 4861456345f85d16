from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray for the end-to-end tests, started as a run starts its own (loopback only, its session
    folder removed at the end); each run removes its placement groups when done."""
    from hybridrl.runtime.local_ray import LOOPBACK_ENV, start_local_ray, stop_local_ray

    start_local_ray(os.cpu_count() or 2, {"env_vars": {"TOKENIZERS_PARALLELISM": "false", **LOOPBACK_ENV}})
    yield
    stop_local_ray()
