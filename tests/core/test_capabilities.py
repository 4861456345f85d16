"""Capabilities are declared at registration and read from the registry: pre-flight refuses what a backend
does not declare (a critic head, checkpoints, more ranks than it spans), turns the sync check off without
greedy margins, and never imports an engine to find out."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hybridrl.config import ConfigError, load_config
from hybridrl.placement.plan import ClusterSpec
from hybridrl.plugins.discovery import get_registry
from hybridrl.plugins.registry import Registry, RegistryError
from hybridrl.run.preflight import check_config, prepare_run

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"
CPU2 = ClusterSpec(1, 2, "cpu")


def config_problems(overrides: list[str]) -> dict[str, str]:
    cfg = load_config(QUICKSTART, ["plugins=[_preflight_helpers]", *overrides])
    _, _, problems = check_config(cfg, get_registry(tuple(cfg.plugins)), CPU2)
    return dict(problems)


def test_an_unknown_capability_is_refused_with_the_known_ones():
    registry = Registry()
    known = r"\(known: checkpoint, fused_layer_kernels, greedy_margins"
    with pytest.raises(RegistryError, match=r"unknown capability 'checkpiont' " + known):
        registry.add_train_engine("typo", "x:y", supports={"checkpiont"})
    with pytest.raises(RegistryError, match="max_ranks must be at least 1"):
        registry.add_rollout("zero", "x:y", max_ranks=0)


def test_the_built_in_backends_declare_what_they_do():
    registry = get_registry()
    assert registry.backend("train", "fsdp").supports >= {"checkpoint", "greedy_margins", "value_head", "reward_head"}
    assert not registry.backend("train", "megatron").can("reward_head")
    assert registry.backend("rollout", "hf").supports == {"sleep", "named_weights", "lora_adapters", "partial",
                                                          "refill", "return_routing"}
    assert registry.backend("train", "fsdp").can("routing_replay")
    assert not registry.backend("train", "megatron").can("routing_replay")
    assert registry.backend("train", "fsdp").can("lora") and not registry.backend("train", "megatron").can("lora")


def test_a_backend_spanning_one_rank_is_refused_a_pool_of_two_without_being_imported():
    problems = config_problems(["roles.actor.backend=ghost_one_rank", "roles.ref.backend=fsdp",
                                "pools.main.devices_per_node=2"])
    assert "spans at most 1 rank" in problems["pools.main"]
    assert "roles.actor runs on 2 devices" in problems["pools.main"]
    assert "nowhere_at_all" not in sys.modules
    assert "pools.main" not in config_problems(["roles.actor.backend=ghost_one_rank", "roles.ref.backend=fsdp"])


def test_rollout_tensor_parallelism_needs_a_backend_that_splits_an_engine():
    two = ["pools.main.devices_per_node=2", "roles.rollout.tensor_parallel=2"]
    assert "one engine per rank" in config_problems(two)["roles.rollout.tensor_parallel"]  # hf
    assert "roles.rollout.tensor_parallel" not in config_problems([*two, "roles.rollout.backend=vllm"])
    assert get_registry().backend("rollout", "sglang").can("tensor_parallel")


def test_a_critic_needs_a_backend_with_a_value_head():
    problems = config_problems(["algorithm.name=ppo", "roles.critic.backend=ghost_one_rank"])
    assert "has no value head for roles.critic" in problems["roles.critic.backend"]
    assert "'value_head'" in problems["roles.critic.backend"]


def test_resume_needs_a_backend_that_loads_checkpoints(tmp_path):
    from hybridrl.run import checkpoint as ckpt

    out = tmp_path / "run"

    def write(folder: Path) -> dict:
        ckpt.save_driver_state(folder, {"step": 2})
        return {"roles": {"actor": "nockpt"}}

    ckpt.save_checkpoint(out, 2, write, keep=0)
    cfg = load_config(QUICKSTART, ["plugins=[_preflight_helpers]", "roles.actor.backend=nockpt",
                                   "roles.ref.backend=fsdp", f"trainer.out={out}"])
    with pytest.raises(ConfigError) as err:
        prepare_run(cfg, get_registry(tuple(cfg.plugins)), CPU2)
    reasons = dict(err.value.problems)
    assert "the 'nockpt' backend of roles.actor cannot load checkpoints" in reasons["trainer.resume"]


def test_the_sync_check_is_turned_off_with_a_note_without_greedy_margins(tmp_path):
    cfg = load_config(QUICKSTART, ["plugins=[_preflight_helpers]", "roles.actor.backend=ghost_one_rank",
                                   "roles.ref.backend=fsdp", "trainer.sync_check_every=1",
                                   f"trainer.out={tmp_path / 'run'}"])
    setup = prepare_run(cfg, get_registry(tuple(cfg.plugins)), CPU2)
    assert setup.cfg.trainer.sync_check_every == 0
    assert any("sync_check_every is off" in n and "ghost_one_rank" in n for n in setup.notes)


def test_typed_training_settings_reach_the_engine_and_backend_options_stay_its_own():
    from hybridrl.runtime.launch import role_settings

    cfg = load_config(QUICKSTART, ["roles.actor.lr=0.02", "roles.actor.betas=[0.8,0.95]", "roles.actor.mini_batch=128",
                                   "roles.actor.options.gradient_checkpointing=true", "roles.ref.micro_batch=8"])
    training, options = role_settings(cfg, "actor")
    assert (training.lr, training.betas, training.micro_batch) == (0.02, (0.8, 0.95), 256)
    assert options == {"gradient_checkpointing": True}  # mini_batch is the driver's, not the engine's
    ref_training, ref_options = role_settings(cfg, "ref")
    assert ref_training.micro_batch == 8 and ref_options == {}
    _, rollout = role_settings(cfg, "rollout")
    assert rollout["max_new_tokens"] == 3  # a rollout gets its typed keys as options


@pytest.mark.parametrize("overrides, key, reason", [
    (["roles.actor.options.gradient_checkpointing=maybe"], "roles.actor.options.gradient_checkpointing",
     "must be one of true, false, auto"),
    (["roles.actor.options.grad_checkpointing=true"], "roles.actor.options.grad_checkpointing",
     "unknown option of the fsdp backend"),
    (["roles.actor.backend=megatron", "roles.ref.backend=megatron", "roles.actor.max_tokens_per_micro_batch=512"],
     "roles.actor.max_tokens_per_micro_batch", "not supported by the megatron backend"),
    (["roles.rollout.backend=vllm", "roles.rollout.options.gpu_memory_utilization=1.5"], "roles.rollout.options",
     "gpu_memory_utilization"),
])
def test_each_backend_checks_its_own_settings_before_any_process_starts(overrides, key, reason):
    problems = config_problems(overrides)
    assert key in problems and reason in problems[key], problems
