"""``benchmarks/fit_default_costs.py``: the advisor's default (unprofiled) GPU costs are fitted from measured
colocated steps, and the constants ``hybridrl plan --advise`` prices with are the committed fit's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
fit = pytest.importorskip("fit_default_costs")


def sizes_made_by(c) -> list:
    """Four model sizes whose measured phases are exactly what the constants ``c`` price."""
    out = []
    for name, params, tokens, rounds in [("s", 0.5e9, 1.6e5, 512), ("m", 1.5e9, 1.6e5, 512),
                                         ("l", 3e9, 2.0e5, 1024), ("xl", 7.6e9, 1.6e5, 512)]:
        size = fit.Size(name, "gpu", params, tokens, 0.5 * tokens, rounds, 0.03, {})
        phases = fit.predicted_phases(size, c)
        measured = {"gen": phases["gen"], "forward": phases["forward"], "update_actor": phases["update_actor"],
                    "wake": phases["wake"], "sleep": phases["sleep"], "reshard": phases["reshard"],
                    "step": sum(phases.values())}
        out.append(fit.Size(name, "gpu", params, tokens, 0.5 * tokens, rounds, 0.03, measured))
    return out


def test_the_fit_recovers_the_constants_that_made_the_steps():
    made = fit.Constants(400e12, 550e12, 0.004, 0.8e-12,
                         {"wake": 0.02, "sleep": 0.05, "reshard_fixed": 0.1, "fixed": 0.3})
    got, rows = fit.evaluate(sizes_made_by(made))
    assert (got.train_flops, got.forward_flops, got.round_s, got.round_s_per_param) == pytest.approx(
        (made.train_flops, made.forward_flops, made.round_s, made.round_s_per_param), rel=1e-9)
    assert got.seconds == pytest.approx(made.seconds)
    assert got.memory_bw == pytest.approx(2.5e12)
    assert all(r["error"] == 0 and r["error_out_of_sample"] == 0 for r in rows)


def test_a_slower_size_is_missed_out_of_sample_and_less_in_sample():
    made = fit.Constants(400e12, 550e12, 0.004, 0.8e-12,
                         {"wake": 0.02, "sleep": 0.05, "reshard_fixed": 0.1, "fixed": 0.3})
    sizes = sizes_made_by(made)
    slow = sizes[1]
    sizes[1] = fit.Size(slow.size, slow.device, slow.params, slow.train_tokens, slow.forward_tokens, slow.rounds,
                        slow.transfer_s, {**slow.measured, "update_actor": 2 * slow.measured["update_actor"],
                                          "step": slow.measured["step"] + slow.measured["update_actor"]})
    _, rows = fit.evaluate(sizes)
    assert rows[1]["error_out_of_sample"] < rows[1]["error"] < 0  # under-predicted, worse without its own row


def test_one_model_size_cannot_fit_the_round():
    made = fit.Constants(400e12, 550e12, 0.004, 0.8e-12,
                         {"wake": 0.02, "sleep": 0.05, "reshard_fixed": 0.1, "fixed": 0.3})
    with pytest.raises(ValueError, match="two model sizes"):
        fit.fit(sizes_made_by(made)[:1])


def test_the_advisor_prices_unprofiled_gpus_with_the_committed_fit():
    from hybridrl.placement.advice import profile

    cuda = json.loads((ROOT / "benchmarks" / "results" / "default_costs_fit.json").read_text())["cuda"]
    assert (profile.DEFAULT_TRAIN_FLOPS["cuda"], profile.DEFAULT_FORWARD_FLOPS["cuda"],
            profile.DEFAULT_ROUND_S["cuda"], profile.DEFAULT_MEMORY_BW["cuda"]) == (
        cuda["train_flops"], cuda["forward_flops"], cuda["round_s"], cuda["memory_bw"])
    seconds = profile.DEFAULT_SECONDS["cuda"]
    assert {k: seconds[k] for k in fit.SECONDS} == {k: cuda[k] for k in fit.SECONDS}
    assert seconds["gen_fixed"] == 0.0  # one round count among the sizes: no intercept (see the fit's docstring)
