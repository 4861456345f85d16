"""``benchmarks/fit_one_gpu_maps.py``: the advisor's one-GPU factors (fractional, in flight) are fitted from
measured rows, and the constants the advisor predicts with are the ones the committed fit holds."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
fit = pytest.importorskip("fit_one_gpu_maps")


def rows_of(a: float, b: float, k: float) -> list[dict]:
    """Advice-validation rows of three workloads whose fractional and in-flight steps follow ``a, b`` and ``k``."""
    rows = []
    for n, (gen, train) in enumerate([(2.0, 1.6), (11.4, 5.3), (2.4, 4.2)]):
        workload, device = f"w{n}", "1x GPU"
        sync_pred = {"gen": gen, "ref": 0.3 * train, "update_actor": 0.7 * train, "reshard": 0.05, "fixed": 0.04}
        rest = sync_pred["reshard"] + sync_pred["fixed"]
        rows += [
            {"device": device, "workload": workload, "map": "colocated", "kind": "colocated", "profile_run": True,
             "measured_step_s": gen + train + rest, "predicted_step_s": gen + train + rest,
             "measured_phases_s": sync_pred, "predicted_phases_s": sync_pred},
            {"device": device, "workload": workload, "map": "fractional", "kind": "fractional",
             "measured_step_s": max(gen, train, a * gen + b * train) + rest,
             "predicted_phases_s": {"gen": gen, "reshard": 0.05, "fixed": 0.04}},
            {"device": device, "workload": workload, "map": "in-flight", "kind": "in_flight",
             "measured_step_s": k * gen + train + rest, "predicted_phases_s": sync_pred},
            {"device": "cpu 2 cores", "workload": workload, "map": "fractional", "kind": "fractional",
             "measured_step_s": 99.0, "predicted_phases_s": {"gen": gen}},  # CPU rows are not GPU time-slicing
        ]
    return rows


def test_the_fit_recovers_the_factors_that_made_the_steps():
    rows = rows_of(0.5, 2.0, 1.3)
    (a, b), fractional = fit.evaluate(fit.points(rows, "fractional"), fit.fit_time_sliced, fit.time_sliced)
    k, flight = fit.evaluate(fit.points(rows, "in_flight"), fit.fit_in_flight, fit.in_flight)
    assert (a, b, k) == pytest.approx((0.5, 2.0, 1.3), abs=1e-6)
    assert len(fractional) == len(flight) == 3  # the CPU row is left out
    assert fit.band(fractional) == 0.0 and fit.band(flight) == 0.0


def test_rows_carry_the_busy_shares_the_runs_logged():
    """Where the runs logged each phase's NVML busy share, the fitted rows keep the synchronous step's and the
    map's side by side; rows without them carry none."""
    rows = rows_of(0.5, 2.0, 1.3)
    rows[0]["measured_busy"] = {"busy/gen": 0.41, "busy/update_actor": 0.93, "device/default.0/busy": 0.6}
    rows[1]["measured_busy"] = {"busy/gen": 0.55, "busy/update_actor": 0.48}
    _, fitted = fit.evaluate(fit.points(rows, "fractional"), fit.fit_time_sliced, fit.time_sliced)
    assert fitted[0]["busy"] == {"sync": {"gen": 0.41, "update_actor": 0.93},
                                 "map": {"gen": 0.55, "update_actor": 0.48}}
    assert "busy" not in fitted[1]


def test_one_map_cannot_fit_two_time_sliced_factors():
    rows = rows_of(0.5, 2.0, 1.3)
    with pytest.raises(ValueError, match="two measured maps"):
        fit.fit_time_sliced(fit.points(rows, "fractional")[:1])


def test_the_advisor_predicts_with_the_committed_fit():
    from hybridrl.placement.advice import predict

    result = json.loads((ROOT / "benchmarks" / "results" / "one_gpu_maps_fit.json").read_text())
    assert (predict.TIME_SLICED_GEN, predict.TIME_SLICED_TRAIN, predict.TIME_SLICED_ERROR) == (
        result["time_sliced"]["gen"], result["time_sliced"]["train"], result["time_sliced"]["error"])
    assert (predict.IN_FLIGHT_GEN, predict.IN_FLIGHT_ERROR) == (result["in_flight"]["gen"],
                                                                result["in_flight"]["error"])


def test_a_map_is_paired_with_the_profile_run_it_was_measured_against():
    """Rows of two machines of one kind: each fractional row is fitted against its own machine's synchronous
    step (``profile_started``), not the other's."""
    rows = rows_of(0.5, 2.0, 1.3)[:2]
    other = [{**r, "profile_started": "later"} for r in rows]
    other[0] = {**other[0], "measured_phases_s": {k: 2 * v for k, v in other[0]["measured_phases_s"].items()}}
    pts = fit.points(rows + other, "fractional")
    assert [p.gen for p in pts] == [rows[0]["measured_phases_s"]["gen"], other[0]["measured_phases_s"]["gen"]]
