"""The CUDA path (NCCL group, bf16, Megatron's DDP and optimiser, offload/onload, export) of a Qwen2.5-0.5B-
shaped model on one GPU; skipped without CUDA or megatron-core."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _mg_markers import needs_megatron

from hybridrl.runtime.distributed import free_port

pytestmark = [pytest.mark.gpu, *needs_megatron,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_bf16_step_and_export_on_one_gpu(tmp_path: Path) -> None:
    worker = Path(__file__).with_name("_mg_gpu_worker.py")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")}
    proc = subprocess.run([sys.executable, str(worker), str(free_port()), str(tmp_path)], capture_output=True,
                          text=True, timeout=900, env=env)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
