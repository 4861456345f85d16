from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray for the end-to-end tests (each run removes its placement groups when done)."""
    import ray

    ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, configure_logging=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    yield
    ray.shutdown()
