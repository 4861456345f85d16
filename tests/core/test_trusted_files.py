"""Checkpoints are trusted only with their manifest, and their files never run code: a forged pickle that would
create a marker file when loaded is refused in one sentence naming it, and the marker never appears."""

from __future__ import annotations

import io
import os
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridrl.cli import main
from hybridrl.run import checkpoint as ckpt
from hybridrl.run.export import ExportError, export_checkpoint
from hybridrl.run.run_folder import plan_run_folder
from hybridrl.run.trusted_files import UntrustedFileError, load_plain, metadata_problem, unsafe_files


class Forged:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def write_step(step: int):
    def write(tmp: Path) -> dict:
        (tmp / "actor").mkdir()
        torch.save({"scheduler": None, "rng": {"cpu": torch.get_rng_state()}, "trainable": True},
                   tmp / "actor" / "engine_rank0.pt")
        (tmp / "actor" / "shard0").write_bytes(b"x" * 64)
        ckpt.save_driver_state(tmp, {"step": step, "loader": {"epoch": 0, "position": 0}, "rng": ckpt.rng_state()})
        return {"roles": {"actor": "fsdp"}, "model_path": "/nonexistent/model", "dtype": "float32"}
    return write


def a_run(out: Path, *steps: int) -> list[Path]:
    return [ckpt.save_checkpoint(out, step, write_step(step), keep=0) for step in steps]


def forge(path: Path, marker: Path) -> None:
    """Replace a checkpoint file by a pickle that runs a command, and rewrite the manifest as a forger would."""
    torch.save({"step": 4, "payload": Forged(marker)}, path)
    folder = next(p for p in path.parents if ckpt.is_complete(p))
    ckpt.write_manifest(folder)


def test_driver_state_is_plain_data_and_round_trips(tmp_path: Path) -> None:
    np.random.seed(7)
    random.seed(7)
    torch.manual_seed(7)
    (folder,) = a_run(tmp_path, 2)  # the RNG states are taken inside
    assert unsafe_files(folder) == []  # the driver state and the rank file load with weights_only=True
    expected = (np.random.rand(3), random.random(), torch.rand(2))
    np.random.seed(99)
    random.seed(99)
    torch.manual_seed(99)
    ckpt.set_rng_state(ckpt.load_driver_state(folder)["rng"])
    np.testing.assert_array_equal(np.random.rand(3), expected[0])
    assert random.random() == expected[1]
    assert torch.equal(torch.rand(2), expected[2])


def test_a_forged_driver_state_is_refused_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "MARKER"
    old, new = a_run(tmp_path / "run", 2, 4)
    forge(new / ckpt.DRIVER_STATE, marker)
    assert ckpt.damage(old) is None
    why = ckpt.damage(new)  # the manifest matches: the forger rewrote it; the file is refused all the same
    assert why is not None and str(new / ckpt.DRIVER_STATE) in why and "could run code" in why and "\n" not in why
    with pytest.raises(ckpt.CheckpointError, match="holds more than tensors and plain data") as info:
        ckpt.load_driver_state(new)
    assert str(new / ckpt.DRIVER_STATE) in str(info.value)
    with pytest.raises(ckpt.CheckpointError, match="could run code"):  # trainer.resume=<that checkpoint>
        ckpt.resolve_resume(str(new), tmp_path / "run")
    plan = plan_run_folder(tmp_path / "run", "auto")  # automatic resume passes over it, saying why
    assert plan.resume_from == old and any(str(new / ckpt.DRIVER_STATE) in n for n in plan.notes)
    assert not marker.exists()


def test_a_checkpoint_without_manifest_is_refused_unless_asked(tmp_path: Path) -> None:
    out = tmp_path / "run"
    (only,) = a_run(out, 2)
    (only / ckpt.MANIFEST).unlink()
    shard = only / "actor" / "shard0"
    shard.write_bytes(b"y" + shard.read_bytes()[1:])  # a byte changed: nothing can tell without the manifest
    plan = plan_run_folder(out, "auto")
    reason = " ".join(r for _, r in plan.problems)
    assert plan.resume_from is None and "step_000002" in reason and "manifest.json is missing" in reason
    with pytest.raises(ckpt.CheckpointError, match="cannot be trusted: manifest.json is missing") as info:
        ckpt.resolve_resume(str(only), out)
    assert str(only) in str(info.value) and "trainer.resume_unverified=true" in str(info.value)
    assert plan_run_folder(out, "auto", resume_unverified=True).resume_from == only  # the user's choice
    newer_verified = a_run(out, 4)[0]
    (newer_verified / ckpt.MANIFEST).unlink()  # the newest has none, an older one (rebuilt) has one
    a_run(out, 1)
    (out / "checkpoints" / "latest").write_text("step_000004")
    plan = plan_run_folder(out, "auto")
    assert plan.resume_from == out / "checkpoints" / "step_000001"
    assert any(n.startswith(f"skipped the unverified checkpoint {newer_verified}") for n in plan.notes)


def test_export_refuses_a_checkpoint_without_manifest_unless_unverified(tmp_path: Path) -> None:
    (folder,) = a_run(tmp_path / "run", 2)
    (folder / ckpt.MANIFEST).unlink()
    with pytest.raises(ExportError, match="manifest.json is missing") as info:
        export_checkpoint(folder, tmp_path / "out")
    assert str(folder) in str(info.value) and "--unverified" in str(info.value)
    with pytest.raises(ExportError, match="model folder '/nonexistent/model'"):  # past the check: the next one
        export_checkpoint(folder, tmp_path / "out", unverified=True)


def test_export_of_a_forged_rank_file_is_one_sentence(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    marker = tmp_path / "MARKER"
    (folder,) = a_run(tmp_path / "run", 2)
    rank_file = folder / "actor" / "engine_rank0.pt"
    forge(rank_file, marker)
    with pytest.raises(ExportError, match="could run code") as info:
        export_checkpoint(folder, tmp_path / "out")
    assert str(rank_file) in str(info.value)
    assert main(["export", str(folder), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(rank_file) in err and "Traceback" not in err
    assert not marker.exists()


def test_load_plain_refuses_a_forged_file_before_building_it(tmp_path: Path) -> None:
    marker = tmp_path / "MARKER"
    path = tmp_path / "engine_rank0.pt"
    torch.save({"rng": Forged(marker)}, path)
    with pytest.raises(UntrustedFileError) as info:
        load_plain(path)
    message = str(info.value)
    assert message.startswith(f"'{path}' holds more than tensors") and "\n" not in message
    assert not marker.exists()


def test_dcp_metadata_is_checked_without_running_it(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "MARKER"
    dcp.save({"model": {"w": torch.ones(2, 2)}}, checkpoint_id=str(tmp_path / "dcp"))
    assert metadata_problem(tmp_path / "dcp" / ".metadata") is None  # what DCP writes passes
    forged = tmp_path / "forged" / ".metadata"
    forged.parent.mkdir()
    forged.write_bytes(pickle.dumps(Forged(marker)))
    assert metadata_problem(forged) == ["posix.system"]
    assert [p for p, _ in unsafe_files(tmp_path / "forged")] == [forged]
    assert not marker.exists()


def test_an_old_driver_state_is_refused_unless_resume_unverified(tmp_path: Path) -> None:
    """Saved before the driver state was plain data: NumPy's RNG state as an array (the old ``rng_state``)."""
    out = tmp_path / "run"
    (folder,) = a_run(out, 2)
    old = {"step": 2, "loader": {"epoch": 0, "position": 0},
           "rng": {"python": ckpt.rng_state()["python"], "torch": torch.get_rng_state(),
                   "numpy": np.random.get_state()}}
    buffer = io.BytesIO()
    torch.save(old, buffer)
    (folder / ckpt.DRIVER_STATE).write_bytes(buffer.getvalue())
    ckpt.write_manifest(folder)
    why = ckpt.damage(folder)
    assert why is not None and "numpy" in why and "trainer.resume_unverified=true" in why
    assert ckpt.damage(folder, allow_unverified=True) is None
    state = ckpt.load_driver_state(folder, allow_old=True)
    ckpt.set_rng_state(state["rng"])
    assert plan_run_folder(out, "auto", resume_unverified=True).resume_from == folder
