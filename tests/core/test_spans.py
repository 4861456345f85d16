"""Phase spans: each phase of a step tied to the devices of its roles' pools, written to spans.jsonl, turned
into busy fractions per device, and drawn by ``hybridrl report`` as a timeline (or refused in one sentence)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from _span_helpers import split_plan, timer_with

from hybridrl.cli import main
from hybridrl.observe.report import write_report
from hybridrl.observe.spans import (
    DRIVER,
    SPANS_FILE,
    STEP,
    Span,
    SpanLog,
    busy_fractions,
    busy_metrics,
    load_spans,
    merged_seconds,
    rank_ranges,
)
from hybridrl.observe.timeline import TIMELINE_PLOT, RunSpans
from hybridrl.observe.timing import PhaseTimer

PNG = b"\x89PNG\r\n\x1a\n"


STEP_PHASES = [("data", 0.0, 0.5), ("gen", 0.5, 4.5), ("reward", 4.5, 5.0), ("ref", 5.0, 6.0),
               ("update_actor", 6.0, 9.0), ("reshard", 9.0, 10.0)]


def test_the_timer_notes_each_phase_as_a_span_in_wall_clock_time():
    timer = PhaseTimer()
    with timer.phase("gen"):
        pass
    with timer.phase("ref"):
        pass
    timer.record("gen", 2.0)  # timed elsewhere: placed to end when recorded
    assert [name for name, _, _ in timer.spans] == ["gen", "ref", "gen"]
    (_, s0, e0), (_, s1, e1), (_, s2, e2) = timer.spans
    assert timer.started <= s0 <= e0 <= s1 <= e1
    assert e2 - s2 == pytest.approx(2.0)
    assert timer.seconds["gen"] == pytest.approx((e0 - s0) + 2.0)


def test_spans_name_the_roles_pools_ranks_and_tokens(tmp_path):
    log = SpanLog.for_plan(split_plan(), tmp_path, epochs=2)
    spans = log.spans(3, timer_with(STEP_PHASES), 10.0, response_tokens=40, all_tokens=100)
    by = {(s.phase, s.role): s for s in spans}
    assert by[(STEP, DRIVER)].end - by[(STEP, DRIVER)].start == pytest.approx(10.0)
    assert by[("gen", "rollout")].pool == "gen" and by[("gen", "rollout")].ranks == (0, 1)
    assert by[("gen", "rollout")].tokens == 40
    assert by[("ref", "ref")].pool == "train" and by[("ref", "ref")].tokens == 100
    assert by[("update_actor", "actor")].tokens == 200  # two epochs over the batch
    assert {by[("reshard", "actor")].pool, by[("reshard", "rollout")].pool} == {"train", "gen"}
    assert by[("reward", DRIVER)].pool is None and by[("reward", DRIVER)].ranks == ()  # a rule reward: the driver
    assert by[("data", DRIVER)].tokens is None
    assert all(s.step == 3 for s in spans)


def test_busy_fraction_is_the_union_of_a_devices_spans_over_the_step():
    log = SpanLog.for_plan(split_plan(), None)
    metrics = log.record_step(1, timer_with(STEP_PHASES), 10.0, 40, 100)
    # train: ref 1 s + update 3 s + reshard 1 s; gen: gen 4 s + reshard 1 s
    assert metrics == {"device/train.0/busy": pytest.approx(0.5), "device/train.1/busy": pytest.approx(0.5),
                       "device/gen.0/busy": pytest.approx(0.5), "device/gen.1/busy": pytest.approx(0.5)}
    assert merged_seconds([(0, 2), (1, 3), (5, 6)], 0, 10) == pytest.approx(4.0)  # overlaps once
    assert merged_seconds([(-5, 2), (8, 20)], 0, 10) == pytest.approx(4.0)  # clipped to the step
    colocated = [Span(1, "gen", "rollout", "main", (0,), 0.0, 6.0), Span(1, "reshard", "actor", "main", (0,), 5.0, 7.0)]
    assert busy_fractions(colocated, {"main": 2}, 0.0, 10.0) == {("main", 0): pytest.approx(0.7), ("main", 1): 0.0}


def test_many_devices_share_a_metric_per_run_of_equal_ranks():
    busy = {("train", r): 0.5 for r in range(64)} | {("gen", r): 0.25 if r < 32 else 0.75 for r in range(64)}
    metrics = busy_metrics(busy)
    assert metrics == {"device/train.0-63/busy": 0.5, "device/gen.0-31/busy": 0.25, "device/gen.32-63/busy": 0.75}
    few = busy_metrics({("main", r): 0.5 for r in range(4)})
    assert sorted(few) == [f"device/main.{r}/busy" for r in range(4)]


def test_spans_file_is_private_and_a_rerun_step_keeps_its_last_recording(tmp_path):
    log = SpanLog.for_plan(split_plan(), tmp_path)
    for step in (1, 2, 3):
        log.record_step(step, timer_with(STEP_PHASES, 1000.0 + 20 * step), 10.0, 40, 100)
    log.record_step(3, timer_with(STEP_PHASES[:2], 5000.0), 5.0, 40, 100)  # step 3 again, after a resume
    path = tmp_path / SPANS_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    steps = load_spans(path)
    assert sorted(steps) == [1, 2, 3]
    assert [s.phase for s in steps[3]] == [STEP, "data", "gen"] and steps[3][0].start == 5000.0
    line = json.loads(path.read_text().splitlines()[1])
    assert line["ranks"] == [] and rank_ranges([0, 1, 2, 5]) == [[0, 2], [5, 5]]
    assert Span.from_json(Span(1, "gen", "rollout", "gen", (0, 1, 2, 5), 1.0, 2.0, 7).to_json()).ranks == (0, 1, 2, 5)


# --- the report ---------------------------------------------------------------------------------------

def write_run(folder: Path, steps: int = 4, spans: bool = True) -> None:
    timing = {f"timing/{n}": b - a for n, a, b in STEP_PHASES}
    rows = [{"step": s, "reward/mean": 0.1 * s, "response_length/mean": 3.0, "timing/step": 10.0, **timing}
            for s in range(1, steps + 1)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "config.json").write_text(json.dumps({"pools": {"train": {"devices_per_node": 2},
                                                              "gen": {"devices_per_node": 2}}}))
    if spans:
        log = SpanLog.for_plan(split_plan(), folder)
        for s in range(1, steps + 1):
            phases = STEP_PHASES if s != 2 else [(n, a, b if n != "gen" else 1.5) for n, a, b in STEP_PHASES]
            log.record_step(s, timer_with(phases, 1000.0 + 20 * s), 10.0, 40, 100)


def test_report_draws_the_timeline_of_the_asked_step_with_busy_per_device(tmp_path):
    write_run(tmp_path)
    written = write_report(tmp_path, step=2)
    plot = tmp_path / "report" / TIMELINE_PLOT
    assert plot in written and plot.read_bytes().startswith(PNG)
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())["timeline"]
    assert summary["step"] == 2 and summary["step_s"] == pytest.approx(10.0)
    gen = summary["devices"]["gen.0"]
    assert gen["busy_step"] == pytest.approx(0.2)  # step 2's generation took 1 s, plus the reshard
    assert gen["busy_mean"] == pytest.approx((0.5 * 3 + 0.2) / 4) and gen["busy_min"] == pytest.approx(0.2)
    assert summary["devices"]["train.1"]["busy_step"] == pytest.approx(0.5)
    assert "## Device timeline (step 2" in (tmp_path / "report" / "summary.md").read_text()
    write_report(tmp_path)  # default: the last step
    assert json.loads((tmp_path / "report" / "summary.json").read_text())["timeline"]["step"] == 4


def test_the_timeline_shows_the_busy_fractions_the_run_sampled(tmp_path):
    """A step whose devices were sampled (NVML) shows the logged fraction, not the spans' (a colocated device
    runs some phase all step, so its spans say 1.0 while its GPU idled half of it); other steps keep the spans'."""
    write_run(tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rows[1] |= {"device/gen.0/busy": 0.9, "device/gen.1/busy": 0.8, "device/busy_sampled": 1.0}
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_report(tmp_path, step=2)
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())["timeline"]
    assert summary["busy_source"] == "sampled"
    assert summary["devices"]["gen.0"]["busy_step"] == pytest.approx(0.9)
    assert summary["devices"]["gen.1"]["busy_step"] == pytest.approx(0.8)
    assert summary["devices"]["gen.0"]["busy_mean"] == pytest.approx((0.5 * 3 + 0.9) / 4)
    assert summary["devices"]["train.1"]["busy_step"] == pytest.approx(0.5)  # not sampled: the spans'


def test_report_rows_join_devices_that_did_the_same_past_the_metric_limit(tmp_path):
    spans = RunSpans({1: [Span(1, STEP, DRIVER, None, (), 0.0, 10.0),
                          Span(1, "gen", "rollout", "gen", tuple(range(32)), 0.0, 5.0)]}, {"gen": 32})
    from hybridrl.observe.timeline import timeline_rows

    assert [label for label, _ in timeline_rows(spans, 1)] == ["gen.0-31"]


def test_report_asked_for_a_step_the_run_lacks_says_so_in_one_sentence(tmp_path, capsys):
    write_run(tmp_path)
    assert main(["report", str(tmp_path), "--step", "99"]) == 2
    err = capsys.readouterr().err
    assert "step 99 is not in" in err and "steps 1-4" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "report").exists()  # refused before anything is written


def test_report_of_a_run_without_spans(tmp_path, capsys):
    write_run(tmp_path, spans=False)
    assert main(["report", str(tmp_path), "--step", "2"]) == 2  # a timeline asked of an older run: refused
    err = capsys.readouterr().err
    assert f"no {SPANS_FILE}" in err and "train or resume it" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert main(["report", str(tmp_path)]) == 0  # the rest of the report is still made, with a note
    out, err = capsys.readouterr()
    assert "summary.md" in out and TIMELINE_PLOT not in out
    assert err.startswith("note: no device timeline:") and "Traceback" not in err


def test_a_real_run_records_spans_and_busy_metrics_that_the_report_reads(tmp_path):
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "hybridrl.cli", "train", str(root / "examples" / "quickstart.yaml"),
                           "trainer.steps=2", "trainer.trackers=[jsonl]", f"trainer.out={out}",
                           "data.prompts_per_step=4", "algorithm.n_samples=4", "trainer.progress=false"],
                          capture_output=True, text=True, cwd=root, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = load_spans(out / SPANS_FILE)
    assert sorted(steps) == [1, 2]
    by_phase = {s.phase: s for s in steps[2]}
    assert {"step", "gen", "update_actor", "reshard"} <= set(by_phase)
    assert by_phase["gen"].role == "rollout" and by_phase["gen"].pool == "main" and by_phase["gen"].ranks == (0,)
    assert by_phase["gen"].tokens and by_phase["gen"].tokens > 0
    frame = by_phase["step"]
    assert all(frame.start <= s.start <= s.end <= frame.end + 1e-3 for s in steps[2])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    busy = [r["device/main.0/busy"] for r in rows]
    assert all(0.0 < b <= 1.0 for b in busy)
    written = write_report(out)
    assert out / "report" / TIMELINE_PLOT in written
    timeline = json.loads((out / "report" / "summary.json").read_text())["timeline"]
    assert timeline["step"] == 2 and timeline["devices"]["main.0"]["busy_step"] == pytest.approx(busy[1], abs=1e-4)
