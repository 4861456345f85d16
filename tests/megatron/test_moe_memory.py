"""The Megatron memory model of Qwen3-30B-A3B on 8 GPUs: expert parallelism splits the experts (most of the
weights) over the data-parallel ranks; the rest stays whole on every rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridrl.config import load_config
from hybridrl.placement.memory import GIB, estimate_memory, model_shape
from hybridrl.placement.plan import ClusterSpec, plan_placement, resolve_backends
from hybridrl.plugins.discovery import get_registry

ROOT = Path(__file__).resolve().parents[2]


def actor_memory(overrides: list[str]):
    cfg = load_config(ROOT / "examples" / "qwen3moe-colocated.yaml",
                      ["roles.actor.backend=megatron", "roles.ref.backend=megatron", *overrides])
    backends, problems = resolve_backends(cfg, get_registry(), check_engines=False)
    assert not problems
    plan = plan_placement(cfg, ClusterSpec(1, 8, "cuda", declared=True), backends)
    shape, _ = model_shape(cfg, base_dirs=(ROOT,))
    est = estimate_memory(cfg, plan, shape, 141 * GIB)
    return shape, next(m for m in est.roles if m.role == "actor")


def test_expert_parallel_splits_the_experts():
    shape, whole = actor_memory([])
    _, split = actor_memory(["roles.actor.options={expert_parallel: 8}"])
    experts = shape.num_layers * shape.num_experts * 3 * shape.hidden_size * shape.moe_intermediate_size
    assert experts / shape.param_count() > 0.9  # Qwen3-30B-A3B is nearly all experts (95%)
    per_param = whole.weights / shape.param_count()  # bf16 weights and their fp32 copy
    assert whole.weights == pytest.approx(per_param * shape.param_count())
    assert split.weights == pytest.approx(per_param * (shape.param_count() - experts + experts / 8))
    assert split.weights < whole.weights / 5  # 1.5B shared parameters stay whole on every rank
    assert "EP8" in split.share
