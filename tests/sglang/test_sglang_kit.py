"""The SGLang rollout through the conformance kit, as a plugin author runs it (``RolloutEngineContract`` and the
FSDP -> SGLang ``BridgeContract`` subclassed with the registered names); needs SGLang and a GPU.

The engines run in bfloat16, SGLang's own path (``HYBRIDRL_SGLANG_TEST_DTYPE=float32`` for a version that runs
float32; 0.5.16 does not), against the kit's float32 transformers reference, hence the wider tolerances. The same
battery runs without this file: ``pytest --hybridrl-backend=sglang --hybridrl-device=cuda`` (float32, the kit's
default: refused by SGLang 0.5.16)."""

from __future__ import annotations

import os

import pytest

from hybridrl.testing import BridgeContract, RolloutEngineContract

pytestmark = [pytest.mark.sglang, pytest.mark.gpu]

DTYPE = os.environ.get("HYBRIDRL_SGLANG_TEST_DTYPE", "bfloat16")
#: (log-prob atol, greedy near-tie tolerance, widening per unit of the largest logit; see test_sglang_engine.py)
#: against the kit's float32 CPU reference.
LOGPROB_ATOL, TIE_TOLERANCE, LOGIT_RTOL = {"bfloat16": (0.1, 0.05, 2**-5), "float32": (1e-3, 1e-4, 0.0)}[DTYPE]


class _OnTheGPU:
    """What both batteries share: SGLang on the GPU in ``DTYPE``, without CUDA-graph capture (fast starts)."""

    device = "cuda"
    dtype = DTYPE
    engine_options = {"gpu_memory_utilization": 0.3, "enforce_eager": True}
    logprob_atol = LOGPROB_ATOL
    greedy_tie_tolerance = TIE_TOLERANCE
    logit_rtol = LOGIT_RTOL


class TestSGLangRollout(_OnTheGPU, RolloutEngineContract):
    backend = "sglang"


class TestFSDPToSGLangBridge(_OnTheGPU, BridgeContract):
    trainer_backend = "fsdp"
    rollout_backend = "sglang"
