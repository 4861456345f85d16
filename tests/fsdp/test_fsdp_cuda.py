"""The CUDA path (NCCL group, bf16 mixed precision, gradient checkpointing, offload/onload) on one GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridrl.runtime.distributed import free_port

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_cuda_engine(tmp_path: Path) -> None:
    worker = Path(__file__).with_name("_fsdp_cuda_worker.py")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")}
    proc = subprocess.run([sys.executable, str(worker), str(free_port()), str(tmp_path)], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
