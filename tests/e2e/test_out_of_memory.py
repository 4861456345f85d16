"""Out of memory is an answer: a rollout that runs out of memory at its second wake (a test engine registered by a
test plugin, ``_oom_plugin``) stops ``hybridrl train`` with one message that names the role, the phase, the device,
the planned and measured memory and the keys that would fix it, cheapest first; the checkpoint of step 1 stays
complete and no worker process is left. The GPU case (a real CUDA out-of-memory) is ``tests/fsdp/test_fsdp_cuda.py``."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"


def run_train(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HYBRIDRL_TEST_PID_FILE": str(tmp_path / "pids"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "hybridrl.cli", "train", str(QUICKSTART), "trainer.steps=3",
                           f"trainer.out={tmp_path / 'run'}", "trainer.save_every=1", "data.prompts_per_step=4",
                           "algorithm.n_samples=4", "plugins=[_oom_plugin]", *overrides],
                          capture_output=True, text=True, cwd=ROOT, timeout=600, env=env)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is gone for our purpose
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_out_of_memory_at_wake_stops_the_run_with_one_message(tmp_path):
    out = tmp_path / "run"
    pid_file = tmp_path / "pids"
    proc = run_train(tmp_path, "roles.rollout.backend=oom_hf")
    assert proc.returncode == 1, proc.stderr[-4000:]
    message = proc.stderr[proc.stderr.index("hybridrl: out of memory"):]
    assert "out of memory in phase wake of step 2: role rollout (pool 'main'), rank 0 of 1, cpu device node0:0" \
        in message
    assert "planned: " in message and " MiB in gen" in message  # the plan's figure for that phase
    assert "measured: not measured (no CUDA device in that process)" in message
    assert "CUDA out of memory. Tried to allocate 20.00 GiB" in message  # what the engine said
    fixes = message[message.index("keys that would fix it, cheapest first: "):].splitlines()[0]
    assert fixes.index("roles.ref.options.offload=all") < fixes.index("roles.actor.options.offload=optimizer") \
        < fixes.index("data.prompts_per_step lower")
    assert "tensor_parallel" not in fixes  # the hf engine runs one engine per rank
    assert "step_000001" in message and "is intact" in message
    assert "Traceback" not in proc.stderr[proc.stderr.index("hybridrl: out of memory"):]
    checkpoints = out / "checkpoints"
    assert (checkpoints / "step_000001" / "driver.json").is_file()
    assert not any(p.name.startswith(".tmp") for p in checkpoints.iterdir())
    pids = [int(line) for line in pid_file.read_text().split()]
    assert pids
    deadline = time.time() + 30
    while any(alive(pid) for pid in pids) and time.time() < deadline:
        time.sleep(0.5)
    assert not any(alive(pid) for pid in pids), "a worker process outlived the run"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_real_cuda_out_of_memory_in_the_update_is_answered(tmp_path):
    proc = run_train(tmp_path, "roles.actor.backend=oom_fsdp", "cluster.device=cuda", "model.dtype=bfloat16")
    assert proc.returncode == 1, proc.stderr[-4000:]
    message = proc.stderr[proc.stderr.index("hybridrl: out of memory"):]
    assert ("out of memory in phase update_actor of step 2: role actor (pool 'main'), rank 0 of 1, cuda device"
            in message)
    assert " in update_actor of the " in message  # planned, against the device's memory
    assert "GiB in use of" in message and "torch" in message and "allocated" in message  # measured on the device
    fixes = message[message.index("keys that would fix it, cheapest first: "):].splitlines()[0]
    assert fixes.index("roles.actor.max_tokens_per_micro_batch=") < fixes.index("gradient_checkpointing=true")
    assert (tmp_path / "run" / "checkpoints" / "step_000001" / "driver.json").is_file()
