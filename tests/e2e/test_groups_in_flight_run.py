"""Groups in flight in a real run (Ray, the FSDP actor, the transformers rollout): with oversample 1 a step
is the synchronous step, metric for metric; with oversample above 1 a step trains the first groups to complete,
carries the rest (resumed under new weights with partial rollouts), and bounds the tokens' staleness."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridrl.config import load_config
from hybridrl.engines.batch import GROUP_INDEX, RESPONSE_MASK, TOKEN_VERSIONS
from hybridrl.plugins.discovery import get_registry
from hybridrl.run.preflight import prepare_run
from hybridrl.run.trainer import Trainer
from hybridrl.runtime.cluster import detect_cluster

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"
SMALL = ["data.prompts_per_step=4", "algorithm.n_samples=4", "trainer.progress=false", "trainer.trackers=[jsonl]",
         "roles.reward.runner=inline", "algorithm.tis_cap=2.0", "roles.rollout.log_probs=true"]


def started(tmp_path: Path, overrides: list[str], config: Path = QUICKSTART) -> Trainer:
    cfg = load_config(config, [*SMALL, *overrides, f"trainer.out={tmp_path}"])
    trainer = Trainer(prepare_run(cfg, get_registry(), detect_cluster(cfg.cluster)))
    trainer.start()
    return trainer


def run_steps(tmp_path: Path, overrides: list[str], steps: int) -> list[dict[str, float]]:
    trainer = started(tmp_path, overrides)
    try:
        return [trainer.train_step() for _ in range(steps)]
    finally:
        trainer.shutdown()


def test_oversample_one_reproduces_the_synchronous_steps(tmp_path, ray_local):
    sync = run_steps(tmp_path / "sync", [], 3)
    streamed = run_steps(tmp_path / "streamed", ["roles.rollout.partial=true"], 3)
    for a, b in zip(sync, streamed):
        for key in ("reward/mean", "reward/std", "response_length/mean", "actor/pg_loss", "actor/grad_norm",
                    "actor/tis_ratio", "rollout/logp_diff"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), key
        assert b["rollout/thrown_tokens"] == 0 and b["rollout/groups_carried"] == 0
        assert b["async/version_lag_max"] == 0


RAGGED = ["roles.rollout.oversample=2", "roles.rollout.max_new_tokens=12", "roles.rollout.ignore_eos=true",
          "roles.rollout.response_lengths={median: 4, sigma: 1}"]


def in_flight_steps(trainer: Trainer, steps: int, refill: bool = False) -> list[dict[str, float]]:
    """``steps`` steps, each checked: four complete groups of four trained, every trained token sampled by the
    weights the update started from or the ones before (trainer.max_staleness=1), and what is left in flight:
    the four other groups; with refill, the groups still decoding when the fourth completed (up to eight, the
    target), while a waiting group that never started holds no token."""
    history = []
    for _ in range(steps):
        history.append(trainer.train_step())
        batch = trainer.last_batch
        assert len(batch) == 16 and batch[GROUP_INDEX].tolist() == torch.arange(4).repeat_interleave(4).tolist()
        versions = batch[TOKEN_VERSIONS][batch[RESPONSE_MASK].bool()]
        trained_against = trainer.actor_version - 1  # the version this step's update started from
        assert trained_against - 1 <= int(versions.min()) and int(versions.max()) <= trained_against
        carried = history[-1]["rollout/groups_carried"]
        if refill:  # 8 decode at once: the 4th group to complete lets no waiting group start
            assert carried <= 8 and any(not any(s.tokens for s in g.samples) for g in trainer.in_flight)
        else:
            assert carried == 4
        assert all(len(s.tokens) <= s.cap for g in trainer.in_flight for s in g.samples)
    return history


@pytest.mark.parametrize("refill", [False, True])
def test_oversampled_steps_train_complete_groups_and_carry_the_rest(tmp_path, ray_local, refill):
    # long, ragged responses: forced lengths 1..12 tokens (ignore_eos), 8 groups in flight for 4 a step; with
    # refill a group that completes lets a waiting one start, so 8 keep decoding until the step has its 4
    trainer = started(tmp_path, [*RAGGED, f"roles.rollout.refill={str(refill).lower()}"])
    try:
        history = in_flight_steps(trainer, 4, refill)
        assert max(m["async/version_lag_max"] for m in history) == 1  # some samples resumed under newer weights
        assert any(s.tokens and not s.finished for g in trainer.in_flight for s in g.samples)  # and some partial
    finally:
        trainer.shutdown()


def test_pipelined_split_pools_generate_the_next_groups_while_the_actor_trains(tmp_path, ray_local):
    # the rollout on a pool of its own generates step k+1's groups (stopping once 4 of 8 are complete) while
    # the actor trains step k
    trainer = started(tmp_path, [*RAGGED, "roles.rollout.refill=false"],
                      ROOT / "examples" / "quickstart-pipelined.yaml")
    try:
        history = in_flight_steps(trainer, 4)
        assert min(m["async/version_lag_max"] for m in history[1:]) >= 1  # generated during the previous step
    finally:
        trainer.shutdown()

