"""Engine tests (``@pytest.mark.sglang`` + ``@pytest.mark.gpu``) need SGLang and a CUDA device; elsewhere they are
skipped with the reason. The logic tests (``test_sglang_logic.py``) run everywhere, without SGLang."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
HAVE_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reasons = []
    if not HAVE_SGLANG:
        reasons.append("SGLang is not installed (pip install 'hybridrl-sglang[engine]'; SGLang has no CPU build)")
    if not HAVE_CUDA:
        reasons.append("needs a CUDA device")
    if not reasons:
        return
    for item in items:
        if item.get_closest_marker("sglang") is not None or item.get_closest_marker("gpu") is not None:
            item.add_marker(pytest.mark.skip(reason="; ".join(reasons)))


@pytest.fixture(scope="session", autouse=True)
def _quiet_tokenizers():
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    yield
