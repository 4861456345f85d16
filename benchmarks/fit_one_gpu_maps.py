"""The advisor's one-GPU factors fitted from measured steps (``benchmarks/results/advice_validation.json``).

Two maps on one GPU are not the sum of the profile's phases, and their cost is measured, not derived:

* fractional (rollout and trainers resident on the same GPU, pipelined): the two processes time-slice the GPU.
  The step is fitted as ``a x gen + b x train`` (each the synchronous step's phase, the rollout's without wake
  and sleep), never less than the longer of the two: the trainer slows while the engine decodes beside it (b),
  and only part of the generation stays in the step (a).
* in flight (``trainer.mode=async``): the synchronous step with its generation ``k`` times as long.

Both maps are asynchronous, so their rollout returns the sampled tokens' log-probs (importance sampling) and the
synchronous profile's does not. The in-flight generation is first charged the rollout backend's ``log_prob_cost``,
as the advisor charges it (``predict.log_prob_factor``; ``--log-prob-cost``, by default what the vLLM backend the
GPU rows ran declares), and ``k`` fits what remains. The fractional fit reads the generation as the profile
measured it: charged, the fit missed further (32% against 25% out of sample over the eight measured pairs, the
long tail and the H200's host-bound generation worst), the extra work hiding beside the trainer.

For each profile run (device, workload and ``profile_started``) with a synchronous colocated row (the profile run,
whose measured phases the prediction was fitted from), the fractional and in-flight rows give one equation each. The
factors minimise the relative error; each row's error is also given out of sample (fitted without that row):
``*_ERROR`` in ``hybridrl.placement.advice.predict`` is the largest such error, the band in which the advisor says
"measure both". Each row also carries the GPU's busy share of each phase (NVML, ``busy/<phase>``) of the synchronous
step and of the map's, where the runs logged them (``busy``): what a model of how the two overlap would be fitted
from. Prints the table and writes ``--out`` (``benchmarks/results/one_gpu_maps_fit.json``).

    python benchmarks/fit_one_gpu_maps.py
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from advice_validation import profile_key  # the rows' own file: benchmarks/ is no package

from hybridrl.placement.advice.predict import TRAIN_PHASES
from hybridrl.placement.advice.predict import time_sliced as sliced_seconds

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Point:
    """One measured map beside its synchronous twin: ``gen`` and ``train`` seconds of the synchronous step,
    ``rest`` what the prediction adds besides them (the map's reshard and fixed work, or for in flight the whole
    synchronous prediction less its gen), ``measured`` the map's step."""

    device: str
    workload: str
    map: str
    gen: float
    train: float
    rest: float
    measured: float
    busy: dict[str, dict[str, float]] = field(default_factory=dict)  # "sync" / "map" -> phase -> NVML busy share


def points(rows: list[dict[str, Any]], kind: str, log_prob_cost: float = 1.0) -> list[Point]:
    """The rows of ``kind`` ("fractional" or "in_flight") measured on a GPU beside a synchronous colocated row of
    the same device and workload, their generation charged ``log_prob_cost`` (see the docstring)."""
    out = []
    for r in rows:
        if r.get("kind") != kind or r.get("error") or not r.get("measured_step_s") or "cpu" in r["device"]:
            continue
        sync = next((s for s in rows if s.get("kind") == "colocated" and s.get("profile_run") and not s.get("error")
                     and profile_key(s) == profile_key(r)), None)
        if sync is None:
            continue
        phases = sync["measured_phases_s"]
        gen, train = phases.get("gen", 0.0), sum(phases.get(p, 0.0) for p in TRAIN_PHASES)
        pred = r["predicted_phases_s"]
        if kind == "fractional":
            rest = pred.get("reshard", 0.0) + pred.get("fixed", 0.0)
        else:
            rest = sync["predicted_step_s"] - sync["predicted_phases_s"]["gen"]
            gen = sync["predicted_phases_s"]["gen"]
        busy = {side: shares for side, row in (("sync", sync), ("map", r)) if (shares := phase_busy(row))}
        out.append(Point(r["device"], r["workload"], r["map"], gen * log_prob_cost, train, rest,
                         r["measured_step_s"], busy))
    return out


def phase_busy(row: dict[str, Any]) -> dict[str, float]:
    """The row's ``busy/<phase>`` shares (``advice_validation.py``'s ``measured_busy``), by phase."""
    return {k.removeprefix("busy/"): v for k, v in (row.get("measured_busy") or {}).items() if k.startswith("busy/")}


#: the rollout backend the GPU rows ran (``advice_validation.py``'s workloads)
GPU_ROLLOUT = "vllm"


def declared_log_prob_cost(backend: str) -> float:
    """The ``log_prob_cost`` the rollout backend registers (1: none declared)."""
    from hybridrl.plugins.discovery import get_registry

    return get_registry(()).backend("rollout", backend).log_prob_cost or 1.0


# --- the models -------------------------------------------------------------------------------------------------
def time_sliced(p: Point, a: float, b: float) -> float:
    """The advisor's fractional step (``predict.time_sliced``) with the factors ``a, b``."""
    return sliced_seconds(p.gen, p.train, a, b) + p.rest


def in_flight(p: Point, k: float) -> float:
    return k * p.gen + p.rest


def fit_time_sliced(pts: list[Point]) -> tuple[float, float]:
    """``a, b`` minimising the relative squared error of ``a x gen + b x train`` against ``measured - rest``."""
    w = [1.0 / p.measured**2 for p in pts]
    y = [p.measured - p.rest for p in pts]
    sgg = sum(wi * p.gen * p.gen for wi, p in zip(w, pts))
    stt = sum(wi * p.train * p.train for wi, p in zip(w, pts))
    sgt = sum(wi * p.gen * p.train for wi, p in zip(w, pts))
    sgy = sum(wi * p.gen * yi for wi, p, yi in zip(w, pts, y))
    sty = sum(wi * p.train * yi for wi, p, yi in zip(w, pts, y))
    det = sgg * stt - sgt * sgt
    if len(pts) < 2 or abs(det) < 1e-12:
        raise ValueError(f"the time-sliced fit needs two measured maps of different gen:train shares ({len(pts)})")
    return (sgy * stt - sty * sgt) / det, (sty * sgg - sgy * sgt) / det


def fit_in_flight(pts: list[Point]) -> float:
    """``k`` minimising the relative squared error of ``k x gen + rest`` against ``measured``."""
    if not pts:
        raise ValueError("the in-flight fit needs a measured in-flight map")
    w = [1.0 / p.measured**2 for p in pts]
    numerator = sum(wi * p.gen * (p.measured - p.rest) for wi, p in zip(w, pts))
    return numerator / sum(wi * p.gen**2 for wi, p in zip(w, pts))


def evaluate(pts: list[Point], fit, model) -> tuple[Any, list[dict[str, Any]]]:
    """The fit over every point, and each point predicted in sample and out of sample (fitted without it)."""
    coef = fit(pts)
    args = coef if isinstance(coef, tuple) else (coef,)
    out = []
    for i, p in enumerate(pts):
        others = pts[:i] + pts[i + 1:]
        try:
            loo = fit(others)
            loo_pred: float | None = model(p, *(loo if isinstance(loo, tuple) else (loo,)))
        except ValueError:
            loo_pred = None
        pred = model(p, *args)
        out.append({"device": p.device, "workload": p.workload, "map": p.map, "measured_step_s": p.measured,
                    "predicted_step_s": round(pred, 4), "error": round(pred / p.measured - 1, 4),
                    "predicted_out_of_sample_s": None if loo_pred is None else round(loo_pred, 4),
                    "error_out_of_sample": None if loo_pred is None else round(loo_pred / p.measured - 1, 4),
                    **({"busy": p.busy} if p.busy else {})})
    return coef, out


def band(rows: list[dict[str, Any]]) -> float | None:
    """The largest out-of-sample error, rounded up to 5%."""
    errors = [abs(r["error_out_of_sample"]) for r in rows if r["error_out_of_sample"] is not None]
    return math.ceil(max(errors) * 20 - 1e-9) / 20 if errors else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=str(RESULTS / "advice_validation.json"))
    parser.add_argument("--out", default=str(RESULTS / "one_gpu_maps_fit.json"))
    parser.add_argument("--log-prob-cost", type=float, default=None,
                        help="the rollout's log-prob cost (default: the vllm backend's declared log_prob_cost)")
    args = parser.parse_args()
    cost = args.log_prob_cost if args.log_prob_cost is not None else declared_log_prob_cost(GPU_ROLLOUT)
    rows = json.loads(Path(args.rows).read_text())["rows"]
    (a, b), fractional = evaluate(points(rows, "fractional"), fit_time_sliced, time_sliced)
    k, flight = evaluate(points(rows, "in_flight", cost), fit_in_flight, in_flight)
    result = {"benchmark": "fit_one_gpu_maps", "source": str(Path(args.rows).name), "log_prob_cost": cost,
              "time_sliced": {"gen": round(a, 2), "train": round(b, 2), "error": band(fractional),
                              "rows": fractional},
              "in_flight": {"gen": round(k, 2), "error": band(flight), "rows": flight}}
    print(f"in-flight generation x {cost:.2f} (log-probs); fractional uncharged")
    print(f"fractional: step = max(gen, train, {a:.2f} x gen + {b:.2f} x train) + reshard + fixed; "
          f"out-of-sample band ±{result['time_sliced']['error']:.0%}")
    print(f"in flight: gen x {k:.2f}; out-of-sample band ±{result['in_flight']['error']:.0%}")
    for r in fractional + flight:
        loo = r["error_out_of_sample"]
        device = r["device"].removeprefix("1x ")[:21]
        print(f"  {device:21} {r['workload']:30} {r['map']:16} measured {r['measured_step_s']:7.3f}  fitted "
              f"{r['predicted_step_s']:7.3f} ({r['error']:+.0%})  out of sample "
              + ("-" if loo is None else f"{r['predicted_out_of_sample_s']:7.3f} ({loo:+.0%})"))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
