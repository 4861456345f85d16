"""Checkpoints on disk (no workers): atomic publication, a failed save leaves the previous one usable,
retention, what ``trainer.resume`` resolves to, metrics trimmed on resume; the bad-step guard."""

from __future__ import annotations

import errno
import json
import math
from pathlib import Path

import pytest
import torch

from hybridrl.run import checkpoint as ckpt
from hybridrl.run.faults import BadStepGuard, BadStepsError, bad_step_reasons


def fake_trainer_write(step: int):
    """What the driver writes: a role folder from the 'workers' and the driver state."""
    def write(tmp: Path) -> dict:
        (tmp / "actor").mkdir()
        (tmp / "actor" / "shard0").write_bytes(b"x" * 10)
        ckpt.save_driver_state(tmp, {"step": step, "rng": ckpt.rng_state()})
        return {"roles": {"actor": "fsdp"}}
    return write


def save(out: Path, step: int, keep: int = 0) -> Path:
    return ckpt.save_checkpoint(out, step, fake_trainer_write(step), keep)


def test_save_publishes_complete_checkpoints_and_latest(tmp_path: Path) -> None:
    first = save(tmp_path, 2)
    assert first == tmp_path / "checkpoints" / "step_000002" and ckpt.is_complete(first)
    assert json.loads((first / "driver.json").read_text())["step"] == 2
    save(tmp_path, 4)
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000004"
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_000004"
    assert ckpt.load_driver_state(ckpt.find_checkpoint(tmp_path, 2))["step"] == 2


@pytest.mark.parametrize("fail", [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()])
def test_a_save_that_fails_midway_leaves_the_previous_checkpoint(tmp_path: Path, fail: BaseException) -> None:
    save(tmp_path, 2)

    def half_written(tmp: Path) -> dict:
        (tmp / "actor").mkdir()
        (tmp / "actor" / "shard0").write_bytes(b"partial")
        raise fail

    # a full disk is said in words, with the folder and the checkpoint that is left; Ctrl-C goes through as is
    expected = (ckpt.CheckpointError, "in '.*checkpoints': no space left on device.*step_000002, is intact") \
        if isinstance(fail, OSError) else (KeyboardInterrupt, "")
    with pytest.raises(expected[0], match=expected[1]):
        ckpt.save_checkpoint(tmp_path, 4, half_written, keep=1)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002"]  # no temporary folder left
    assert ckpt.resolve_resume("auto", tmp_path) == root / "step_000002"
    assert ckpt.load_driver_state(root / "step_000002")["step"] == 2


def test_a_crashed_save_is_never_resumed_and_is_cleaned_by_the_next(tmp_path: Path) -> None:
    save(tmp_path, 2)
    crashed = tmp_path / "checkpoints" / ".tmp-step_000004"  # a process killed mid-save leaves this
    (crashed / "actor").mkdir(parents=True)
    ckpt.save_driver_state(crashed, {"step": 4})
    (crashed / "driver.json").write_text("{}")
    assert ckpt.resolve_resume("auto", tmp_path) == tmp_path / "checkpoints" / "step_000002"
    save(tmp_path, 3)
    assert not crashed.exists()


def test_retention_keeps_the_newest(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        save(tmp_path, step, keep=2)
    assert [s for s, _ in ckpt.complete_checkpoints(tmp_path)] == [3, 4]
    save(tmp_path, 4, keep=2)  # the same step saved again replaces it
    assert [s for s, _ in ckpt.complete_checkpoints(tmp_path)] == [3, 4]


def test_resume_resolution(tmp_path: Path) -> None:
    assert ckpt.resolve_resume("auto", tmp_path) is None  # a fresh run
    save(tmp_path, 2)
    step2 = tmp_path / "checkpoints" / "step_000002"
    assert ckpt.resolve_resume("never", tmp_path) is None
    assert ckpt.resolve_resume(str(step2), tmp_path / "elsewhere") == step2
    assert ckpt.resolve_resume(str(tmp_path), tmp_path / "elsewhere") == step2  # a run folder: its latest
    with pytest.raises(ckpt.CheckpointError, match="does not exist"):
        ckpt.resolve_resume(str(tmp_path / "nope"), tmp_path)
    with pytest.raises(ckpt.CheckpointError, match="neither a complete checkpoint"):
        ckpt.resolve_resume(str(step2 / "actor"), tmp_path)


def test_the_manifest_finds_a_truncated_changed_or_missing_file(tmp_path: Path) -> None:
    folder = save(tmp_path, 2)
    manifest = json.loads((folder / ckpt.MANIFEST).read_text())["files"]
    assert sorted(manifest) == ["actor/shard0", "driver.pt"] and manifest["actor/shard0"]["bytes"] == 10
    assert ckpt.damage(folder) is None
    shard = folder / "actor" / "shard0"
    shard.write_bytes(b"x" * 4)
    assert ckpt.damage(folder) == "actor/shard0 is 4 bytes, 10 when saved (truncated)"
    shard.write_bytes(b"y" * 10)  # same size, other bytes: only the checksum tells
    assert "actor/shard0 has other contents than when saved" in ckpt.damage(folder)
    assert ckpt.damage(folder, checksums=False) is None
    shard.unlink()
    assert ckpt.damage(folder) == "actor/shard0 is missing"
    (folder / ckpt.DRIVER_SUMMARY).write_text("{not json")
    assert ckpt.damage(folder).startswith("driver.json does not parse")


def test_resume_passes_over_damaged_checkpoints_to_the_newest_intact_one(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        save(tmp_path, step)
    (root / "step_000006" / "driver.pt").write_bytes(torch.randint(0, 255, (64,), dtype=torch.uint8).numpy().tobytes())
    with open(root / "step_000004" / "actor" / "shard0", "r+b") as f:
        f.truncate(3)
    skipped: list = []
    assert ckpt.resolve_resume("auto", tmp_path, skipped) == root / "step_000002"
    assert [(p.name, why.split(" ")[0]) for p, why in skipped] == [("step_000006", "driver.pt"),
                                                                  ("step_000004", "actor/shard0")]
    assert "truncated" in skipped[1][1]
    with pytest.raises(ckpt.CheckpointError, match="step_000006' is damaged: driver.pt"):
        ckpt.resolve_resume(str(root / "step_000006"), tmp_path)
    assert ckpt.resolve_resume(str(tmp_path), tmp_path / "elsewhere") == root / "step_000002"  # a run folder too
    (root / "step_000002" / "actor" / "shard0").unlink()
    with pytest.raises(ckpt.CheckpointError, match="every checkpoint under .* is damaged: step_000006: .*step_000002"):
        ckpt.resolve_resume("auto", tmp_path)


def test_a_fallback_never_jumps_to_a_later_abandoned_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        save(tmp_path, step)
    (root / "latest").write_text("step_000004")  # the run went back to step 4 (trainer.resume=<step_4>)
    (root / "step_000004" / "actor" / "shard0").unlink()
    found, passed = ckpt.newest_intact(tmp_path)
    assert found == root / "step_000002" and [p.name for p, _ in passed] == ["step_000004"]


def test_a_checkpoint_without_manifest_is_trusted_only_when_asked(tmp_path: Path) -> None:
    folder = save(tmp_path, 2)
    (folder / ckpt.MANIFEST).unlink()
    assert ckpt.damage(folder) == ckpt.UNVERIFIED  # its files cannot be verified: not trusted by default
    assert ckpt.damage(folder, allow_unverified=True) is None  # trainer.resume_unverified: checked by loading
    (folder / "driver.pt").write_bytes(b"\x80\x02random bytes" * 8)
    why = ckpt.damage(folder, allow_unverified=True)
    assert str(folder / "driver.pt") in why and "refused" in why  # not a torch file: never unpickled


def test_rng_and_metrics_rows_after_the_checkpoint(tmp_path: Path) -> None:
    state = ckpt.rng_state()
    expected = torch.rand(3)
    ckpt.set_rng_state(state)
    assert torch.equal(torch.rand(3), expected)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)) + '{"st')
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps({"step": s, "prompt": "p"}) + "\n" for s in (1, 3)))
    assert ckpt.trim_metrics(tmp_path, 2) == 2
    assert [json.loads(line)["step"] for line in (tmp_path / "samples.jsonl").read_text().splitlines()] == [1]
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_bad_steps_are_marked_and_stop_the_run_in_a_row() -> None:
    guard = BadStepGuard(max_bad=2)
    good = {"reward/mean": 0.5, "actor/loss": 0.1, "actor/skipped_step": 0.0}
    bad = {"reward/mean": math.nan, "actor/loss": math.nan, "actor/skipped_step": 1.0}
    assert bad_step_reasons(good) == []
    assert "actor skipped its update (non-finite gradient norm)" in bad_step_reasons(bad)
    for metrics in (dict(bad), dict(good), dict(bad)):  # a good step in between resets the count
        guard.check(1, guard.observe(metrics))
    assert metrics["trainer/bad_step"] == 1.0 and metrics["trainer/bad_steps_in_row"] == 1.0
    with pytest.raises(BadStepsError, match="2 bad steps in a row"):
        guard.check(4, guard.observe(dict(bad)))
    BadStepGuard(max_bad=0).check(9, ["x"])  # 0: never stops


def test_the_checkpointer_decides_when_a_save_is_due(tmp_path, monkeypatch):
    from hybridrl.run.state import Checkpointer

    saved = []
    monkeypatch.setattr(ckpt, "save_checkpoint", lambda out, step, write, keep: saved.append(step) or Path(out))
    every = Checkpointer(tmp_path, 2, {}, every=3, last=7)
    done = [step for step in range(1, 8) if every.maybe_save(step, driver=None, groups={}) is not None]
    assert done == saved == [3, 6, 7]  # every 3 steps and the last one
    never = Checkpointer(tmp_path, 2, {}, last=7)  # trainer.save_every=0
    assert [never.maybe_save(step, None, {}) for step in range(1, 8)] == [None] * 7 and saved == [3, 6, 7]
