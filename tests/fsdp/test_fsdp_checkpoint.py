"""FSDP checkpoints over two gloo ranks: what is saved (sharded weights, AdamW moments, the lr schedule) comes
back exactly, on two ranks and resharded onto one, so the step after a resume equals the step without one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from hybridrl.runtime.distributed import free_port

WORKER = Path(__file__).with_name("_fsdp_ckpt_worker.py")


def launch(world_size: int, model: Path, out: Path, mode: str) -> list[tuple[str, subprocess.Popen]]:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return [(f"{mode} rank {r}/{world_size}",
             subprocess.Popen([sys.executable, str(WORKER), str(r), str(world_size), str(port), str(model), str(out),
                               mode], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            for r in range(world_size)]


def wait(procs: list[tuple[str, subprocess.Popen]]) -> None:
    try:
        logs = [p.communicate(timeout=180)[0] for _, p in procs]
    finally:
        for _, p in procs:
            if p.poll() is None:
                p.kill()
    for (name, p), log in zip(procs, logs):
        assert p.returncode == 0, f"{name} failed:\n{log}"


def test_two_rank_checkpoint_resumes_exactly_on_two_and_one_ranks(tiny_model: Path, tmp_path: Path) -> None:
    wait(launch(2, tiny_model, tmp_path, "save"))
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["dcp", "engine_rank0.pt", "engine_rank1.pt"]
    wait(launch(2, tiny_model, tmp_path, "load") + launch(1, tiny_model, tmp_path, "load"))  # both read it at once
    continued = torch.load(tmp_path / "continued.pt")
    moved = max(float((continued["state"][n] - continued["saved"][n]).abs().max()) for n in continued["state"])
    assert moved > 1e-4, "the second update must move the weights"
    for world in (2, 1):
        resumed = torch.load(tmp_path / f"resumed_w{world}.pt")
        for name, tensor in continued["saved"].items():
            torch.testing.assert_close(resumed["loaded"][name], tensor, atol=0, rtol=0, msg=f"w{world} {name}")
        for name, tensor in continued["state"].items():  # same AdamW moments and lr: the same step
            torch.testing.assert_close(resumed["state"][name], tensor, atol=1e-6, rtol=0, msg=f"w{world} {name}")
        assert resumed["metrics"]["lr"] == continued["metrics"]["lr"]  # the warmup schedule resumed too


class _Forged:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_forged_rank_file_or_index_is_refused_without_running(process_group, tiny_model: Path, tmp_path: Path) -> None:
    """What a checkpoint's engine files hold loads with ``weights_only=True``; a forged rank file or DCP index
    is refused naming it, and what it would run never runs."""
    import pickle

    import pytest
    from _fsdp_helpers import context

    from hybridrl.run.trusted_files import UntrustedFileError, unsafe_files
    from hybridrl_fsdp.engine import FSDPEngine

    engine = FSDPEngine(context(tiny_model, lr=1e-2))
    saved = tmp_path / "actor"
    engine.save_checkpoint(str(saved))
    assert unsafe_files(saved) == []  # the rank file (lr schedule, RNG) and the DCP index are plain data
    engine.load_checkpoint(str(saved))
    marker = tmp_path / "MARKER"
    rank_file = saved / "engine_rank0.pt"
    torch.save({"scheduler": None, "rng": _Forged(marker)}, rank_file)
    with pytest.raises(UntrustedFileError, match="could run code") as info:
        engine.load_checkpoint(str(saved))
    assert str(rank_file) in str(info.value) and "\n" not in str(info.value)
    engine.save_checkpoint(str(saved))
    index = saved / "dcp" / ".metadata"
    index.write_bytes(pickle.dumps(_Forged(marker)))
    with pytest.raises(UntrustedFileError, match="could run code") as info:
        engine.load_checkpoint(str(saved))
    assert str(index) in str(info.value)
    assert not marker.exists()
