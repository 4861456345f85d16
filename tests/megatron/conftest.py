"""Fixtures of the Megatron tests: tiny Qwen2/Llama checkpoints and a one-rank gloo group."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from _mg_helpers import save_tiny  # noqa: E402


@pytest.fixture(scope="session")
def qwen2_tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("mg-qwen2-tied"), "qwen2", tie=True)


@pytest.fixture(scope="session")
def llama_untied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("mg-llama-untied"), "llama", tie=False, seed=1)


@pytest.fixture(scope="session")
def llama3_rope(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama 3 frequency scaling (the variant megatron-core implements: factors 1 and 4, 8192 positions)."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    return save_tiny(tmp_path_factory.mktemp("mg-llama3-rope"), "llama", tie=False, seed=2, rope_scaling=scaling)


@pytest.fixture(scope="session")
def process_group() -> None:
    """A 1-rank gloo group for the whole session (the default group is global to the pytest process; one
    already made by another test module is reused and left alone)."""
    from hybridrl.runtime.distributed import free_port, init_process_group

    if dist.is_initialized():
        if dist.get_world_size() != 1:
            pytest.skip("a multi-rank process group is already initialised in this process")
        yield
        return
    init_process_group(0, 1, "127.0.0.1", free_port(), "cpu")
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
