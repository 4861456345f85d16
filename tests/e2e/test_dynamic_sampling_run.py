"""Dynamic sampling and truncated responses in a real run (Ray, the FSDP actor, the transformers rollout):
a step trains on exactly ``data.prompts_per_step`` informative groups, masked truncated rows leave the update,
and a task whose groups never differ stops the run with its sentence instead of looping."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridrl.config import load_config
from hybridrl.engines.batch import GROUP_INDEX, SCORES
from hybridrl.plugins.discovery import get_registry
from hybridrl.run.dynamic_sampling import GroupsNeverDiffer
from hybridrl.run.preflight import prepare_run
from hybridrl.run.trainer import Trainer
from hybridrl.runtime.cluster import detect_cluster

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"
SMALL = ["data.prompts_per_step=4", "algorithm.n_samples=4", "trainer.progress=false", "trainer.trackers=[jsonl]",
         "roles.reward.runner=inline"]


def started(tmp_path: Path, overrides: list[str]) -> Trainer:
    cfg = load_config(QUICKSTART, [*SMALL, *overrides, f"trainer.out={tmp_path}"])
    trainer = Trainer(prepare_run(cfg, get_registry(), detect_cluster(cfg.cluster)))
    trainer.start()
    return trainer


def informative_steps(trainer: Trainer, steps: int) -> list[dict[str, float]]:
    """``steps`` steps, each checked to train four groups of four whose samples all disagree."""
    history = []
    for _ in range(steps):
        history.append(trainer.train_step())
        batch = trainer.last_batch
        assert len(batch) == 16 and batch[GROUP_INDEX].tolist() == torch.arange(4).repeat_interleave(4).tolist()
        for group in range(4):
            scores = batch[SCORES][batch[GROUP_INDEX] == group]
            assert scores.max() > scores.min()  # every trained group's samples disagree
        assert 0.0 <= history[-1]["filter/dropped_share"] < 1.0
    return history


def test_a_step_trains_on_informative_groups_only(tmp_path, ray_local):
    # 3 new tokens for a 2-digit reversal plus its stop: many responses run out of tokens and are masked
    trainer = started(tmp_path, ["algorithm.filter_groups=true", "algorithm.max_refills=20", "algorithm.overlong=mask",
                                 "roles.rollout.max_new_tokens=3"])
    try:
        for metrics in informative_steps(trainer, 2):
            assert metrics["filter/refills"] >= 0
            assert 0.0 <= metrics["overlong/masked_share"] <= 1.0
            assert metrics["response_length/clip_ratio"] >= 0.0
    finally:
        trainer.shutdown()


def test_groups_in_flight_keep_only_their_informative_groups(tmp_path, ray_local):
    # ragged forced lengths, 8 groups in flight for 4 a step (roles.rollout.oversample): the uniform ones among
    # the first to complete are dropped and the step waits for more
    trainer = started(tmp_path, ["algorithm.filter_groups=true", "algorithm.max_refills=20",
                                 "roles.rollout.oversample=2", "roles.rollout.max_new_tokens=12",
                                 "roles.rollout.ignore_eos=true",
                                 "roles.rollout.response_lengths={median: 4, sigma: 1}"])
    try:
        informative_steps(trainer, 2)
    finally:
        trainer.shutdown()


def test_groups_that_never_differ_stop_the_run(tmp_path, ray_local):
    trainer = started(tmp_path, ["algorithm.filter_groups=true", "algorithm.max_refills=1",
                                 "roles.reward.fn=_constant_reward:zero"])
    try:
        with pytest.raises(GroupsNeverDiffer, match="algorithm.filter_groups: 2 prompt batches"):
            trainer.train_step()
    finally:
        trainer.shutdown()
