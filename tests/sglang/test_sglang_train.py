"""GRPO through the trainer with the SGLang rollout on the MoE quick start (a tiny Qwen3-MoE), colocated with the
FSDP actor on one GPU: the trainer's per-expert weights must reach SGLang's fused expert tensors at every sync,
and with routing replay SGLang returns each token's experts for the actor to route by. Needs SGLang and a GPU.

bfloat16 on both sides (SGLang 0.5.16 refuses float32), so the tolerances are those of two bf16 kernels; a
large learning rate moves every weight each step, so experts that missed a sync would show at once."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hybridrl.config import load_config
from hybridrl.plugins.discovery import get_registry
from hybridrl.run.preflight import prepare_run
from hybridrl.run.trainer import Trainer
from hybridrl.runtime.cluster import detect_cluster

pytestmark = [pytest.mark.sglang, pytest.mark.gpu]

QUICKSTART_MOE = Path(__file__).resolve().parents[2] / "examples" / "quickstart-moe.yaml"
#: head size 64 (hidden 128 over 2 heads) suits SGLang's default attention kernels; bf16 on the GPU
ON_SGLANG = ["trainer.steps=3", "data.prompts_per_step=4", "algorithm.n_samples=4", "trainer.progress=false",
             "trainer.trackers=[jsonl]", "roles.actor.lr=1e-2", "trainer.sync_check_every=1",
             "roles.rollout.log_probs=true", "roles.rollout.backend=sglang", "model.dtype=bfloat16",
             "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1", "cluster.device=cuda",
             "roles.rollout.options={gpu_memory_utilization: 0.3, enforce_eager: true}"]
#: |rollout - actor| log-prob per token, both in bf16 (a missed expert sync moves it by tenths)
LOGP_DIFF_BF16 = 0.05
ARMS = {"synced": [], "replayed": ["algorithm.routing_replay=true"]}


@pytest.fixture(scope="module")
def ray_gpu():
    import ray

    ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, configure_logging=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    yield
    ray.shutdown()


@pytest.mark.parametrize("arm", list(ARMS))
def test_moe_experts_reach_sglang_after_every_sync(arm, tmp_path, ray_gpu):
    cfg = load_config(QUICKSTART_MOE, [*ON_SGLANG, *ARMS[arm], f"trainer.out={tmp_path}"])
    trainer = Trainer(prepare_run(cfg, get_registry(), detect_cluster(cfg.cluster)))
    try:
        trainer.start()
        diffs = []
        for _ in range(3):
            metrics = trainer.train_step()
            assert metrics["reshard/bytes"] > 0
            diffs.append(metrics["rollout/logp_diff"])
            assert metrics["sync_check/tokens"] > 0 and metrics["sync_check/off_argmax"] == 0, metrics
            if arm == "replayed":  # SGLang's routing reached the actor: the mismatch is measured and replayed
                assert "moe/routing_mismatch" in metrics, sorted(metrics)
        assert max(diffs) < LOGP_DIFF_BF16, f"{arm}: rollout and actor log-probs differ by {diffs}"
    finally:
        trainer.shutdown()
