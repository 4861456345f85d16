"""LoRA, engine-free: the sync mode chosen from the placement, adapters paired and merged (the transformers
rollout's merge starts from the base at every sync), pre-flight's refusals by key path, and the memory plan
counting the base and the adapters apart (the adapter count checked against peft on the real architecture)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridrl.config import ConfigError, load_config
from hybridrl.lora import LoraSpec, MergedAdapters, adapter_name, merged_weight, pair_adapters, resolve_sync
from hybridrl.placement.lora_memory import adapter_params
from hybridrl.placement.memory import GIB, estimate_memory, model_shape
from hybridrl.placement.plan import ClusterSpec, plan_placement, resolve_backends
from hybridrl.plugins.discovery import get_registry
from hybridrl.run.lora_setup import with_lora
from hybridrl.run.preflight import check_config, prepare_run

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"
COLOCATED = ROOT / "examples" / "qwen7b-colocated.yaml"
QWEN7B = ROOT / "examples" / "configs" / "qwen2.5-7b"
SPLIT = ["pools={train: {devices_per_node: 1}, gen: {devices_per_node: 1}}", "roles.actor.pool=train",
         "roles.ref.pool=train", "roles.rollout.pool=gen"]


def test_sync_auto_is_merged_in_one_process_and_adapters_across():
    assert resolve_sync("auto", same_process=True, rollout_serves_adapters=True)[0] == "merged"
    assert resolve_sync("auto", same_process=False, rollout_serves_adapters=True)[0] == "adapter"
    assert resolve_sync("auto", same_process=False, rollout_serves_adapters=False)[0] == "merged"
    assert resolve_sync("adapter", same_process=True, rollout_serves_adapters=True)[0] == "adapter"
    spec = LoraSpec.from_config({"rank": 8, "sync": "adapter"})
    assert spec.alpha == 16.0 and spec.scaling == 2.0 and spec.sends_adapters


def test_merge_starts_from_the_base_at_every_sync():
    """Two syncs merged in turn give W0 + s B2 A2, not W0 + s B1 A1 + s B2 A2; bad adapter sets are named."""
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(6, 5, generator=gen)
    module = "model.layers.0.mlp.up_proj"
    live = {f"{module}.weight": w0.clone()}
    merger = MergedAdapters(lambda: live, scaling=0.5)
    for _ in range(2):
        a, b = torch.randn(2, 5, generator=gen), torch.randn(6, 2, generator=gen)
        expected = w0 + 0.5 * (b @ a)
        merger.stage(adapter_name(module, "A"), a)
        merger.stage(adapter_name(module, "B"), b)
        a.zero_()  # the bucket's buffer reused: the stage kept copies
        assert merger.apply() == 1
        torch.testing.assert_close(live[f"{module}.weight"], expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(merged_weight(w0, a, b, 0.5), w0)  # A zeroed: the base
    with pytest.raises(ValueError, match="lora_B"):
        pair_adapters([(adapter_name(module, "A"), a)])
    with pytest.raises(ValueError, match="not a LoRA adapter"):
        pair_adapters([(f"{module}.weight", a)])
    merger.stage(adapter_name("model.layers.9.mlp.up_proj", "A"), a)
    merger.stage(adapter_name("model.layers.9.mlp.up_proj", "B"), b)
    with pytest.raises(KeyError, match="layers.9"):
        merger.apply()


def _checked(overrides: list[str]):
    cfg = load_config(QUICKSTART, overrides)
    registry = get_registry()
    cluster = ClusterSpec(1, 2, "cpu", declared=True)
    backends, plan, problems = check_config(cfg, registry, cluster)
    return cfg, backends, plan, problems


def test_preflight_resolves_the_sync_and_refuses_by_key_path(tmp_path):
    cfg, backends, plan, problems = _checked(["roles.actor.lora={rank: 4}"])
    assert not problems
    run_cfg, notes = with_lora(cfg, plan, backends)
    assert run_cfg.roles.actor.lora.sync == "merged" and cfg.roles.actor.lora.sync == "auto"
    assert any(n.startswith("auto: roles.actor.lora.sync=merged") for n in notes)
    assert any(n.startswith("roles.ref: the LoRA actor's base") for n in notes)
    cfg, backends, plan, problems = _checked(["roles.actor.lora={rank: 4}", *SPLIT])
    run_cfg, notes = with_lora(cfg, plan, backends)
    assert run_cfg.roles.actor.lora.sync == "adapter"
    assert any(n.startswith("roles.ref: the LoRA actor's base") for n in notes)  # the ref stays with the actor
    cfg, backends, plan, _ = _checked(["roles.actor.lora={rank: 4}", *SPLIT, "roles.ref.pool=gen"])
    assert any("loads the base model itself" in n for n in with_lora(cfg, plan, backends)[1])

    _, _, _, problems = _checked(["roles.actor.lora={rank: 4}", "roles.actor.backend=megatron",
                                  "roles.ref.backend=megatron"])
    assert any(key == "roles.actor.lora" and "'lora' capability" in msg for key, msg in problems), problems
    with pytest.raises(ConfigError, match="roles.actor.lora.target_modules"):
        load_config(QUICKSTART, ["roles.actor.lora={rank: 4, target_modules: []}"])
    cfg = load_config(QUICKSTART, ["roles.actor.lora={rank: 4, target_modules: [q_proj, qq_proj]}",
                                   f"trainer.out={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match="roles.actor.lora.target_modules.*'qq_proj'"):
        prepare_run(cfg, get_registry(), ClusterSpec(1, 2, "cpu", declared=True))
    assert not (tmp_path / "run").exists()  # refused before anything was written


def _estimate(overrides: list[str]):
    cfg = load_config(COLOCATED, overrides)
    registry = get_registry()
    backends, problems = resolve_backends(cfg, registry, check_engines=False)
    assert not problems
    plan = plan_placement(cfg, ClusterSpec(1, 8, "cuda", declared=True), backends)
    cfg, _ = with_lora(cfg, plan, backends)
    shape, _ = model_shape(cfg, base_dirs=(ROOT,))
    return shape, {m.role: m for m in estimate_memory(cfg, plan, shape, 80 * GIB).roles}


def test_adapter_count_is_peft_count_on_the_real_architecture():
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(QWEN7B)
    config.num_hidden_layers = 2  # the per-layer count is what matters; two layers keep it quick
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    cfg = load_config(COLOCATED, [f"model.path={QWEN7B}"])
    shape, _ = model_shape(cfg, base_dirs=(ROOT,))
    for targets in ("all-linear", ("q_proj", "v_proj")):
        spec = LoraSpec(rank=8, alpha=16.0, target_modules=targets)
        with torch.device("meta"):
            peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=(
                targets if isinstance(targets, str) else list(targets))))
        counted = sum(p.numel() for n, p in peft_model.named_parameters() if ".lora_" in n)
        assert adapter_params(shape, spec) == counted * shape.num_layers // 2, targets
        model = peft_model.unload()


def test_plan_counts_base_and_adapters_apart():
    shape, full = _estimate([])
    _, lora = _estimate(["roles.actor.lora={rank: 16}"])
    spec = LoraSpec(rank=16, alpha=32.0)
    adapters = adapter_params(shape, spec)
    actor, dp = lora["actor"], 8
    assert actor.adapters == pytest.approx(4 * adapters / dp)
    assert actor.weights == pytest.approx(2 * shape.param_count() / dp + actor.adapters)  # bf16 base + fp32 adapters
    assert actor.optimizer == pytest.approx(8 * adapters / dp) and actor.grads == pytest.approx(4 * adapters / dp)
    assert actor.optimizer < full["actor"].optimizer / 100
    assert any(n.startswith("LoRA r=16: base") for n in actor.notes)
    assert lora["ref"].weights == 0 and lora["ref"].idle == 0  # the actor's base, no copy
    assert full["rollout"].adapters == 0 and lora["rollout"].adapters == 0  # merged: full weights, no slots


def test_plan_of_a_rollout_sent_adapters_keeps_its_base_asleep():
    shape, merged = _estimate(["roles.actor.lora={rank: 12}", "roles.rollout.backend=vllm"])
    _, adapter = _estimate(["roles.actor.lora={rank: 12, sync: adapter}", "roles.rollout.backend=vllm"])
    rollout = adapter["rollout"]
    assert rollout.adapters == pytest.approx(adapter_params(shape, LoraSpec(rank=16, alpha=32.0)) * 2)  # vLLM: rank 16
    assert rollout.weights == pytest.approx(merged["rollout"].weights + rollout.adapters)
    assert rollout.asleep >= rollout.weights > merged["rollout"].asleep  # the base stays on the device
    assert any("the base weights stay loaded" in n for n in rollout.notes)
