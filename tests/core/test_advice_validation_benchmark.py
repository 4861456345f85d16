"""``benchmarks/advice_validation.py``'s measurement: a pipelined run's last step (a drain that only trains) is
left out of its mean, and an in-flight map is never taken for its synchronous profile run."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
advice_validation = pytest.importorskip("advice_validation")


def metrics(step_seconds: list[float], pipelined: bool) -> list[dict]:
    extra = {"timing/overlap_saved": 1.0} if pipelined else {}
    return [{"step": n, "timing/step": s, **extra} for n, s in enumerate(step_seconds, 1)]


@pytest.mark.parametrize("pipelined, steps", [(True, [2, 3]), (False, [2, 3, 4])])
def test_a_pipelined_runs_drain_step_is_not_steady(pipelined, steps):
    steady = advice_validation.steady_steps(metrics([9.0, 4.0, 4.2, 1.7], pipelined), skip=1)
    assert [r["step"] for r in steady] == steps


def test_one_steady_step_is_kept_even_when_it_is_the_last():
    steady = advice_validation.steady_steps(metrics([9.0, 4.0], pipelined=True), skip=1)
    assert [r["step"] for r in steady] == [2]


def _map(mode: str, pipelined: bool = False):
    cfg = types.SimpleNamespace(roles=types.SimpleNamespace(rollout=types.SimpleNamespace(tensor_parallel=1)),
                                trainer=types.SimpleNamespace(pipelined=pipelined, mode=mode))
    plan = types.SimpleNamespace(pools={"main": [0]}, role_pool={"actor": "main", "rollout": "main"})
    return cfg, plan


def test_an_in_flight_map_is_not_its_synchronous_twin():
    assert advice_validation.signature(*_map("sync")) != advice_validation.signature(*_map("async"))
    assert advice_validation.signature(*_map("sync")) == advice_validation.signature(*_map("sync"))


def _finished_arm(tmp_path: Path, monkeypatch, steps: int) -> tuple[Path, Path, list]:
    """A config and a run folder holding ``steps`` steps of it, left by a first ``run_arm`` (``train_run`` writes
    the metrics as a run would); the list collects each training ``run_arm`` starts."""
    config = tmp_path / "config.json"
    config.write_text('{"model": {"path": "m"}}')
    trained: list = []

    def train_run(cfg, overrides, timeout):
        trained.append(overrides)
        out = Path(next(o for o in overrides if o.startswith("trainer.out="))[len("trainer.out="):])
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.jsonl").write_text("\n".join(
            f'{{"step": {n}, "timing/step": 2.0, "busy/gen": {n / 10}, "device/main.0/busy": 0.5}}'
            for n in range(1, steps + 1)))
        return 0, "", 5.0

    monkeypatch.setattr(advice_validation, "train_run", train_run)
    folder = tmp_path / "profile"
    advice_validation.run_arm(config, ["a=1"], steps, 1, folder, 60.0)
    return config, folder, trained


def test_reuse_reads_a_finished_arm_instead_of_training_it_again(tmp_path, monkeypatch):
    config, folder, trained = _finished_arm(tmp_path, monkeypatch, steps=3)
    again = advice_validation.run_arm(config, ["a=1"], 3, 1, folder, 60.0, reuse=True)
    assert len(trained) == 1 and again["steady_steps"] == [2, 3] and "error" not in again
    # the phases' sampled busy shares of the steady steps travel with the arm (the one-GPU fit's next input)
    assert again["busy"] == {"busy/gen": pytest.approx(0.25), "device/main.0/busy": 0.5}


@pytest.mark.parametrize("change", ["overrides", "steps", "config"])
def test_reuse_trains_again_when_the_arm_differs(tmp_path, monkeypatch, change):
    config, folder, trained = _finished_arm(tmp_path, monkeypatch, steps=3)
    overrides, steps = (["a=2"] if change == "overrides" else ["a=1"]), (4 if change == "steps" else 3)
    if change == "config":
        config.write_text('{"model": {"path": "other"}}')
    advice_validation.run_arm(config, overrides, steps, 1, folder, 60.0, reuse=True)
    assert len(trained) == 2


def test_a_failed_runs_error_is_the_line_that_names_it_not_the_closing_hint():
    log = ("step 1 ...\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
           "  No checkpoint was saved (set trainer.save_every to save one every N steps).\n")
    assert advice_validation.error_line(log).startswith("torch.OutOfMemoryError")
    assert advice_validation.error_line("just a line\n") == "just a line"


def test_each_round_is_compared_with_its_own_control():
    """A map predicted 2x the profile's map, measured 2.4x in a slow round (control 1.2 s) and 2.0x in a fast
    one (control 0.9 s): the raw ratio mixes the drift in, ``vs_control`` compares within each round."""
    ranked = types.SimpleNamespace(
        candidate=types.SimpleNamespace(name="colocated 1x2", kind="colocated", overrides=("a=1",)),
        prediction=types.SimpleNamespace(step=2.0, phases={}), why="")
    arms = [{"mean_step_s": 2.88, "steady_seconds": [2.88], "step_seconds": [2.88], "steady_steps": [2],
             "phases_s": {}, "round": 0},
            {"mean_step_s": 1.8, "steady_seconds": [1.8], "step_seconds": [1.8], "steady_steps": [2],
             "phases_s": {}, "round": 1}]
    controls = {0: 1.2, 1: 0.9}  # the profile's map, predicted 1.0 s

    def control_of(arm):
        return controls[arm["round"]], 1.0

    args = types.SimpleNamespace(steps=3, skip=1)
    row = advice_validation.row_of(ranked, arms, "cpu", "quickstart", "cmd", args, control_of)
    assert row["ratio"] == pytest.approx((2.88 + 1.8) / 2 / 2.0)
    assert row["control_step_s"] == [1.2, 0.9]
    assert row["vs_control"] == pytest.approx(((2.88 / 1.2) / 2.0 + (1.8 / 0.9) / 2.0) / 2)  # 1.2 and 1.0
    assert "vs_control" not in advice_validation.row_of(ranked, arms, "cpu", "quickstart", "cmd", args)


def test_gpu_rows_of_another_profile_run_are_kept_beside_it_cpu_rows_are_replaced(tmp_path):
    """Two GPU machines of one kind differ by up to 1.5x: a new profile run's rows join the file instead of
    replacing the earlier machine's (each map stays beside its own profile); a CPU row is replaced as before."""
    import json

    out = tmp_path / "rows.json"
    gpu, cpu = "1x GPU", "cpu 2 cores"

    def write(device: str, started: str, measured: float) -> None:
        context = {"device": device, "workload": "w"}
        rows = [{"device": device, "map": "fractional 1x1", "workload": "w", "measured_step_s": measured}]
        advice_validation.write_rows(out, rows, {**context, "profile_started": started}, 0.0)

    write(gpu, "2026-01-01T00:00:00+00:00", 4.0)
    write(gpu, "2026-01-02T00:00:00+00:00", 5.0)
    write(gpu, "2026-01-02T00:00:00+00:00", 6.0)  # the same profile measured again: replaced
    write(cpu, "2026-01-01T00:00:00+00:00", 0.2)
    write(cpu, "2026-01-02T00:00:00+00:00", 0.3)
    data = json.loads(out.read_text())
    assert sorted((r["device"], r["measured_step_s"]) for r in data["rows"]) == [
        (gpu, 4.0), (gpu, 6.0), (cpu, 0.3)]
    assert sorted(r["device"] for r in data["runs"]) == sorted([gpu, gpu, cpu])


def test_a_profile_run_is_named_by_its_first_span(tmp_path):
    (tmp_path / "spans.jsonl").write_text('{"step": 1, "phase": "step", "start": 0.0, "end": 1.0}\n')
    assert advice_validation.profile_started(tmp_path) == "1970-01-01T00:00:00+00:00"
    assert advice_validation.profile_started(tmp_path / "missing") is None


def test_a_call_budget_starts_a_run_only_where_the_longest_so_far_still_ends_in_time():
    budget = advice_validation.CallBudget(300.0, margin=15.0)
    budget.start -= 100.0  # 100 s spent: about 200 left
    assert budget.room() and budget.timeout(600.0) == pytest.approx(185.0, abs=1.0)
    budget.spent({"wall_s": 150.0})
    assert budget.room()  # 185 s usable > the longest run's 150
    budget.spent({"wall_s": 0.0})  # a reused run, read and not trained, leaves the estimate alone
    assert budget.longest == 150.0
    budget.spent({"wall_s": 190.0})
    assert not budget.room()
    assert budget.timeout(60.0) == 60.0  # the run's own limit when it is the shorter


def test_no_budget_never_leaves_a_run_out():
    budget = advice_validation.CallBudget(None)
    budget.spent({"wall_s": 1e9})
    assert budget.room() and budget.timeout(600.0) == 600.0


def test_a_finished_arm_is_known_before_the_budget_is_asked(tmp_path, monkeypatch):
    config, folder, _ = _finished_arm(tmp_path, monkeypatch, steps=3)
    assert advice_validation.finished(config, ["a=1"], 3, folder)
    assert not advice_validation.finished(config, ["a=1"], 4, folder)
    assert not advice_validation.finished(config, ["a=2"], 3, folder)
