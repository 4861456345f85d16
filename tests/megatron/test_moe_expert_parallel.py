"""Expert parallelism over two gloo ranks: a tiny Qwen3-MoE with ``expert_parallel: 2`` (each rank holds 4 of the 8
experts, tokens reach them through Megatron's all-gather dispatcher) gives the logits and log-probs of one
transformers model and trains like one unsharded model; every rank exports every expert. The same run with
data parallelism alone is the control."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _mg_helpers import assert_close, hf_model, hf_response_log_probs, logits_input, make_batch, plain_training
from _mg_markers import needs_megatron
from _mg_worker import BASE_OPTIONS, GLOBAL_BATCH, STEPS
from test_parallel import ATOL, WEIGHT_ATOL, launch, load

from hybridrl.config import TinyModelConfig
from hybridrl.model.tiny import build_tiny_model
from hybridrl.weights.experts import to_checkpoint_layout

pytestmark = needs_megatron

#: the vocabulary is the bundled tokenizer's (> the helpers' 41 ids the batches draw from)
TINY_MOE = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64,
                           num_experts=8, experts_per_token=2, init_std=0.2)
#: no load-balancing loss: the reference is plain training of the policy loss alone
OPTIONS = {"moe_aux_loss_coef": 0.0}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[dict]]]:
    root = tmp_path_factory.mktemp("mg-moe-ep")
    model = build_tiny_model(TINY_MOE, root / "model")
    scenarios = {"ep2": {**OPTIONS, "expert_parallel": 2}, "dp2": dict(OPTIONS)}
    launch(2, [{"model": str(model), "options": options, "out": str(root / name)}
               for name, options in scenarios.items()], timeout=600)
    return model, {name: load(root / name, 2) for name in scenarios}


@pytest.mark.parametrize("scenario", ["ep2", "dp2"])
def test_expert_parallel_matches_one_model(runs, scenario: str) -> None:
    model, results = runs
    results = results[scenario]
    hf = hf_model(model)
    batch = make_batch(GLOBAL_BATCH, seed=1)
    with torch.no_grad():
        logits = hf(input_ids=logits_input()).logits
        log_probs = hf_response_log_probs(hf, batch)
    weights, losses, norms = plain_training(model, batch, STEPS, BASE_OPTIONS["micro_batch"], BASE_OPTIONS["lr"],
                                            BASE_OPTIONS["grad_clip"])
    reference = dict(to_checkpoint_layout(weights.items()))
    initial = dict(to_checkpoint_layout((n, p.detach()) for n, p in hf.named_parameters()))

    assert all(r["layout"] == (1, 1, 2) for r in results)
    ep = 2 if scenario == "ep2" else 1
    assert all(r["expert_parallel"] == ep for r in results)
    held = [set(r["experts_held"]) for r in results]
    assert all(len(h) == 2 * 2 * 8 // ep for h in held)  # layers x (fc1, fc2) x the rank's experts
    if ep == 2:
        assert not held[0] & held[1]  # the two ranks hold different experts
    outputs = sorted(results, key=lambda r: r["info"].dp_rank)
    for r in results:
        torch.testing.assert_close(r["logits"], logits, atol=ATOL, rtol=0)
    assert_close(torch.cat([r["log_probs_before"] for r in outputs]), log_probs, ATOL, "log_probs_before")
    for r in outputs:
        for got, loss, norm in zip(r["metrics"], losses, norms):
            assert got["loss"] == pytest.approx(loss, abs=1e-5)
            assert got["grad_norm"] == pytest.approx(norm, rel=1e-4)
    first = results[0]["exported"]
    assert set(first) == set(reference)  # the untied head too
    experts = [n for n in first if ".mlp.experts." in n]
    assert len(experts) == 2 * 8 * 3
    moved = max(float((reference[n] - initial[n]).abs().max()) for n in experts)
    assert moved > 50 * WEIGHT_ATOL
    for name in first:
        assert_close(first[name], reference[name], WEIGHT_ATOL, name)
    for r in results:
        assert all(torch.equal(r["exported"][n], first[n]) for n in first)
        assert all(torch.equal(r["restored"][n], first[n]) for n in first)
