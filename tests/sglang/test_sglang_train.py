"""The SGLang rollout on the MoE quick start's model (a tiny Qwen3-MoE). Needs SGLang and a GPU.

* The engine alone against transformers: its greedy tokens and log-probs are those of the float32 reference with
  the same (bf16-rounded) weights, as loaded from the folder and after a sync of per-expert tensors (the names a
  trainer exports) into SGLang's fused expert tensors.
* GRPO through the trainer, colocated with the FSDP actor: the rollout holds the actor's weights after every sync
  (the trainer's sync check, ``rollout/logp_diff``), and with routing replay SGLang's routing reaches the actor.

bfloat16 on the engine (SGLang 0.5.16 refuses float32), so the tolerances are those of the engine tests; a large
learning rate moves every weight each step, so experts that missed a sync would show at once."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hybridrl.config import load_config
from hybridrl.engines import EngineContext, SamplingParams
from hybridrl.plugins.discovery import get_registry
from hybridrl.run.preflight import prepare_run
from hybridrl.run.trainer import Trainer
from hybridrl.runtime.cluster import detect_cluster
from hybridrl.testing.batches import prompt_batch
from hybridrl.testing.checks import reference_problems
from hybridrl.testing.reference import ReferenceModel

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
#: (log-prob atol, greedy near-tie tolerance, widening per largest logit), as tests/sglang/test_sglang_engine.py
TOLERANCE = (0.1, 0.05, 2**-5)
PROMPTS = [[3, 5, 6, 7], [8, 9], [11, 12, 13, 14, 15], [20, 21, 22], [30, 4], [40, 41, 42, 43, 44, 45]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(t.dtype) if t.is_floating_point() else t


def test_moe_greedy_equals_transformers_before_and_after_a_sync(tmp_path):
    """Tells a forward that differs from transformers apart from experts that a sync misplaces."""
    from hybridrl.model.tiny import build_tiny_model
    from hybridrl.weights.experts import to_checkpoint_layout
    from hybridrl_sglang.engine import SGLangRollout

    tiny = load_config(QUICKSTART_MOE, ON_SGLANG).model.tiny
    path = build_tiny_model(tiny, tmp_path / "moe")
    reference = ReferenceModel(path)
    with torch.no_grad():  # the engine casts the folder's weights to bf16 at load: the reference holds the same
        for p in reference.model.parameters():
            p.copy_(_bf16(p))
    eos = [int(reference.model.generation_config.eos_token_id or reference.model.config.eos_token_id)]
    engine = SGLangRollout(EngineContext(role="rollout", backend="sglang", model_path=str(path), rank=0,
                                         world_size=1, device="cuda", dtype="bfloat16", seed=0, trainable=False,
                                         options={"gpu_memory_utilization": 0.3, "enforce_eager": True}))
    try:
        batch = prompt_batch(PROMPTS, pad_id=0)
        tokens, logps = reference_problems(engine.generate(batch, GREEDY), PROMPTS, reference, GREEDY, eos,
                                           *TOLERANCE)
        assert not tokens + logps, "as loaded from the folder"
        gen = torch.Generator().manual_seed(1)
        moved = {n: _bf16(p.detach() + 0.05 * torch.randn(p.shape, generator=gen))
                 for n, p in reference.model.named_parameters()}
        reference.load(moved.items())
        named = list(to_checkpoint_layout(moved.items()))  # per-expert names, as a trainer exports them
        assert any(".experts.0.gate_proj." in n for n, _ in named)
        for i in range(0, len(named), 4):
            engine.import_weights(named[i:i + 4])
        engine.finish_weight_import()
        tokens, logps = reference_problems(engine.generate(batch, GREEDY), PROMPTS, reference, GREEDY, eos,
                                           *TOLERANCE)
        assert not tokens + logps, "after a sync of per-expert tensors"
    finally:
        engine.close()


@pytest.fixture(scope="module")
def ray_gpu():
    import ray

    ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, configure_logging=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    yield
    ray.shutdown()


# On one H100 (SGLang 0.5.16) both arms once failed the trainer's sync check at step 1 (12 of 12 greedy tokens off
# the actor's argmax) while the kit's routing check passed: the tiny MoE was built with a tied head, which SGLang's
# Qwen3-MoE ignores (it loads lm_head.weight, which a tied checkpoint does not hold). The tiny MoE now has a head
# of its own, as every Qwen3-MoE checkpoint, and the engine refuses a tied one (compat.check_architecture).
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
