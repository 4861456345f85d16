"""Each backend owns what it knows (``hybridrl.plugins.registry.BackendSpec``): its memory model, the keys that
answer an out of memory on it, and how its FLOPs are counted. The planner and the ``auto`` search ask the spec,
never a name: a backend without a model is "not estimated" and gets no memory-driven ``auto``; a third-party
engine that registers a model (the kit's example train engine) gets a plan and ``auto`` settings."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hybridrl import hookimpl
from hybridrl.config import load_config
from hybridrl.engines.memory_model import RolloutMemoryModel, TrainMemoryModel
from hybridrl.observe.flops import shared_prompt_roles
from hybridrl.placement.auto import resolve_auto
from hybridrl.placement.memory import GIB, model_shape, render_memory
from hybridrl.placement.plan import ClusterSpec, plan_placement, resolve_backends
from hybridrl.plugins.discovery import build_registry, plugin_manager
from hybridrl.plugins.registry import RegistryError
from hybridrl.run.oom import fixes_for

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
COLOCATED = EXAMPLES / "qwen7b-colocated.yaml"
QWEN05 = EXAMPLES / "configs" / "qwen2.5-0.5b"


class _NoModel:
    """A third-party train engine that registers no memory model."""

    @staticmethod
    @hookimpl
    def hybridrl_register_backends(registry):
        registry.add_train_engine("plain", "nowhere:Engine", process_family="torch-dist")
        registry.add_train_engine("broken", "nowhere:Engine", memory_model="nowhere_at_all:MODEL")


def registry_with(*modules: str):
    pm = plugin_manager(modules)
    pm.register(_NoModel, name="test-no-model")
    return build_registry(pm)


@pytest.fixture(scope="module")
def example_registry():
    sys.path.insert(0, str(EXAMPLES / "plugin"))  # the kit's example plugin, as if pip-installed
    try:
        yield registry_with("hybridrl_example_rollout.plugin")
    finally:
        sys.path.remove(str(EXAMPLES / "plugin"))


def plan_and_auto(registry, config: Path, overrides: list[str], cluster: ClusterSpec, device_gib: float | None = 80,
                  model_config: Path | None = None):
    cfg = load_config(config, overrides)
    backends, problems = resolve_backends(cfg, registry, check_engines=False)
    assert not problems, problems
    plan = plan_placement(cfg, cluster, backends)
    shape, source = model_shape(cfg, model_config, base_dirs=(ROOT,))
    auto = resolve_auto(cfg, plan, registry, {r: e.name for r, e in backends.items()}, shape,
                        None if device_gib is None else device_gib * GIB, source)
    assert not auto.problems, auto.problems
    return cfg, plan, auto


# --- the shipped backends' models ---------------------------------------------------------------------------

def test_every_shipped_backend_registers_a_model_of_its_kind():
    registry = registry_with()
    for kind, name, protocol in (("train", "fsdp", TrainMemoryModel), ("train", "megatron", TrainMemoryModel),
                                 ("rollout", "vllm", RolloutMemoryModel), ("rollout", "sglang", RolloutMemoryModel),
                                 ("rollout", "hf", RolloutMemoryModel)):
        assert isinstance(registry.backend(kind, name).memory(), protocol), name
    assert registry.backend("train", "plain").memory() is None


def test_a_model_that_cannot_load_names_the_backend_and_its_plugin():
    with pytest.raises(RegistryError, match=r"train backend 'broken' \(plugin test-no-model\) cannot load its "
                                            r"memory_model nowhere_at_all:MODEL"):
        registry_with().backend("train", "broken").memory()


def test_lora_adapter_slots_are_the_rollouts_own_rank():
    registry = registry_with()
    assert registry.backend("rollout", "vllm").memory().adapter_rank(20) == 32  # vLLM's sizes round up
    assert registry.backend("rollout", "vllm").memory().adapter_rank(512) == 512
    assert registry.backend("rollout", "sglang").memory().adapter_rank(20) == 20
    assert registry.backend("rollout", "hf").memory().adapter_rank(20) is None  # merged on the host


def test_megatron_splits_state_over_tensor_and_pipeline_not_data_parallel():
    registry = registry_with()
    # Megatron's model offers no token budget to search: the micro-batches are given, as a Megatron user does
    megatron = ["roles.actor.backend=megatron", "roles.ref.backend=megatron", "roles.actor.micro_batch=4",
                "roles.ref.micro_batch=8", "roles.actor.options.gradient_checkpointing=true"]
    _, _, flat = plan_and_auto(registry, COLOCATED, megatron, ClusterSpec(1, 8, "cuda", declared=True))
    _, _, split = plan_and_auto(registry, COLOCATED, [*megatron, "roles.actor.options.tensor_parallel=2",
                                                     "roles.actor.options.pipeline_parallel=2"],
                                ClusterSpec(1, 8, "cuda", declared=True))
    _, _, fsdp = plan_and_auto(registry, COLOCATED, [], ClusterSpec(1, 8, "cuda", declared=True))
    actor = {name: next(m for m in est.estimate.roles if m.role == "actor")
             for name, est in (("flat", flat), ("split", split), ("fsdp", fsdp))}
    n = flat.estimate.shape.param_count()
    assert actor["flat"].share == "TP1 PP1 DP8" and actor["split"].share == "TP2 PP2 DP2"
    assert actor["flat"].weights == pytest.approx(6 * n)  # bf16 parameters + fp32 main copy, not sharded over DP
    assert actor["split"].weights == pytest.approx(actor["flat"].weights / 4)
    assert actor["split"].optimizer == pytest.approx(actor["flat"].optimizer / 4)
    assert actor["fsdp"].weights == pytest.approx(4 * n / 8)  # FSDP shards its fp32 masters over all 8
    assert actor["split"].activations < actor["flat"].activations  # split over the tensor-parallel ranks
    assert "DOES NOT FIT" in render_memory(flat.estimate) and "DOES NOT FIT" not in render_memory(split.estimate)
    ref = next(m for m in split.estimate.roles if m.role == "ref")
    assert ref.share == "TP2 PP2 DP2"  # a reference fused with the actor takes its layout


def test_megatron_offers_recompute_to_the_search_only_when_asked():
    registry = registry_with()
    megatron = ["roles.actor.backend=megatron", "roles.ref.backend=megatron", "roles.actor.options.tensor_parallel=2",
                "roles.actor.options.pipeline_parallel=2", "roles.actor.micro_batch=4", "roles.ref.micro_batch=8"]
    gpus = ClusterSpec(1, 8, "cuda", declared=True)
    _, _, asked = plan_and_auto(registry, COLOCATED, [*megatron, "roles.actor.options.gradient_checkpointing=auto"],
                                gpus)
    choice = next(c for c in asked.choices if c.key == "roles.actor.options.gradient_checkpointing")
    assert choice.value is False and choice.reason == "the activations fit without it"
    assert asked.cfg.roles.actor.options["gradient_checkpointing"] is False
    _, _, tight = plan_and_auto(registry, COLOCATED, [*megatron, "roles.actor.options.gradient_checkpointing=auto"],
                                gpus, device_gib=48)
    assert next(c for c in tight.choices if c.key.endswith("gradient_checkpointing")).value is True
    _, _, given = plan_and_auto(registry, COLOCATED, [*megatron, "roles.actor.options.gradient_checkpointing=true"],
                                gpus)  # a given true is kept
    assert not [c for c in given.choices if c.key.startswith("roles.actor.")]


# --- no model: not estimated, never guessed -----------------------------------------------------------------

def test_a_backend_without_a_model_is_not_estimated_and_gets_no_memory_auto():
    registry = registry_with()
    _, _, auto = plan_and_auto(registry, COLOCATED, ["roles.actor.backend=plain", "roles.ref.backend=plain"],
                               ClusterSpec(1, 8, "cuda", declared=True))
    est = auto.estimate
    assert {m.role for m in est.roles} == {"rollout"}
    assert {(r, b) for r, _, b in est.unestimated} == {("actor", "plain"), ("ref", "plain")}
    pool = est.pools[0]
    assert pool.fits is None and pool.unestimated == ["actor[plain]", "ref[plain]"]
    text = render_memory(est)
    assert "not estimated: backend 'plain' has no memory model" in text
    assert "(without actor[plain], ref[plain]: not estimated)" in text and "  ok" not in text
    assert not [c for c in auto.choices if c.key.startswith(("roles.actor.", "roles.ref."))]


# --- the kit's example train engine ---------------------------------------------------------------------------

def example_workload(tmp_path: Path, micro_batch: int | None = None) -> Path:
    """The 0.5B shape, GRPO 64 x 8 (128 + 256 tokens), actor and reference on the example train engine."""
    (tmp_path / "p.jsonl").write_text('{"prompt": "12"}\n')
    rows = "" if micro_batch is None else f", micro_batch: {micro_batch}"
    config = tmp_path / "example.yaml"
    config.write_text(f"""
model: {{path: {QWEN05}, dtype: bfloat16}}
data: {{train: {tmp_path / 'p.jsonl'}, max_prompt_len: 128, prompts_per_step: 64}}
algorithm: {{name: grpo, n_samples: 8, kl: {{coef: 0.001, estimator: k3, as: loss}}}}
roles:
  actor: {{backend: example_train{rows}}}
  ref: {{backend: example_train}}
  rollout: {{backend: vllm, max_new_tokens: 256}}
""")
    return config


def test_the_example_train_engine_gets_a_plan_and_auto_settings(example_registry, tmp_path):
    one_gpu = ClusterSpec(1, 1, "cuda", declared=True)
    _, _, auto = plan_and_auto(example_registry, example_workload(tmp_path), [], one_gpu, 24)
    chosen = {c.key: c for c in auto.choices}
    rows = chosen["roles.actor.micro_batch"].value  # left to the search: the most rows that fit
    assert "the cheapest settings whose every phase fits" in chosen["roles.actor.micro_batch"].reason
    assert auto.cfg.roles.actor.micro_batch == rows and rows in (32, 16, 8, 4, 2, 1)
    assert auto.estimate.pools[0].fits is True and auto.estimate.pools[0].peak <= 0.85 * 24 * GIB
    actor = next(m for m in auto.estimate.roles if m.role == "actor")
    n = auto.estimate.shape.param_count()
    assert actor.weights == 4 * n and actor.optimizer == 8 * n and actor.share == "full"
    assert f"{rows} rows per micro-batch" in actor.notes
    _, _, over = plan_and_auto(example_registry, example_workload(tmp_path, 2 * rows), [], one_gpu, 24)
    assert over.estimate.pools[0].peak > 0.85 * 24 * GIB  # twice the rows would not have fitted
    assert not [c for c in over.choices if c.key == "roles.actor.micro_batch"]  # a set value is kept
    _, _, cpu = plan_and_auto(example_registry, example_workload(tmp_path), [], ClusterSpec(1, 1, "cpu", True), None)
    assert not [c for c in cpu.choices if c.key == "roles.actor.micro_batch"]  # nothing to plan against


# --- out-of-memory keys and FLOPs from the spec ------------------------------------------------------------

def test_out_of_memory_keys_come_from_the_failing_backend():
    registry = registry_with()
    _, plan, auto = plan_and_auto(registry, COLOCATED, [], ClusterSpec(1, 8, "cuda", declared=True))
    plan.memory = auto.estimate
    fsdp = fixes_for(plan, "actor", "update_actor")
    assert fsdp[0].startswith("roles.actor.max_tokens_per_micro_batch=")
    assert fsdp.index("roles.ref.options.offload=all") < fsdp.index("roles.actor.options.offload=all")
    _, plan, auto = plan_and_auto(registry, COLOCATED, ["roles.actor.backend=megatron", "roles.ref.backend=megatron"],
                                  ClusterSpec(1, 8, "cuda", declared=True))
    plan.memory = auto.estimate
    megatron = fixes_for(plan, "actor", "update_actor")
    assert megatron[0] == "roles.actor.micro_batch lower"
    assert "roles.actor.options.tensor_parallel (or pipeline_parallel) higher" in megatron
    assert not any("offload" in f or "max_tokens" in f for f in megatron)  # keys Megatron does not have
    _, plan, auto = plan_and_auto(registry, COLOCATED, ["roles.rollout.backend=vllm",
                                                        "roles.rollout.options.gpu_memory_utilization=0.5"],
                                  ClusterSpec(1, 8, "cuda", declared=True))
    plan.memory = auto.estimate
    rollout = fixes_for(plan, "rollout", "wake")
    assert rollout[0].startswith("roles.rollout.options.gpu_memory_utilization=auto")
    assert rollout.index("roles.ref.options.offload=all") < rollout.index("roles.actor.options.offload=optimizer") \
        < rollout.index("roles.rollout.tensor_parallel=2 (the engine over more devices)")


def test_flops_credit_shared_prompts_where_the_backend_says_so():
    registry = registry_with()
    cfg = load_config(COLOCATED, ["roles.actor.options.share_prompts=true", "roles.ref.options.share_prompts=false"])
    backends, _ = resolve_backends(cfg, registry, check_engines=False)
    plan = plan_placement(cfg, ClusterSpec(1, 8, "cuda", declared=True), backends)
    assert shared_prompt_roles(cfg, plan, registry) == {"actor"}
    cfg = load_config(COLOCATED, ["roles.actor.backend=megatron", "roles.ref.backend=megatron",
                                  "roles.actor.options.share_prompts=true"])
    backends, _ = resolve_backends(cfg, registry, check_engines=False)
    plan = plan_placement(cfg, ClusterSpec(1, 8, "cuda", declared=True), backends)
    assert shared_prompt_roles(cfg, plan, registry) == set()  # the option means nothing to Megatron
