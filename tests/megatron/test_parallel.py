"""Headline: tensor, pipeline and data parallelism over gloo ranks give what one transformers model gives.

One launch of two rank processes runs five layouts in turn (``_mg_worker.py``; Megatron's parallel state is
rebuilt between them): tensor parallel 2 and pipeline parallel 2, each for Qwen2 (tied embeddings: under
pipeline parallelism the first and last stage share the embedding) and Llama (untied), and data parallel 2
(Llama), and a critic (value head) with tensor parallel 2 (Llama) and pipeline parallel 2 (Qwen2). Each is
checked against independent
computations in this process: transformers logits and log-probs, and plain PyTorch training (one unsharded
model, AdamW). A four-rank tensor x pipeline run is marked slow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _mg_helpers import (
    PlainCritic,
    assert_close,
    context,
    hf_model,
    hf_response_log_probs,
    logits_input,
    make_batch,
    plain_critic_training,
    plain_training,
)
from _mg_markers import needs_megatron
from _mg_worker import BASE_OPTIONS, GLOBAL_BATCH, STEPS

from hybridrl.runtime.distributed import free_port

pytestmark = needs_megatron

WORKER = Path(__file__).with_name("_mg_worker.py")
ATOL = 1e-4  # logits and log-probs, fp32
#: after STEPS AdamW steps of lr 1e-2: Adam divides each gradient by its own size, so an element whose gradient
#: is near zero turns summation-order rounding into a visible share of one step.
WEIGHT_ATOL = 3e-4  # 3% of one step: a wrongly sharded or missed gradient is off by whole steps


def launch(world_size: int, scenarios: list[dict], timeout: float = 300) -> None:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    args = [str(world_size), str(port), json.dumps(scenarios)]
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(rank), *args], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in range(world_size)]
    try:
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {rank} failed:\n{log[-6000:]}"


def load(out: Path, world_size: int) -> list[dict]:
    return [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(world_size)]


class Reference:
    """What the runs must reproduce, computed once per model with transformers and plain PyTorch."""

    def __init__(self, model: Path) -> None:
        hf = hf_model(model)
        batch = make_batch(GLOBAL_BATCH, seed=1)
        with torch.no_grad():
            self.logits = hf(input_ids=logits_input()).logits
            self.log_probs = hf_response_log_probs(hf, batch)
        self.initial = {n: p.detach().clone() for n, p in hf.named_parameters()}
        self.weights, self.losses, self.norms = plain_training(
            model, batch, STEPS, BASE_OPTIONS["micro_batch"], BASE_OPTIONS["lr"], BASE_OPTIONS["grad_clip"])
        with torch.no_grad():
            trained = hf_model(model)
            trained.load_state_dict(self.weights, strict=False)
            self.log_probs_after = hf_response_log_probs(trained, batch)


def check_run(results: list[dict], ref: Reference, layout: tuple[int, int, int]) -> None:
    tp, pp, dp = layout
    assert all(r["layout"] == layout for r in results)
    outputs = [r for r in results if r["info"].returns_output]
    assert len(outputs) == dp and sorted(r["info"].dp_rank for r in outputs) == list(range(dp))
    outputs.sort(key=lambda r: r["info"].dp_rank)

    # logits: every last-stage rank holds the gathered full-vocabulary logits
    last_stage = [r for r in results if r["logits"] is not None]
    assert len(last_stage) == tp * dp
    for r in last_stage:
        torch.testing.assert_close(r["logits"], ref.logits, atol=ATOL, rtol=0)

    # log-probs of the data-parallel shares, before and after training, concatenated in rank order
    for key, want in (("log_probs_before", ref.log_probs), ("log_probs_after", ref.log_probs_after)):
        assert_close(torch.cat([r[key] for r in outputs]), want, ATOL, key)

    # the same losses and gradient norms as one unsharded model, step by step
    for r in outputs:
        for got, loss, norm in zip(r["metrics"], ref.losses, ref.norms):
            assert got["loss"] == pytest.approx(loss, abs=1e-5)
            assert got["grad_norm"] == pytest.approx(norm, rel=1e-4)
            assert got["skipped_step"] == 0.0

    # every rank exports the full, identical weights, equal to plain training's
    moved = max(float((ref.weights[n] - ref.initial[n]).abs().max()) for n in ref.weights)
    assert moved > 50 * WEIGHT_ATOL  # the weights moved far more than the tolerance allows
    first = results[0]["exported"]
    assert first.keys() == ref.weights.keys()
    for name in ref.weights:
        assert_close(first[name], ref.weights[name], WEIGHT_ATOL, name)
    for r in results:
        assert all(torch.equal(r["exported"][n], first[n]) for n in first)
        # checkpoint round trip: training on moved the weights, loading brought the saved ones back
        assert any(not torch.equal(r["moved_after_save"][n], first[n]) for n in first)
        assert all(torch.equal(r["restored"][n], first[n]) for n in first)


@pytest.fixture(scope="module")
def two_rank_runs(qwen2_tied: Path, llama_untied: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("mg-two-ranks")
    runs = {"tp2-qwen2": (qwen2_tied, {"tensor_parallel": 2}),
            "tp2-llama": (llama_untied, {"tensor_parallel": 2}),
            "pp2-qwen2": (qwen2_tied, {"pipeline_parallel": 2}),
            "pp2-llama": (llama_untied, {"pipeline_parallel": 2}),
            "dp2-llama": (llama_untied, {})}
    critics = {"critic-tp2-llama": (llama_untied, {"tensor_parallel": 2}),
               "critic-pp2-qwen2": (qwen2_tied, {"pipeline_parallel": 2})}
    launch(2, [{"model": str(model), "options": options, "out": str(out / name)}
               for name, (model, options) in runs.items()] +
           [{"model": str(model), "options": options, "out": str(out / name), "critic": True}
            for name, (model, options) in critics.items()])
    return {name: out / name for name in {**runs, **critics}}


@pytest.fixture(scope="module")
def references(qwen2_tied: Path, llama_untied: Path) -> dict[str, Reference]:
    return {"qwen2": Reference(qwen2_tied), "llama": Reference(llama_untied)}


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_tensor_parallel_2(two_rank_runs, references, family: str) -> None:
    check_run(load(two_rank_runs[f"tp2-{family}"], 2), references[family], (2, 1, 1))


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_pipeline_parallel_2(two_rank_runs, references, family: str) -> None:
    check_run(load(two_rank_runs[f"pp2-{family}"], 2), references[family], (1, 2, 1))


def test_pipeline_parallel_2_loss_equals_pipeline_parallel_1(two_rank_runs, qwen2_tied: Path, process_group) -> None:
    """The brief's check, directly: the same engine with one stage in this process, the same batch."""
    from _mg_helpers import PolicyGradient

    from hybridrl_megatron.engine import MegatronEngine

    one_stage = MegatronEngine(context(qwen2_tied, **BASE_OPTIONS))
    batch = make_batch(GLOBAL_BATCH, seed=1)
    losses = [one_stage.update(batch, PolicyGradient())["loss"] for _ in range(STEPS)]
    two_stages = [r for r in load(two_rank_runs["pp2-qwen2"], 2) if r["info"].returns_output][0]
    assert [m["loss"] for m in two_stages["metrics"]] == pytest.approx(losses, abs=1e-6)


def test_data_parallel_2(two_rank_runs, references) -> None:
    check_run(load(two_rank_runs["dp2-llama"], 2), references["llama"], (1, 1, 2))


@pytest.mark.parametrize("run, family", [("critic-tp2-llama", "llama"), ("critic-pp2-qwen2", "qwen2")])
def test_critic_tensor_and_pipeline_parallel(two_rank_runs, run: str, family: str, qwen2_tied: Path,
                                             llama_untied: Path) -> None:
    """The value head sits on the last stage, replicated over tensor ranks; values and training equal a
    transformers backbone with the same head, trained directly."""
    results = load(two_rank_runs[run], 2)
    model = {"qwen2": qwen2_tied, "llama": llama_untied}[family]
    initial = results[0]["initial"]
    assert all(torch.equal(r["initial"][n], initial[n]) for r in results for n in initial)  # one head everywhere
    plain = PlainCritic(model, initial["value_head.weight"], initial["value_head.bias"])
    batch = make_batch(GLOBAL_BATCH, seed=1)
    out = [r for r in results if r["info"].returns_output]
    assert len(out) == 1
    with torch.no_grad():
        torch.testing.assert_close(out[0]["values_before"], plain.response_values(batch), atol=ATOL, rtol=0)
    losses, norms = plain_critic_training(plain, batch, STEPS, BASE_OPTIONS["micro_batch"], BASE_OPTIONS["lr"],
                                          BASE_OPTIONS["grad_clip"])
    for got, loss, norm in zip(out[0]["metrics"], losses, norms):
        assert got["loss"] == pytest.approx(loss, abs=1e-5) and got["grad_norm"] == pytest.approx(norm, rel=1e-4)
    with torch.no_grad():
        torch.testing.assert_close(out[0]["values_after"], plain.response_values(batch), atol=ATOL, rtol=0)
    want = plain.hf_state()
    for r in results:
        assert r["exported"].keys() == want.keys()
        for name in want:
            assert_close(r["exported"][name], want[name], WEIGHT_ATOL, name)


@pytest.mark.slow
def test_tensor_and_pipeline_parallel_on_four_ranks(qwen2_tied: Path, references, tmp_path: Path) -> None:
    launch(4, [{"model": str(qwen2_tied), "options": {"tensor_parallel": 2, "pipeline_parallel": 2},
                "out": str(tmp_path / "tp2pp2")}])
    check_run(load(tmp_path / "tp2pp2", 4), references["qwen2"], (2, 2, 1))
