"""``hybridrl report``: PNGs and a summary whose numbers equal those computed here from metrics.jsonl; and one
real run through the CLI with TensorBoard on, read back by TensorBoard's own reader, then reported."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from hybridrl.cli import main
from hybridrl.observe.report import EPISODES_PLOT, PLOTS, device_time, write_report

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"
PHASES = ("data", "gen", "reward", "ref", "old_log_prob", "adv", "update_actor", "reshard")
CONFIG = {"pools": {"train": {"nodes": 1, "devices_per_node": 2}, "gen": {"nodes": 1, "devices_per_node": 2}},
          "roles": {"actor": {"pool": "train", "backend": "fsdp"}, "ref": {"pool": "train", "backend": "fsdp"},
                    "critic": None, "rollout": {"pool": "gen", "backend": "hf"},
                    "reward": {"pool": None, "fn": "reverse"}}}


def make_rows(n: int = 14) -> list[dict]:
    rows = []
    for s in range(1, n + 1):
        t = {"data": 0.01, "gen": 1.0 + 0.1 * (s % 3), "reward": 0.02, "ref": 0.3, "old_log_prob": 0.3 + 0.01 * s,
             "adv": 0.01, "update_actor": 0.9 + 0.05 * (s % 4), "reshard": 0.1}
        row = {"step": s, "reward/mean": 0.05 * s + 0.01 * (s % 2), "reward/min": 0.0, "reward/max": 1.0,
               "response_length/mean": 3.0 - 0.01 * s, "response_length/max": 4}
        row.update({f"timing/{k}": v for k, v in t.items()})
        row["timing/step"] = sum(t.values()) + 0.05  # a little the phases do not cover
        row.update({f"compute/{k}": 0.9 * t[k] for k in ("gen", "ref", "old_log_prob", "update_actor")})
        row["memory/actor/peak_mb"] = 100.0 + s
        rows.append(row)
    return rows


@pytest.fixture
def run(tmp_path) -> tuple[Path, list[dict]]:
    rows = make_rows()
    lines = [json.dumps(r) for r in rows]
    stale = dict(rows[4], **{"reward/mean": 99.0})  # step 5 logged before a resume; the later row wins
    lines.insert(4, json.dumps(stale))
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    return tmp_path, rows


def test_episodes_are_plotted_for_multi_turn_runs_only(run):
    folder, rows = run
    assert not (folder / "report" / EPISODES_PLOT).exists() and EPISODES_PLOT not in map(str, write_report(folder))
    assert not (folder / "report" / EPISODES_PLOT).exists()
    for r in rows:
        r.update({"env/turns_mean": 1.0 + r["step"] / 14, "env/tool_use_rate": r["step"] / 14,
                  "env/truncated_rate": 0.1, "env/tool_errors_mean": 0.0})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    written = write_report(folder)
    data = (folder / "report" / EPISODES_PLOT).read_bytes()
    assert folder / "report" / EPISODES_PLOT in written and data[:8] == PNG and len(data) > 1000
    assert f"({EPISODES_PLOT})" in (folder / "report" / "summary.md").read_text()


def test_report_writes_pngs_and_a_summary_with_the_runs_numbers(run):
    folder, rows = run
    written = write_report(folder)
    out = folder / "report"
    for name in PLOTS.values():
        data = (out / name).read_bytes()
        assert data[:8] == PNG and len(data) > 1000
    assert {p.name for p in written} >= {*PLOTS.values(), "summary.md", "summary.json"}

    reward = [r["reward/mean"] for r in rows]
    steps = [r["timing/step"] for r in rows]
    total = sum(steps)
    first, last = sum(reward[:10]) / 10, sum(reward[-10:]) / 10
    median = statistics.median(steps)
    compute = sum(r[k] for r in rows for k in r if k.startswith("compute/"))
    overhead = 1 - compute / total
    share = {p: sum(r[f"timing/{p}"] for r in rows) / total for p in PHASES}
    busy_train = sum(r[f"timing/{p}"] for r in rows for p in ("ref", "old_log_prob", "update_actor", "reshard"))
    busy_gen = sum(r[f"timing/{p}"] for r in rows for p in ("gen", "reshard"))

    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 14 and summary["last_step"] == 14
    assert summary["reward_first"] == pytest.approx(first)
    assert summary["reward_last"] == pytest.approx(last)
    assert summary["median_step_s"] == pytest.approx(median)
    assert summary["overhead_share"] == pytest.approx(overhead)
    assert summary["phase_share"] == pytest.approx(share)
    assert summary["busy_share"] == pytest.approx({"train": busy_train / total, "gen": busy_gen / total})
    assert summary["peak_memory_mb"] == {"actor": 114.0}

    md = (out / "summary.md").read_text()
    for text in ("| steps | 14 (last step 14) |", f"| reward, first 10 steps | {first:.4f} |",
                 f"| reward, last 10 steps | {last:.4f} |", f"| median step time | {median:.3f} s |",
                 f"| {100 * overhead:.1f} % |", f"| update_actor | {100 * share['update_actor']:.1f} % |",
                 f"| train | 2 | {100 * busy_train / total:.1f} % |", f"| gen | 2 | {100 * busy_gen / total:.1f} % |"):
        assert text in md, text
    for name in PLOTS.values():
        assert f"]({name})" in md


def test_device_time_adds_up_to_the_wall_time(run):
    folder, rows = run
    spent = device_time(CONFIG, rows)
    wall = sum(r["timing/step"] for r in rows)
    for pool in ("train", "gen"):
        assert sum(spent[pool].values()) == pytest.approx(wall)
    assert set(spent["train"]) == {"ref", "old_log_prob", "update_actor", "reshard", "idle"}
    assert set(spent["driver"]) == {"data", "reward", "adv", "untimed"}  # a rule reward uses no device
    assert spent["driver"]["untimed"] == pytest.approx(0.05 * len(rows))


def test_report_cli(run, tmp_path, capsys):
    folder, _ = run
    assert main(["report", str(folder), "--out", str(tmp_path / "elsewhere")]) == 0
    assert str(tmp_path / "elsewhere" / "summary.md") in capsys.readouterr().out
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["report", str(empty)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_train_with_tensorboard_then_report(tmp_path):
    """The quick start for 3 steps through the CLI; TensorBoard's reader gets back what metrics.jsonl holds."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "hybridrl.cli", "train", str(ROOT / "examples" / "quickstart.yaml"),
                           "trainer.steps=3", "trainer.trackers=[console,jsonl,tensorboard]", f"trainer.out={out}",
                           "data.prompts_per_step=4", "algorithm.n_samples=4", "trainer.progress=false"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    for key in ("reward/mean", "timing/step", "timing/update_actor", "perf/tflops_per_device/update_actor",
                "memory/actor/peak_mb"):
        assert [(e.step, e.value) for e in acc.Scalars(key)] == [(r["step"], pytest.approx(r[key], rel=1e-6))
                                                                 for r in rows], key
    assert all(r["perf/tflops_per_device/update_actor"] > 0 and "perf/mfu" not in r for r in rows)  # CPU: no peak

    proc = subprocess.run([sys.executable, "-m", "hybridrl.cli", "report", str(out)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "report" / "summary.json").read_text())
    assert summary["steps"] == 3
    assert summary["reward_last"] == pytest.approx(sum(r["reward/mean"] for r in rows) / 3)
    assert summary["median_step_s"] == pytest.approx(statistics.median(r["timing/step"] for r in rows))
    assert math.isclose(sum(device_time(json.loads((out / "config.json").read_text()), rows)["main"].values()),
                        sum(r["timing/step"] for r in rows))
    for name in PLOTS.values():
        assert (out / "report" / name).read_bytes()[:8] == PNG
