"""Algorithm presets (``algorithm.name``), their merging with explicit settings, the roles they imply (a critic
for GAE, a greedy baseline for ReMax), and the new config keys (critic, reward model, KL controller)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridrl.algorithms.objective import PolicyObjective, apply_preset, resolve_algorithm
from hybridrl.algorithms.plugin import PRESETS
from hybridrl.config import AlgorithmConfig, ConfigError, load_config
from hybridrl.placement.plan import ClusterSpec
from hybridrl.plugins.discovery import get_registry
from hybridrl.plugins.registry import Registry, RegistryError
from hybridrl.run.preflight import check_config, with_algorithm_roles

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"
CPU2 = ClusterSpec(1, 2, "cpu", declared=True)


def test_every_core_component_is_registered_by_the_core_plugin():
    registry = get_registry()
    core = {f"{e.category}:{e.name}" for e in registry.named.values() if e.plugin == "hybridrl.algorithms.plugin"}
    for name in ("gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "remax"):
        assert f"advantage:{name}" in core
    assert {"policy_loss:ppo_clip", "policy_loss:gspo", "kl_estimator:k1", "kl_estimator:k2", "kl_estimator:k3",
            "loss_aggregation:token-mean", "loss_aggregation:seq-mean-token-sum",
            "loss_aggregation:seq-mean-token-mean"} <= core
    for name in ("ppo", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "remax", "gspo"):
        assert f"algorithm:{name}" in core


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_resolves_to_registered_components(name):
    registry = get_registry()
    algo = resolve_algorithm(AlgorithmConfig(name=name), registry)
    for category, value in (("advantage", algo.advantage), ("policy_loss", algo.policy_loss),
                            ("loss_aggregation", algo.loss_agg)):
        assert callable(registry.get(category, value))
    assert algo.uses_critic == (name == "ppo")
    assert algo.greedy_baseline == (name == "remax")


def test_preset_fills_only_what_the_user_left_unset():
    registry = get_registry()
    dr = apply_preset(AlgorithmConfig(name="dr_grpo"), registry)
    assert dr.norm_adv_by_std is False and dr.loss_agg == "seq-mean-token-sum" and dr.advantage == "grpo"
    explicit = apply_preset(AlgorithmConfig(name="dr_grpo", norm_adv_by_std=True, loss_agg="token-mean"), registry)
    assert explicit.norm_adv_by_std is True and explicit.loss_agg == "token-mean"
    gspo = apply_preset(AlgorithmConfig(name="gspo"), registry)
    assert (gspo.clip_low, gspo.clip_high, gspo.policy_loss) == (3e-4, 4e-4, "gspo")
    from_yaml = load_config(QUICKSTART, ["algorithm.name=gspo"]).algorithm  # the quick start sets its clips
    assert apply_preset(from_yaml, registry).clip_high == 0.28
    assert apply_preset(gspo, registry) == gspo  # idempotent: the worker re-applies it to what it is sent


def test_preset_with_unknown_keys_is_refused():
    reg = Registry()
    reg.add_algorithm("odd", {"advantage": "grpo", "clip_lo": 0.1})
    with pytest.raises(RegistryError, match="clip_lo"):
        apply_preset(AlgorithmConfig(name="odd"), reg)


def test_policy_objective_uses_the_preset_loss():
    objective = PolicyObjective(AlgorithmConfig(name="gspo"), get_registry())
    assert objective.policy_loss.__name__ == "gspo" and objective.aggregate.__name__ == "seq_mean_token_mean"
    assert objective.settings.clip_low == 3e-4


def test_ppo_adds_a_critic_with_the_actor_and_grpo_drops_an_unused_one():
    registry = get_registry()
    cfg = load_config(QUICKSTART, ["algorithm.name=ppo"])
    assert cfg.roles.critic is None
    ppo, notes = with_algorithm_roles(cfg, registry)
    assert ppo.roles.critic is not None and ppo.algorithm.advantage == "gae" and notes
    _, plan, problems = check_config(cfg, registry, CPU2)
    assert not problems and "critic" in plan.group_of("actor").roles  # fused into the actor's process
    grpo, notes = with_algorithm_roles(load_config(QUICKSTART, ["roles.critic.lr=1e-4"]), registry)
    assert grpo.roles.critic is None and "not used" in notes[0]


@pytest.mark.parametrize("kl", ["algorithm.kl=null", "algorithm.kl.coef=0"])
def test_no_reference_is_started_without_a_kl_term(kl):
    registry = get_registry()
    cfg = load_config(QUICKSTART, [kl])
    assert cfg.roles.ref is not None  # the quick start configures one
    run_cfg, notes = with_algorithm_roles(cfg, registry)
    assert run_cfg.roles.ref is None and any("no reference policy" in n for n in notes)
    _, plan, problems = check_config(cfg, registry, CPU2)
    assert not problems and "ref" not in plan.role_pool
    kept, _ = with_algorithm_roles(load_config(QUICKSTART), registry)
    assert kept.roles.ref is not None


def test_critic_on_its_own_pool_and_gae_picked_by_key():
    cfg = load_config(QUICKSTART, ["algorithm.advantage=gae", "pools.value={devices_per_node: 1}",
                                   "roles.critic.pool=value"])
    _, plan, problems = check_config(cfg, get_registry(), CPU2)
    assert not problems
    assert plan.role_pool["critic"] == "value" and "critic" not in plan.group_of("actor").roles


def test_new_config_keys_are_validated():
    def problems(*overrides: str) -> dict[str, str]:
        with pytest.raises(ConfigError) as err:
            load_config(QUICKSTART, list(overrides))
        return dict(err.value.problems)

    assert "roles.critic.cliprange_value" in problems("roles.critic.cliprange_value=-1")
    assert "roles.critic.lrr" in problems("roles.critic.lrr=1")
    assert "algorithm.lam" in problems("algorithm.lam=1.5")
    assert "target" in problems("algorithm.kl.controller=adaptive", "algorithm.kl.as=reward")["algorithm.kl"]
    assert "kl.as=reward" in problems("algorithm.kl.controller=adaptive", "algorithm.kl.target=3")["algorithm.kl"]
    assert "exactly one" in problems("roles.reward.model.coef=2")["roles.reward.model"]
    assert "roles.reward.fn" in problems("roles.reward.fn=null")["roles.reward"]
    assert "reward model" in problems("roles.reward.pool=main")["roles.reward"]
    ok = load_config(QUICKSTART, ["algorithm.kl.controller=adaptive", "algorithm.kl.as=reward",
                                  "algorithm.kl.target=2", "roles.reward.model.tiny.hidden_size=32"])
    assert ok.algorithm.kl.horizon == 10000 and ok.roles.reward.backend == "fsdp"


def test_reward_model_role_is_placed_with_the_actor_or_on_its_pool():
    registry = get_registry()
    cfg = load_config(QUICKSTART, ["roles.reward.model.tiny.hidden_size=32"])
    _, plan, problems = check_config(cfg, registry, CPU2)
    assert not problems and "reward" in plan.group_of("actor").roles
    split = load_config(QUICKSTART, ["roles.reward.model.tiny.hidden_size=32", "pools.rm={devices_per_node: 1}",
                                     "roles.reward.pool=rm"])
    _, plan, problems = check_config(split, registry, CPU2)
    assert not problems and plan.role_pool["reward"] == "rm"
    bad = load_config(QUICKSTART, ["roles.reward.model.path=/nowhere", "roles.critic.loss_agg=nope",
                                   "algorithm.name=ppo"])
    _, _, problems = check_config(bad, registry, CPU2)
    keys = dict(problems)
    assert "roles.reward.model.path" in keys and "roles.critic.loss_agg" in keys


def test_unknown_algorithm_and_estimator_are_reported_with_their_keys():
    registry = get_registry()
    _, _, problems = check_config(load_config(QUICKSTART, ["algorithm.name=ppo2"]), registry, CPU2)
    assert "algorithm.name" in dict(problems) and "ppo" in dict(problems)["algorithm.name"]
    _, _, problems = check_config(load_config(QUICKSTART, ["algorithm.advantage=gea"]), registry, CPU2)
    assert "gae" in dict(problems)["algorithm.advantage"]
