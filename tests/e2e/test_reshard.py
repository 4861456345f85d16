"""End to end on CPU with Ray: after every reshard the rollout's weights equal the actor's, colocated
(in-process bridge) and split over two pools (object-store bridge)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridrl.config import load_config
from hybridrl.plugins.discovery import get_registry
from hybridrl.run.preflight import prepare_run
from hybridrl.run.trainer import Trainer
from hybridrl.runtime.cluster import detect_cluster

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"

# The entropy bonus moves the weights even when every sample of the untrained model scores 0 (no advantage),
# so each reshard has new weights to carry.
SMALL = ["trainer.steps=2", "data.prompts_per_step=4", "algorithm.n_samples=4", "trainer.progress=false",
         "trainer.trackers=[jsonl]", "roles.actor.lr=1e-2", "algorithm.entropy_coef=0.01"]
LAYOUTS = {
    "colocated-1": [],
    "colocated-2": ["pools.main.devices_per_node=2"],
    "split": ["pools={train: {devices_per_node: 1}, gen: {devices_per_node: 1}}", "roles.actor.pool=train",
              "roles.ref.pool=train", "roles.rollout.pool=gen"],
    "split-object-store": ["pools={train: {devices_per_node: 1}, gen: {devices_per_node: 1}}",
                           "roles.actor.pool=train", "roles.ref.pool=train", "roles.rollout.pool=gen",
                           "roles.rollout.weight_transport=object_store"],
    "split-2x2": ["pools={train: {devices_per_node: 2}, gen: {devices_per_node: 2}}", "roles.actor.pool=train",
                  "roles.ref.pool=train", "roles.rollout.pool=gen", "roles.rollout.bucket_mb=0.5",
                  "cluster.devices_per_node=4", "cluster.device=cpu"],
}


def weights(trainer: Trainer, role: str) -> list[dict[str, torch.Tensor]]:
    return trainer.groups[role].call_all("weights", role)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_rollout_weights_equal_actor_after_every_reshard(layout, tmp_path, ray_local):
    cfg = load_config(QUICKSTART, [*SMALL, *LAYOUTS[layout], f"trainer.out={tmp_path}"])
    trainer = Trainer(prepare_run(cfg, get_registry(), detect_cluster(cfg.cluster)))
    try:
        trainer.start()
        initial = weights(trainer, "actor")[0]
        for _ in range(2):
            metrics = trainer.train_step()
            actor = weights(trainer, "actor")
            assert all(set(a) == set(actor[0]) and all(torch.equal(a[k], actor[0][k]) for k in a) for a in actor)
            for replica in weights(trainer, "rollout"):
                for name, tensor in actor[0].items():
                    assert torch.equal(replica[name], tensor), f"{layout}: {name} differs after reshard"
            assert metrics["reshard/bytes"] > 0
        changed = [k for k in initial if not torch.equal(initial[k], actor[0][k])]
        assert changed, "the actor's weights never changed, so the check above proved nothing"
        if layout.startswith("split"):
            assert "split pools" in trainer.setup.plan.render()
            expected = "ObjectStoreBridge" if "object-store" in layout else "BroadcastBridge"
            assert type(trainer.bridge).__name__ == expected
    finally:
        trainer.shutdown()


def test_sync_check_passes_after_real_syncs_and_catches_a_wrong_rollout(tmp_path, ray_local):
    """``trainer.sync_check_every=1``: after every sync the rollout's greedy tokens are the actor's argmax; once
    the rollout is given other weights (as a broken reshard would leave it), the check reports it."""
    cfg = load_config(QUICKSTART, [*SMALL, "trainer.sync_check_every=1", f"trainer.out={tmp_path}"])
    trainer = Trainer(prepare_run(cfg, get_registry(), detect_cluster(cfg.cluster)))
    try:
        trainer.start()
        for _ in range(2):
            metrics = trainer.train_step()
            assert metrics["sync_check/tokens"] > 0 and metrics["sync_check/off_argmax"] == 0, metrics
            assert metrics["sync_check/argmax_fraction"] > 0.95
        gen = torch.Generator().manual_seed(0)
        noisy = [(name, t + torch.randn(t.shape, generator=gen)) for name, t in weights(trainer, "actor")[0].items()]
        rollout = trainer.groups["rollout"]
        rollout.broadcast("rollout", "import_weights", noisy)
        rollout.broadcast("rollout", "finish_weight_import")
        broken = trainer.check_sync(trainer.prompt_batch())
        assert broken["sync_check/off_argmax"] > 0 and broken["sync_check/argmax_fraction"] < 0.9, broken
    finally:
        trainer.shutdown()
