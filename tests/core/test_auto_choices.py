"""The ``auto`` settings (``hybridrl.placement.auto``): what each resolves to, why, and that an explicit value is
never overridden; and the plan they are chosen from (``hybridrl.placement.memory``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridrl import hookimpl
from hybridrl.config import RunConfig, load_config
from hybridrl.placement.auto import USABLE_SHARE, resolve_auto
from hybridrl.placement.memory import GIB, read_hf_config, shape_from_hf_config
from hybridrl.placement.plan import ClusterSpec, plan_placement, resolve_backends
from hybridrl.plugins.discovery import get_registry

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "configs"
H200 = 139.8 * GIB


def workload(size: str, *overrides: str, tmp_path: Path) -> RunConfig:
    """The issue's workload (GRPO 64 x 8, 128-token prompts, 256 new tokens, KL loss) on one GPU, README keys only."""
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "12"}\n')
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"""
model: {{path: {CONFIGS / f'qwen2.5-{size}'}, dtype: bfloat16}}
data: {{train: {data}, max_prompt_len: 128, prompts_per_step: 64}}
algorithm: {{name: grpo, n_samples: 8, kl: {{coef: 0.001, estimator: k3, as: loss}}}}
roles:
  rollout: {{backend: vllm, max_new_tokens: 256, min_new_tokens: 256, ignore_eos: true}}
""")
    return load_config(cfg, list(overrides))


def resolve(cfg: RunConfig, device_bytes: float | None = H200, device: str = "cuda", registry=None,
            host_bytes: float | None = None):
    registry = registry or get_registry(tuple(cfg.plugins))
    backends, problems = resolve_backends(cfg, registry, check_engines=False)
    assert not problems
    plan = plan_placement(cfg, ClusterSpec(1, 1, device, declared=True), backends)
    shape = shape_from_hf_config(read_hf_config(cfg.model.path))
    result = resolve_auto(cfg, plan, registry, {r: e.name for r, e in backends.items()}, shape, device_bytes,
                          host_bytes=host_bytes)
    return result, {c.key: c.value for c in result.choices}


def test_rollout_log_probs_are_off_unless_something_reads_them(tmp_path):
    _, choices = resolve(workload("0.5b", tmp_path=tmp_path))
    assert choices["roles.rollout.log_probs"] is False
    result, choices = resolve(workload("0.5b", "algorithm.tis_cap=2.0", tmp_path=tmp_path))
    assert choices["roles.rollout.log_probs"] is True and result.cfg.roles.rollout.log_probs is True
    assert "truncated importance sampling" in next(c.reason for c in result.choices if c.key.endswith("log_probs"))
    for explicit in (True, False):  # a value given is kept and not reported as a choice
        key = f"roles.rollout.log_probs={str(explicit).lower()}"
        result, choices = resolve(workload("0.5b", key, tmp_path=tmp_path))
        assert "roles.rollout.log_probs" not in choices and result.cfg.roles.rollout.log_probs is explicit


def needs_rollout_log_probs(*args, **kwargs):  # pragma: no cover - never called: only its declaration is read
    raise NotImplementedError


needs_rollout_log_probs.needs = ("rollout_log_probs",)


class DeclaringPlugin:
    @hookimpl
    def hybridrl_register_algorithms(self, registry):
        registry.add_policy_loss("reads_rollout", needs_rollout_log_probs)


def test_a_component_that_declares_it_needs_them_turns_them_on(tmp_path):
    from hybridrl.plugins.discovery import build_registry, plugin_manager

    pm = plugin_manager()
    pm.register(DeclaringPlugin(), name="declaring")
    registry = build_registry(pm)  # a registry of its own: the cached one stays as it is
    result, choices = resolve(workload("0.5b", "algorithm.policy_loss=reads_rollout", tmp_path=tmp_path),
                              registry=registry)
    assert choices["roles.rollout.log_probs"] is True
    assert "the policy loss 'reads_rollout'" in next(c.reason for c in result.choices if c.key.endswith("log_probs"))


def test_small_model_on_an_h200_takes_large_micro_batches_and_nothing_else(tmp_path):
    result, choices = resolve(workload("0.5b", tmp_path=tmp_path))
    assert choices["roles.actor.max_tokens_per_micro_batch"] >= 16384
    assert choices["roles.ref.max_tokens_per_micro_batch"] >= choices["roles.actor.max_tokens_per_micro_batch"]
    assert choices["roles.actor.options.gradient_checkpointing"] is False
    assert choices["roles.actor.options.offload"] == choices["roles.ref.options.offload"] == "none"
    (pool,) = result.estimate.pools
    assert pool.peak <= USABLE_SHARE * H200
    assert result.cfg.roles.actor.max_tokens_per_micro_batch == choices["roles.actor.max_tokens_per_micro_batch"]
    assert result.cfg.roles.rollout.options["workload"] == {"sequences": 512, "tokens_per_sequence": 384}


def test_larger_models_take_smaller_micro_batches_then_offload(tmp_path):
    budgets = {}
    for size in ("0.5b", "1.5b", "3b"):
        result, choices = resolve(workload(size, tmp_path=tmp_path))
        budgets[size] = choices["roles.actor.max_tokens_per_micro_batch"]
        assert choices["roles.actor.options.offload"] == "none"
        assert result.estimate.pools[0].peak <= USABLE_SHARE * H200
    assert budgets["0.5b"] > budgets["1.5b"] > budgets["3b"]
    result, choices = resolve(workload("7b", tmp_path=tmp_path))  # 16 bytes a parameter do not fit with the engine
    assert choices["roles.actor.options.offload"] in ("optimizer", "all")
    assert result.estimate.pools[0].peak <= USABLE_SHARE * H200
    assert result.estimate.pools[0].fits


def test_offload_or_checkpointing_on_a_smaller_device(tmp_path):
    result, choices = resolve(workload("1.5b", tmp_path=tmp_path), device_bytes=40 * GIB)
    assert choices["roles.actor.options.offload"] == "optimizer"  # a second of copies beats a recomputed forward
    assert result.estimate.pools[0].peak <= USABLE_SHARE * 40 * GIB
    no_offload = workload("1.5b", "roles.actor.options.offload=none", "roles.ref.options.offload=none",
                          tmp_path=tmp_path)
    result, choices = resolve(no_offload, device_bytes=38 * GIB)  # without checkpointing: a sequence per micro-batch
    assert choices["roles.actor.options.gradient_checkpointing"] is True
    assert "do not fit without it" in next(c.reason for c in result.choices if c.key.endswith("checkpointing"))
    assert choices["roles.actor.max_tokens_per_micro_batch"] >= 1024
    assert result.estimate.pools[0].peak <= USABLE_SHARE * 38 * GIB


def test_the_head_keeps_its_logits_where_they_fit_and_makes_them_again_where_not(tmp_path, monkeypatch):
    """``head_logits: auto``: kept (one GEMM less per micro-batch) where they fit beside the settings chosen without
    them, which they never change; made again where they do not, on CPU and without a fused head; the plan counts
    them."""
    gpu_registry = registry_with_fused_kernels(monkeypatch, True)  # liger-kernel installed, as on the H200 runs
    result, choices = resolve(workload("0.5b", tmp_path=tmp_path), registry=gpu_registry)
    again, again_choices = resolve(workload("0.5b", "roles.actor.options.head_logits=recompute", tmp_path=tmp_path),
                                   registry=gpu_registry)
    assert choices["roles.actor.options.head_logits"] == "keep"
    for key in ("max_tokens_per_micro_batch", "options.gradient_checkpointing", "options.offload"):
        assert choices[f"roles.actor.{key}"] == again_choices[f"roles.actor.{key}"], key
    plain, plain_choices = resolve(workload("0.5b", tmp_path=tmp_path))  # unfused layers: 65536 tokens leave no room
    assert plain_choices["roles.actor.options.head_logits"] == "recompute"
    assert plain_choices["roles.actor.max_tokens_per_micro_batch"] == choices["roles.actor.max_tokens_per_micro_batch"]
    assert "roles.ref.options.head_logits" not in choices  # a frozen role has no backward
    assert result.estimate.pools[0].peak <= USABLE_SHARE * H200
    budget = 16384
    kept, _ = resolve(workload("0.5b", "roles.actor.options.head_logits=keep",
                               f"roles.actor.max_tokens_per_micro_batch={budget}", tmp_path=tmp_path))
    actor = next(m for m in kept.estimate.roles if m.role == "actor")
    again, again_choices = resolve(workload("0.5b", "roles.actor.options.head_logits=recompute",
                                            f"roles.actor.max_tokens_per_micro_batch={budget}", tmp_path=tmp_path))
    assert "roles.actor.options.head_logits" not in again_choices  # an explicit value is kept
    assert again.cfg.roles.actor.options["head_logits"] == "recompute"
    recomputing = next(m for m in again.estimate.roles if m.role == "actor")
    vocab = 151936
    assert actor.activations - recomputing.activations >= budget * vocab * 2  # bf16 logits of every token kept
    small, small_choices = resolve(workload("1.5b", tmp_path=tmp_path), device_bytes=30 * GIB)
    assert small_choices["roles.actor.options.head_logits"] == "recompute"
    assert "would not fit" in next(c.reason for c in small.choices if c.key == "roles.actor.options.head_logits")
    assert small.estimate.pools[0].peak <= USABLE_SHARE * 30 * GIB
    cpu, cpu_choices = resolve(workload("0.5b", "roles.rollout.backend=hf", tmp_path=tmp_path), device_bytes=None,
                               device="cpu")
    assert cpu_choices["roles.actor.options.head_logits"] == "recompute"
    off, off_choices = resolve(workload("0.5b", "roles.actor.options.fused_lm_head=false", tmp_path=tmp_path))
    assert "roles.actor.options.head_logits" not in off_choices  # no fused head: nothing to keep


def test_explicit_settings_are_kept(tmp_path):
    cfg = workload("1.5b", "roles.actor.micro_batch=8", "roles.actor.options.gradient_checkpointing=true",
                   "roles.ref.options.offload=all", tmp_path=tmp_path)
    result, choices = resolve(cfg)
    assert not any(k.startswith(("roles.actor.max_tokens", "roles.ref.max_tokens")) for k in choices)  # ref inherits
    assert "roles.actor.options.gradient_checkpointing" not in choices and "roles.ref.options.offload" not in choices
    assert result.cfg.roles.actor.options["gradient_checkpointing"] is True
    assert result.cfg.roles.ref.options["offload"] == "all"
    assert "roles.actor.options.offload" in choices  # still auto


def test_bad_offload_values_are_refused_with_their_key(tmp_path):
    result, _ = resolve(workload("0.5b", "roles.actor.options.offload=weights", "roles.ref.options.offload=optimizer",
                                 "roles.actor.options.gradient_checkpointing=maybe", tmp_path=tmp_path))
    keys = dict(result.problems)
    assert "roles.actor.options.offload" in keys and "roles.ref.options.offload" in keys
    assert "has no optimizer" in keys["roles.ref.options.offload"]
    assert "true, false or auto" in keys["roles.actor.options.gradient_checkpointing"]


def test_on_cpu_nothing_is_offloaded_or_checkpointed(tmp_path):
    cfg = workload("0.5b", "roles.rollout.backend=hf", tmp_path=tmp_path)
    result, choices = resolve(cfg, device_bytes=None, device="cpu")
    assert choices["roles.actor.options.gradient_checkpointing"] is False
    assert choices["roles.actor.options.offload"] == "none"
    assert "roles.actor.max_tokens_per_micro_batch" not in choices  # the backend's micro-batch
    assert "workload" not in (result.cfg.roles.rollout.options or {})  # the hf rollout sizes its cache by demand


def test_choices_and_the_planned_memory_are_recorded(tmp_path):
    result, choices = resolve(workload("1.5b", tmp_path=tmp_path))
    auto = result.cfg.auto
    assert set(auto["choices"]) == set(choices)
    assert all(entry["reason"] for entry in auto["choices"].values())
    pool = auto["memory"]["pools"]["default"]
    assert pool["peak_mb"] == pytest.approx(result.estimate.pools[0].peak / 2**20)
    assert {"gen", "ref", "update_actor"} <= set(pool["phases_mb"])
    dumped = result.cfg.model_dump(mode="json", by_alias=True)  # what config.json holds
    assert dumped["auto"]["choices"]["roles.rollout.log_probs"]["value"] is False


def test_the_gen_phase_holds_what_the_engine_maps_back(tmp_path):
    result, _ = resolve(workload("1.5b", tmp_path=tmp_path))
    (pool,) = result.estimate.pools
    roles = {m.role: m for m in result.estimate.roles}
    rollout = roles["rollout"]
    assert rollout.kv_cache > 0 and rollout.graphs > 0 and rollout.activations > 0
    trainers = roles["actor"].idle + roles["ref"].idle
    assert pool.phases["gen"] > trainers + rollout.weights + rollout.kv_cache + rollout.graphs
    # asleep, the engine keeps its graphs only: the update phase holds them beside the actor's peak
    assert pool.phases["update_actor"] > roles["actor"].active + roles["ref"].idle + rollout.asleep


def test_the_host_memory_that_offloading_fills_is_planned_and_checked(tmp_path):
    """7B on an H200 offloads the actor's AdamW moments (57 GiB) to the host, beside the rollout's weights asleep:
    on the GPU host (125 GiB) that fits; a 64 GiB host fits no setting, so the device's choice stands with a
    warning, and a plan whose explicit settings overfill the host says so with the keys that lower it."""
    from hybridrl.placement.host_memory import HOST_PROCESS_GIB, HOST_USABLE_SHARE
    from hybridrl.placement.memory import render_memory

    result, choices = resolve(workload("7b", tmp_path=tmp_path), host_bytes=125 * GIB)
    (need,) = result.estimate.host
    assert choices["roles.actor.options.offload"] == "optimizer" and need.fits
    actor = next(m for m in result.estimate.roles if m.role == "actor")
    rollout = next(m for m in result.estimate.roles if m.role == "rollout")
    assert need.parts["actor optimizer"] == actor.optimizer > 50 * GIB
    assert need.parts["rollout weights asleep"] == rollout.weights
    assert need.total == actor.optimizer + rollout.weights + HOST_PROCESS_GIB * GIB
    assert "host memory per node, pool default" in render_memory(result.estimate)
    assert result.cfg.auto["memory"]["host"]["default"]["fits"] is True

    small = 64 * GIB
    result, choices = resolve(workload("7b", tmp_path=tmp_path), host_bytes=small)  # the host fits nothing
    assert choices == resolve(workload("7b", tmp_path=tmp_path))[1]  # so the device's choices, and a warning
    assert any("the host memory does not fit" in c.reason for c in result.choices)
    assert result.estimate.host[0].total > HOST_USABLE_SHARE * small
    assert any("host memory of a node" in w for w in result.estimate.warnings)

    explicit = workload("7b", "roles.actor.options.offload=all", "roles.ref.options.offload=all", tmp_path=tmp_path)
    result, _ = resolve(explicit, host_bytes=small)
    assert result.estimate.host[0].fits is False
    warning = next(w for w in result.estimate.warnings if "host memory" in w)
    assert "64 GiB" in warning and "roles.<role>.options.offload" in warning and "actor optimizer" in warning

    # unknown host memory: the need is shown, nothing is refused
    result, choices = resolve(workload("7b", tmp_path=tmp_path))
    assert result.estimate.host[0].fits is None and choices["roles.actor.options.offload"] == "optimizer"


def test_a_small_host_turns_offloading_into_checkpointing(tmp_path):
    """1.5B on a 40 GiB device offloads the actor's moments (12 GiB); a host that cannot hold them beside the
    rollout's weights gets the settings that keep everything on the device instead."""
    _, roomy = resolve(workload("1.5b", tmp_path=tmp_path), device_bytes=40 * GIB, host_bytes=64 * GIB)
    assert roomy["roles.actor.options.offload"] == "optimizer"
    result, tight = resolve(workload("1.5b", tmp_path=tmp_path), device_bytes=40 * GIB, host_bytes=16 * GIB)
    assert tight["roles.actor.options.offload"] == "none"
    assert tight["roles.actor.options.gradient_checkpointing"] is True
    assert result.estimate.host[0].fits and result.estimate.pools[0].fits


def test_host_memory_counts_every_device_of_a_node(tmp_path):
    """On 8 GPUs a node holds eight shards of what is offloaded (the whole of it) and eight worker processes."""
    from hybridrl.placement.host_memory import HOST_PROCESS_GIB

    cfg = workload("7b", "roles.actor.options.offload=all", "roles.ref.options.offload=all",
                   "pools={default: {nodes: 1, devices_per_node: 8}}", tmp_path=tmp_path)
    registry = get_registry(tuple(cfg.plugins))
    backends, _ = resolve_backends(cfg, registry, check_engines=False)
    plan = plan_placement(cfg, ClusterSpec(1, 8, "cuda", declared=True), backends)
    shape = shape_from_hf_config(read_hf_config(cfg.model.path))
    result = resolve_auto(cfg, plan, registry, {r: e.name for r, e in backends.items()}, shape, H200,
                          host_bytes=512 * GIB)
    (need,) = result.estimate.host
    n = shape.param_count()
    assert need.devices_per_node == 8
    assert need.parts["actor optimizer"] == pytest.approx(8 * n)  # two fp32 moments, all eight shards
    assert need.parts["actor weights"] == pytest.approx(4 * n) and need.parts["ref weights"] == pytest.approx(2 * n)
    assert need.parts["worker processes"] == 8 * HOST_PROCESS_GIB * GIB


def test_a_host_that_nothing_fits_does_not_change_what_fits_the_device(tmp_path):
    """8 rollouts asleep hold 8 copies of 7B weights on the host: on a 125 GiB node no setting fits the host, so the
    choices are the device's own (never more offloading to please the host) and the warning says why."""
    cfg = workload("7b", "pools={default: {nodes: 1, devices_per_node: 8}}", tmp_path=tmp_path)
    registry = get_registry(tuple(cfg.plugins))
    backends, _ = resolve_backends(cfg, registry, check_engines=False)
    plan = plan_placement(cfg, ClusterSpec(1, 8, "cuda", declared=True), backends)
    shape = shape_from_hf_config(read_hf_config(cfg.model.path))
    names = {r: e.name for r, e in backends.items()}

    def choose(host_bytes):
        result = resolve_auto(cfg, plan, registry, names, shape, H200, host_bytes=host_bytes)
        return result, {c.key: c.value for c in result.choices}

    _, unknown = choose(None)
    result, small = choose(125 * GIB)
    assert small == unknown
    assert any("the host memory does not fit" in c.reason for c in result.choices)
    assert result.estimate.host[0].fits is False and "rollout weights asleep" in result.estimate.host[0].parts
    assert any("host memory of a node" in w for w in result.estimate.warnings)


def registry_with_fused_kernels(monkeypatch, declared: bool):
    """A fresh registry in which the FSDP backend declares its fused layer kernels as it does where liger-kernel
    is installed (``hybridrl_fsdp.plugin.FUSED_LAYERS``), or does not."""
    pytest.importorskip("hybridrl_fsdp")
    import hybridrl_fsdp.plugin as fsdp_plugin
    from hybridrl.plugins.discovery import build_registry, plugin_manager

    monkeypatch.setattr(fsdp_plugin, "FUSED_LAYERS", ("fused_layer_kernels",) if declared else ())
    return build_registry(plugin_manager())


def test_fused_kernels_are_on_on_gpus_where_the_backend_declares_them(tmp_path, monkeypatch):
    cfg = workload("1.5b", tmp_path=tmp_path)
    fused, fused_choices = resolve(cfg, registry=registry_with_fused_kernels(monkeypatch, True))
    plain, plain_choices = resolve(cfg, registry=registry_with_fused_kernels(monkeypatch, False))
    assert fused_choices["roles.actor.options.fused_kernels"] is True
    assert fused_choices["roles.ref.options.fused_kernels"] is True
    assert fused.cfg.roles.actor.options["fused_kernels"] is True
    assert plain_choices["roles.actor.options.fused_kernels"] is False
    assert "liger-kernel" in next(c.reason for c in plain.choices if c.key == "roles.actor.options.fused_kernels")
    # fused layers keep less for backward: at the same micro-batch the plan's activations are smaller, so the
    # auto token budget is at least as large
    def planned_actor(declared: bool):
        cfg = workload("1.5b", "roles.actor.max_tokens_per_micro_batch=8192", tmp_path=tmp_path)
        result, _ = resolve(cfg, registry=registry_with_fused_kernels(monkeypatch, declared))
        return next(m for m in result.estimate.roles if m.role == "actor")

    assert planned_actor(True).activations < 0.85 * planned_actor(False).activations
    budget = "roles.actor.max_tokens_per_micro_batch"
    assert fused_choices[budget] >= plain_choices[budget]


def test_fused_kernels_stay_off_on_cpu_and_an_explicit_value_is_kept(tmp_path, monkeypatch):
    registry = registry_with_fused_kernels(monkeypatch, True)
    cfg = workload("0.5b", "roles.rollout.backend=hf", tmp_path=tmp_path)
    result, choices = resolve(cfg, device_bytes=None, device="cpu", registry=registry)
    assert choices["roles.actor.options.fused_kernels"] is False
    assert "CPU" in next(c.reason for c in result.choices if c.key == "roles.actor.options.fused_kernels")
    result, choices = resolve(workload("0.5b", "roles.actor.options.fused_kernels=false", tmp_path=tmp_path),
                              registry=registry)
    assert "roles.actor.options.fused_kernels" not in choices
    assert result.cfg.roles.actor.options["fused_kernels"] is False
    assert choices["roles.ref.options.fused_kernels"] is True  # each role resolves its own


def test_a_backend_resolves_its_own_auto_options_and_they_are_recorded(tmp_path):
    """The FSDP backend's ``resolve_options``: ``share_prompts`` on wherever the engine's own packed attention
    runs (CPU and GPU), off where a transformers attention reads the rows; an explicit value is the user's."""
    pytest.importorskip("hybridrl_fsdp")
    cpu, cpu_choices = resolve(workload("0.5b", "roles.rollout.backend=hf", tmp_path=tmp_path), device_bytes=None,
                               device="cpu")
    for role in ("actor", "ref"):
        assert cpu_choices[f"roles.{role}.options.share_prompts"] is True
        assert getattr(cpu.cfg.roles, role).options["share_prompts"] is True
    assert cpu.cfg.auto["choices"]["roles.actor.options.share_prompts"]["value"] is True  # recorded as the core's
    gpu, gpu_choices = resolve(workload("0.5b", tmp_path=tmp_path))
    assert gpu_choices["roles.actor.options.share_prompts"] is True
    hf_attn, hf_choices = resolve(workload("0.5b", "roles.actor.options.attn_implementation=flash_attention_2",
                                           tmp_path=tmp_path))
    assert hf_choices["roles.actor.options.share_prompts"] is False
    assert "varlen attention" in next(c.reason for c in hf_attn.choices
                                      if c.key == "roles.actor.options.share_prompts")
    kept, kept_choices = resolve(workload("0.5b", "roles.actor.options.share_prompts=false", tmp_path=tmp_path))
    assert "roles.actor.options.share_prompts" not in kept_choices
    assert kept.cfg.roles.actor.options["share_prompts"] is False
    assert kept_choices["roles.ref.options.share_prompts"] is True  # each role resolves its own


class UnloadableResolverPlugin:
    @hookimpl
    def hybridrl_register_backends(self, registry):
        registry.add_train_engine("unloadable", "no_such_module:Engine",
                                  resolve_options="no_such_module.settings:auto_options")


def test_a_resolver_that_cannot_load_names_the_role_backend_and_plugin(tmp_path):
    from hybridrl.plugins.discovery import build_registry, plugin_manager
    from hybridrl.plugins.registry import RegistryError

    pm = plugin_manager()
    pm.register(UnloadableResolverPlugin(), name="unloadable-plugin")
    with pytest.raises(RegistryError, match=r"roles\.actor\.backend: backend 'unloadable' \(plugin "
                                            r"unloadable-plugin\) cannot load its auto options"):
        resolve(workload("0.5b", "roles.actor.backend=unloadable", tmp_path=tmp_path), registry=build_registry(pm))


def test_a_phase_no_setting_fits_leaves_the_trainers_their_cheapest_settings_in_the_others(tmp_path):
    """A rollout given 90% of the device peaks over the share in generation whatever the trainers do; the trainers
    then offload (which lowers that peak) but keep the cheapest micro-batches whose own phases fit the share,
    not the least memory of all (checkpointing, the smallest budget)."""
    cfg = workload("0.5b", "roles.rollout.options.gpu_memory_utilization=0.9", tmp_path=tmp_path)
    result, choices = resolve(cfg)
    pool = result.estimate.pools[0]
    assert pool.peak_phase == "gen" and pool.peak > USABLE_SHARE * H200
    assert "nothing fits" in next(c.reason for c in result.choices if c.key.endswith("offload"))
    assert choices["roles.actor.options.offload"] == "all"  # what brings generation's peak down
    assert choices["roles.actor.options.gradient_checkpointing"] is False
    assert choices["roles.actor.max_tokens_per_micro_batch"] >= 16384
    assert all(need <= USABLE_SHARE * H200 for phase, need in pool.phases.items() if phase != "gen")
