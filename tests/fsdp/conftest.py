"""Fixtures of the FSDP engine tests: a tiny checkpoint and a one-rank gloo group for in-process engines."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from _fsdp_helpers import save_tiny_qwen2  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2-tied"), tie=True)


@pytest.fixture(scope="session")
def tiny_model_untied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2-untied"), tie=False, seed=1)


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
