"""The advisor's default (unprofiled) GPU costs, fitted from measured steps: the colocated GRPO step of the
standard workload (64x8, 128-token prompts, 256 new tokens; ``model_sizes.py``'s defaults) at 0.5B, 1.5B, 3B and 7B
on one GPU (``results/model_sizes_<size>.json``).

``hybridrl plan --advise`` without ``--profile`` prices each map with ``profile.default_profile``: training and
forward passes at an effective FLOP/s (6 and 2 FLOPs per parameter and token), a decode round as a fixed cost plus
the bf16 weights read at an effective bandwidth, and seconds per step (wake, sleep, the driver's work, a sync's
fixed cost). This fits the ``cuda`` constants. For each size the advisor's own prediction of the colocated map
(as ``hybridrl plan --advise`` ranks it, under the current constants) says how much work each phase is (tokens, decode
rounds), and the measured phase divides it:

* train and forward FLOP/s: the geometric mean over the sizes of the work over the measured seconds;
* a decode round: ``a + b x parameters``, minimising the generation's relative squared error; ``2 / b`` is the
  effective bandwidth. A generate call's own fixed cost is 0, as a fitted profile takes it when its steps decode
  one number of rounds (here every size decodes the same);
* wake, sleep, a sync's fixed cost (its measured seconds less its bytes over the copy) and the driver's work
  (the step less its timed phases): medians over the sizes.

Each size's step is predicted in sample and out of sample (fitted without that size), and the colocated steps of the
same workload that ``advice_validation.py`` measured on other machines are predicted beside them. A test checks that
``profile.py``'s constants are this fit's. Prints the table and writes ``--out`` (``results/default_costs_fit.json``).

    python benchmarks/fit_default_costs.py        # about a minute of CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from advice_validation import ranked_maps, workload_file  # noqa: E402  (benchmarks/ is not a package)
from model_sizes import SHAPES, SIZES  # noqa: E402

from hybridrl.placement.advice import profile as costs
from hybridrl.placement.advice.profile import FORWARD_FLOPS_PER_TOKEN, TRAIN_FLOPS_PER_TOKEN

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
#: the phases the advisor prices at the forward rate
FORWARD_PHASES = ("ref", "old_log_prob")
#: the per-step seconds fitted as medians (``Constants.seconds``)
SECONDS = ("wake", "sleep", "reshard_fixed", "fixed")


@dataclass(frozen=True)
class Size:
    """One measured colocated step beside the work the advisor counts in it."""

    size: str
    device: str
    params: float  # the parameters the default profile is given (the shape's active ones)
    train_tokens: float  # tokens the update trains, as the advisor counts them
    forward_tokens: float  # tokens of the reference (and old log-prob) passes
    rounds: float  # decode rounds of the generation
    transfer_s: float  # the sync's bytes over the copy (the predicted reshard less its fixed cost)
    measured: dict[str, float]  # gen, forward, update_actor, wake, sleep, reshard, step (seconds)


@dataclass(frozen=True)
class Constants:
    train_flops: float
    forward_flops: float
    round_s: float  # a decode round's fixed seconds
    round_s_per_param: float  # and its seconds per parameter
    seconds: dict[str, float]  # wake, sleep, reshard_fixed, fixed

    @property
    def memory_bw(self) -> float:
        """The effective bandwidth of a round's bf16 weights: ``2 / round_s_per_param``."""
        return 2 / self.round_s_per_param


# --- the fit (pure) -------------------------------------------------------------------------------------------
def fit(sizes: list[Size]) -> Constants:
    """The constants that price ``sizes``' steps (see the docstring); needs two sizes of different parameters."""
    if len({s.params for s in sizes}) < 2:
        raise ValueError(f"the round's per-parameter cost needs two model sizes ({len(sizes)} given)")
    train = statistics.geometric_mean([s.train_tokens * TRAIN_FLOPS_PER_TOKEN * s.params / s.measured["update_actor"]
                            for s in sizes])
    forward = statistics.geometric_mean([s.forward_tokens * FORWARD_FLOPS_PER_TOKEN * s.params / s.measured["forward"]
                              for s in sizes])
    # per-round seconds r_i = gen_i / rounds_i; the relative error of rounds_i x (a + b N_i) is (a + b N_i) / r_i - 1
    xs = [s.params for s in sizes]
    ys = [s.measured["gen"] / s.rounds for s in sizes]
    w = [1 / y**2 for y in ys]
    sw, sx, sy = sum(w), sum(wi * x for wi, x in zip(w, xs)), sum(wi * y for wi, y in zip(w, ys))
    sxx, sxy = sum(wi * x * x for wi, x in zip(w, xs)), sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    b = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    a = (sy - b * sx) / sw
    seconds = {
        "wake": statistics.median(s.measured["wake"] for s in sizes),
        "sleep": statistics.median(s.measured["sleep"] for s in sizes),
        "reshard_fixed": statistics.median(max(0.0, s.measured["reshard"] - s.transfer_s) for s in sizes),
        "fixed": statistics.median(s.measured["step"] - sum(s.measured[p] for p in (
            "gen", "forward", "update_actor", "wake", "sleep", "reshard")) for s in sizes),
    }
    return Constants(train, forward, a, b, seconds)


def predicted_phases(s: Size, c: Constants) -> dict[str, float]:
    """The colocated step's phases of ``s`` as the default profile with ``c`` prices them."""
    return {"gen": s.rounds * (c.round_s + c.round_s_per_param * s.params),
            "forward": s.forward_tokens * FORWARD_FLOPS_PER_TOKEN * s.params / c.forward_flops,
            "update_actor": s.train_tokens * TRAIN_FLOPS_PER_TOKEN * s.params / c.train_flops,
            "wake": c.seconds["wake"], "sleep": c.seconds["sleep"],
            "reshard": s.transfer_s + c.seconds["reshard_fixed"], "fixed": c.seconds["fixed"]}


def predicted_step(s: Size, c: Constants) -> float:
    return sum(predicted_phases(s, c).values())


def evaluate(sizes: list[Size]) -> tuple[Constants, list[dict[str, Any]]]:
    """The fit over every size, and each size predicted in sample and out of sample (fitted without it)."""
    c = fit(sizes)
    rows = []
    for i, s in enumerate(sizes):
        others = sizes[:i] + sizes[i + 1:]
        loo = predicted_step(s, fit(others)) if len({o.params for o in others}) >= 2 else None
        pred = predicted_step(s, c)
        rows.append({"size": s.size, "device": s.device, "params": s.params, "measured_step_s": s.measured["step"],
                     "measured_phases_s": s.measured, "predicted_step_s": round(pred, 3),
                     "predicted_phases_s": {k: round(v, 3) for k, v in predicted_phases(s, c).items()},
                     "error": round(pred / s.measured["step"] - 1, 4),
                     "predicted_out_of_sample_s": None if loo is None else round(loo, 3),
                     "error_out_of_sample": None if loo is None else round(loo / s.measured["step"] - 1, 4)})
    return c, rows


# --- the measured steps and the advisor's work in them --------------------------------------------------------
def measured_size(size: str, result: dict[str, Any], work: dict[str, float], params: float) -> Size:
    """``result`` (a ``model_sizes`` JSON) as a ``Size``, with ``work`` the advisor's phases priced under the current
    constants (``colocated_phases``): each phase's seconds times the rate that priced it is the work."""
    current = costs.default_profile("cuda", params)
    m = result["median"]
    return Size(
        size=size, device=f"{result['device']} {float(result['device_mb']) / 1024:.0f} GiB", params=params,
        train_tokens=work["update_actor"] * current.train_tps,
        forward_tokens=sum(work.get(p, 0.0) for p in FORWARD_PHASES) * current.ref_tps,
        rounds=(work["gen"] - current.gen_fixed) / current.gen_round,
        transfer_s=work["reshard"] - current.reshard_fixed,
        measured={"gen": m["timing/gen"], "forward": sum(m.get(f"timing/{p}", 0.0) for p in FORWARD_PHASES),
                  "update_actor": m["timing/update_actor"], "wake": m["timing/wake"], "sleep": m["timing/sleep"],
                  "reshard": m["timing/reshard"], "step": m["timing/step"]})


def colocated_phases(size: str, workload: dict[str, Any], device_gib: float, workdir: Path) -> tuple[dict, float]:
    """The advisor's phases of the colocated map of ``size``'s standard workload on one GPU of ``device_gib``
    (default costs, as ``hybridrl plan --advise`` ranks it), and the parameters it priced them for."""
    from hybridrl.placement.plan import ClusterSpec

    shape = argparse.Namespace(device="cuda", model_path=str(ROOT / "examples" / "configs" / SHAPES[size]),
                               prompt_len=workload["prompt_len"], prompts=workload["prompts"],
                               samples=workload["samples"], backend="vllm", new_tokens=workload["new_tokens"],
                               steps=1)
    config = workload_file(shape, size, workdir)
    overrides = [f"cluster.device_memory_gb={device_gib:.1f}"]
    ranked, _, _ = ranked_maps(config, overrides, ClusterSpec(1, 1, "cuda", declared=True), None)
    colocated = next((r for r in ranked if r.candidate.kind == "colocated"), None)
    if colocated is None or colocated.prediction is None or colocated.planned.shape is None:
        raise SystemExit(f"{size}: the advisor kept no colocated map on one {device_gib:.0f} GiB GPU")
    return colocated.prediction.phases, float(colocated.planned.shape.active_param_count())


def other_machines(rows: list[dict[str, Any]], sizes: dict[str, Size], c: Constants) -> list[dict[str, Any]]:
    """The standard workload's colocated profile steps that ``advice_validation.py`` measured, predicted by ``c``."""
    out = []
    for r in rows:
        size = r["workload"].split()[0]
        if (r.get("kind") != "colocated" or not r.get("profile_run") or r.get("error") or size not in sizes
                or "128+256" not in r["workload"]):
            continue
        pred = predicted_step(sizes[size], c)
        out.append({"device": r["device"], "size": size, "measured_step_s": r["measured_step_s"],
                    "predicted_step_s": round(pred, 3), "error": round(pred / r["measured_step_s"] - 1, 4)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=",".join(SIZES))
    parser.add_argument("--out", default=str(RESULTS / "default_costs_fit.json"))
    args = parser.parse_args()
    sizes: list[Size] = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            path = RESULTS / f"model_sizes_{size}.json"
            result = json.loads(path.read_text())
            if not result.get("ok") or result.get("variant") != "defaults" or result.get("gpus") != 1:
                raise SystemExit(f"{path.name}: not a finished one-GPU run of the defaults")
            device_gib = float(result["device_mb"]) / 1024
            work, params = colocated_phases(size, result["workload"], device_gib, Path(tmp))
            sizes.append(measured_size(size, result, work, params))
    c, rows = evaluate(sizes)
    validation = json.loads((RESULTS / "advice_validation.json").read_text())["rows"]
    others = other_machines(validation, {s.size: s for s in sizes}, c)
    result = {"benchmark": "fit_default_costs", "source": [f"model_sizes_{s.size}.json" for s in sizes],
              "cuda": {"train_flops": float(f"{c.train_flops:.3g}"), "forward_flops": float(f"{c.forward_flops:.3g}"),
                       "round_s": float(f"{c.round_s:.3g}"), "memory_bw": float(f"{c.memory_bw:.3g}"),
                       **{k: round(v, 2) for k, v in c.seconds.items()}},
              "error": max(abs(r["error_out_of_sample"]) for r in rows if r["error_out_of_sample"] is not None),
              "rows": rows, "other_machines": others}
    cuda = result["cuda"]
    print(f"train {cuda['train_flops'] / 1e12:.0f} TFLOP/s, forward {cuda['forward_flops'] / 1e12:.0f} TFLOP/s "
          f"(6 and 2 FLOPs per parameter and token); a decode round {cuda['round_s'] * 1e3:.2f} ms + the bf16 weights "
          f"at {cuda['memory_bw'] / 1e12:.2f} TB/s; wake {cuda['wake']} s, sleep {cuda['sleep']} s, "
          f"sync {cuda['reshard_fixed']} s, driver {cuda['fixed']} s")
    for r in rows:
        loo = r["error_out_of_sample"]
        print(f"  {r['size']:5} measured {r['measured_step_s']:7.3f}  fitted {r['predicted_step_s']:7.3f} "
              f"({r['error']:+.0%})  out of sample " + ("-" if loo is None else
                                                         f"{r['predicted_out_of_sample_s']:7.3f} ({loo:+.0%})"))
    for r in others:
        print(f"  {r['size']:5} {r['device'][:28]:28} measured {r['measured_step_s']:7.3f}  predicted "
              f"{r['predicted_step_s']:7.3f} ({r['error']:+.0%})")
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
