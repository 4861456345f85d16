"""The driver's bookkeeping of groups in flight, per step, at a GPU step's shapes (engine-free, on this CPU).

An in-flight step (``trainer.mode=async`` on a colocated map) turns its groups into an engine request
(``GroupsInFlight.requests``), takes the round's tokens back (``absorb``) and builds the training batch
(``batch``) on the driver while the device waits. This times the three at the shapes the GPU advice runs use
(64 prompts x 8 samples; 128-token prompts and 256 new tokens, and the long tail's 256-token prompts with
lognormal lengths of median 512 capped at 4096), with random tokens in place of the engine's, and prints them
beside the measured in-flight steps of ``results/advice_validation.json``.

    python benchmarks/flight_bookkeeping.py [--repeats 5] [--out results/flight_bookkeeping.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import types
from pathlib import Path
from typing import Any

import torch

from hybridrl.data.loading import PromptRow
from hybridrl.engines.batch import FINISHED, RESPONSE_IDS, RESPONSE_MASK, ROLLOUT_LOG_PROBS, Batch
from hybridrl.run.streaming import GroupsInFlight, forced_lengths

HERE = Path(__file__).resolve().parent
#: name -> (prompt tokens, max new tokens, forced lengths (median, sigma) or None: every row at its cap)
SHAPES = {"standard": (128, 256, None), "long_tail": (256, 4096, (512, 1.0))}
PROMPTS, SAMPLES, OVERSAMPLE = 64, 8, 1.25


def one_step(prompt_len: int, new_tokens: int, lengths: tuple[int, float] | None, seed: int) -> dict[str, float]:
    """Seconds of ``requests``, ``absorb`` and ``batch`` + ``take`` for a steady step's round (the second: the
    first step's surplus groups are carried), every row finishing."""
    # the lengths a run draws for roles.rollout.response_lengths (None: every row at its cap)
    spec = types.SimpleNamespace(median=lengths[0], sigma=lengths[1], seed=seed) if lengths else None
    rollout = types.SimpleNamespace(response_lengths=spec, max_new_tokens=new_tokens)
    cap = forced_lengths(types.SimpleNamespace(roles=types.SimpleNamespace(rollout=rollout)))
    flight = GroupsInFlight(PROMPTS, SAMPLES, OVERSAMPLE, True, 1, new_tokens, 0, response_cap=cap)
    rows = [PromptRow(prompt=f"p{i}", token_ids=torch.randint(100, 150000, (prompt_len,)).tolist(), meta={},
                      messages=None) for i in range(3 * PROMPTS)]
    times: dict[str, float] = {}
    for version in range(2):
        flight.begin_step(version, lambda: rows)
        start = time.perf_counter()
        request, pairs = flight.requests()
        times["requests"] = time.perf_counter() - start
        caps = torch.tensor([s.cap for _, s in pairs])
        mask = (torch.arange(new_tokens)[None, :] < caps[:, None]).long()
        out = Batch.from_tensors({RESPONSE_IDS: torch.randint(100, 150000, mask.shape) * mask, RESPONSE_MASK: mask,
                                  ROLLOUT_LOG_PROBS: -torch.rand(mask.shape) * mask,
                                  FINISHED: torch.ones(len(pairs), dtype=torch.bool)})
        start = time.perf_counter()
        flight.absorb(pairs, out, version)
        times["absorb"] = time.perf_counter() - start
        start = time.perf_counter()
        flight.batch(flight.take(PROMPTS))
        times["batch"] = time.perf_counter() - start
        flight.end_step()
        times["tokens"] = float(mask.sum())
    times["total"] = times["requests"] + times["absorb"] + times["batch"]
    return times


def measured_in_flight_steps() -> dict[str, list[dict[str, Any]]]:
    """The in-flight rows of ``results/advice_validation.json`` per shape name (by their new tokens)."""
    path = HERE / "results" / "advice_validation.json"
    rows = json.loads(path.read_text())["rows"] if path.is_file() else []
    out: dict[str, list[dict[str, Any]]] = {name: [] for name in SHAPES}
    for row in rows:
        if not row.get("map", "").startswith("in-flight") or "cpu" in row.get("device", ""):
            continue
        name = "long_tail" if "+4096" in row.get("workload", "") else "standard"
        out[name].append({"workload": row["workload"], "device": row["device"], "step_s": row["measured_step_s"]})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(HERE / "results" / "flight_bookkeeping.json"))
    args = parser.parse_args()
    steps = measured_in_flight_steps()
    result: dict[str, Any] = {"benchmark": "flight_bookkeeping", "prompts": PROMPTS, "samples": SAMPLES,
                              "oversample": OVERSAMPLE, "repeats": args.repeats, "shapes": {}}
    for name, (prompt_len, new_tokens, lengths) in SHAPES.items():
        runs = [one_step(prompt_len, new_tokens, lengths, seed) for seed in range(args.repeats)]
        median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        shares = [{**s, "share_of_step": median["total"] / s["step_s"]} for s in steps[name]]
        result["shapes"][name] = {"seconds_median": median, "in_flight_steps": shares}
        print(f"{name}: requests {median['requests']:.3f} s, absorb {median['absorb']:.3f} s, batch "
              f"{median['batch']:.3f} s, total {median['total']:.3f} s ({median['tokens']:.0f} tokens)"
              + "".join(f"; {s['share_of_step']:.1%} of the {s['step_s']:.2f} s step of {s['workload']}"
                        for s in shares))
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
