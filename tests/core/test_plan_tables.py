"""The printed plan of every shipped example (device map, memory plan, host memory, reshard volume, auto choices)
against golden files: a change to the planner that moves any figure shows here as a diff.

Each case runs the function behind ``hybridrl plan`` in this process. The goldens live in
``tests/core/plan_tables/<case>.txt``; ``HYBRIDRL_UPDATE_PLAN_TABLES=1`` rewrites them (then read the diff).
"""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import pytest

from hybridrl.cli import main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
CONFIGS = EXAMPLES / "configs"
GOLDEN = Path(__file__).resolve().parent / "plan_tables"
UPDATE = os.environ.get("HYBRIDRL_UPDATE_PLAN_TABLES") == "1"

CPU2 = ["--cluster", "1x2", "--device", "cpu"]
#: the examples as their comments plan them.
EXAMPLE_CASES: dict[str, list[str]] = {
    "quickstart": ["quickstart.yaml", *CPU2],
    "quickstart-split": ["quickstart-split.yaml", *CPU2],
    "quickstart-pipelined": ["quickstart-pipelined.yaml", *CPU2],
    "math-chat": ["math-chat.yaml", *CPU2],
    "tool-calc": ["tool-calc.yaml", *CPU2],
    "quickstart-cuda": ["quickstart.yaml", "--cluster", "1x1"],
    "qwen7b-colocated": ["qwen7b-colocated.yaml", "--cluster", "1x8"],
    "qwen3moe-colocated": ["qwen3moe-colocated.yaml", "--cluster", "1x8"],
    "qwen7b-colocated-one-device": ["qwen7b-colocated.yaml", "pools.main.devices_per_node=1", "--cluster", "1x8"],
    "qwen7b-colocated-141": ["qwen7b-colocated.yaml", "--cluster", "1x8", "--device-memory", "141"],
    "qwen7b-split": ["qwen7b-split.yaml", "--cluster", "1x8"],
    "qwen7b-split-host": ["qwen7b-split.yaml", "--cluster", "1x8", "--host-memory", "125",
                          "roles.actor.options.offload=all"],
    "qwen7b-colocated-vllm": ["qwen7b-colocated.yaml", "roles.rollout.backend=vllm", "--cluster", "1x8"],
    "qwen7b-colocated-vllm-share": ["qwen7b-colocated.yaml", "roles.rollout.backend=vllm",
                                    "roles.rollout.options.gpu_memory_utilization=0.5", "--cluster", "1x8"],
    "qwen7b-split-sglang": ["qwen7b-split.yaml", "roles.rollout.backend=sglang", "--cluster", "1x8"],
    "qwen7b-split-sglang-share": ["qwen7b-split.yaml", "roles.rollout.backend=sglang",
                                  "roles.rollout.options.gpu_memory_utilization=0.8", "--cluster", "1x8"],
    "qwen7b-colocated-megatron": ["qwen7b-colocated.yaml", "roles.actor.backend=megatron",
                                  "roles.ref.backend=megatron", "--cluster", "1x8"],
    "qwen7b-colocated-megatron-tp2pp2": ["qwen7b-colocated.yaml", "roles.actor.backend=megatron",
                                         "roles.ref.backend=megatron", "roles.actor.options.tensor_parallel=2",
                                         "roles.actor.options.pipeline_parallel=2", "--cluster", "1x8"],
    "qwen32b-split-megatron-tp4": ["qwen32b-split.yaml", "roles.actor.backend=megatron", "roles.ref.backend=megatron",
                                   "roles.actor.options={tensor_parallel: 4, recompute: true}",
                                   "roles.ref.options={tensor_parallel: 4}", "--cluster", "4x8"],
    "qwen7b-colocated-lora-vllm": ["qwen7b-colocated.yaml", "roles.rollout.backend=vllm",
                                   "roles.actor.lora={rank: 20, alpha: 40, sync: adapter}", "--cluster", "1x8"],
    "qwen7b-split-lora-sglang": ["qwen7b-split.yaml", "roles.rollout.backend=sglang",
                                 "roles.actor.lora={rank: 20, alpha: 40}", "--cluster", "1x8"],
}
def _cluster_plan_cases() -> dict[tuple[str, str], list[str]]:
    """``benchmarks/cluster_plans.py``'s cases, read from the benchmark itself (one list of them)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_cluster_plans", ROOT / "benchmarks" / "cluster_plans.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CASES


#: ``benchmarks/cluster_plans.py``'s cases (and ``tests/core/test_cluster_plans.py``'s 32x8 ones).
CLUSTER_CASES = _cluster_plan_cases()
#: ``benchmarks/model_sizes.py``'s shapes and workload (GRPO 64 x 8, 128 + 256 tokens) on one 141 GiB GPU.
SIZES = ("0.5b", "1.5b", "3b", "7b")
SIZE_ROLLOUTS = {"vllm": SIZES, "sglang": ("0.5b", "7b"), "hf": ("0.5b",)}

CASES: dict[str, list[str]] = {
    **{f"example-{name}": [str(EXAMPLES / args[0]), *args[1:]] for name, args in EXAMPLE_CASES.items()},
    **{f"cluster-{config}-{cluster}": [str(EXAMPLES / f"{config}.yaml"), "--cluster", cluster, *overrides]
       for (config, cluster), overrides in CLUSTER_CASES.items()},
    **{f"size-{size}-{rollout}": ["<workload>", "--model-config", str(CONFIGS / f"qwen2.5-{size}"),
                                  f"roles.rollout.backend={rollout}"]
       for rollout, sizes in SIZE_ROLLOUTS.items() for size in sizes},
    "size-7b-vllm-lora": ["<workload>", "--model-config", str(CONFIGS / "qwen2.5-7b"), "roles.rollout.backend=vllm",
                          "roles.actor.lora={rank: 32, alpha: 64}"],
    "size-7b-vllm-host": ["<workload>", "--model-config", str(CONFIGS / "qwen2.5-7b"), "roles.rollout.backend=vllm",
                          "--host-memory", "64"],
}


@pytest.fixture(scope="module")
def workload(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model-sizes benchmark's config: the workload's keys only, everything else its default."""
    folder = tmp_path_factory.mktemp("workload")
    (folder / "p.jsonl").write_text('{"prompt": "12"}\n')
    config = folder / "workload.yaml"
    config.write_text(f"""
model: {{path: {CONFIGS / 'qwen2.5-0.5b'}, dtype: bfloat16}}
data: {{train: {folder / 'p.jsonl'}, max_prompt_len: 128, prompts_per_step: 64}}
algorithm: {{name: grpo, n_samples: 8, kl: {{coef: 0.001, estimator: k3, as: loss}}}}
roles:
  rollout: {{backend: vllm, max_new_tokens: 256, min_new_tokens: 256, ignore_eos: true}}
""")
    return config


def plan_text(args: list[str]) -> str:
    """What ``hybridrl plan ARGS --skip-engine-check`` prints, with this checkout's path made neutral."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(["plan", *args, "--skip-engine-check"])
    assert status == 0, out.getvalue()
    return out.getvalue().replace(str(ROOT), "<root>")


@pytest.mark.parametrize("case", sorted(CASES))
def test_plan_table_is_unchanged(case: str, workload: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the examples' model paths are relative to the project
    args = [str(workload) if a == "<workload>" else a for a in CASES[case]]
    if case.startswith("size-"):
        args += ["--cluster", "1x1", "--device-memory", "141"]
    text = plan_text(args).replace(str(workload.parent), "<workload>")
    golden = GOLDEN / f"{case}.txt"
    if UPDATE or not golden.exists():
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(text)
        if not UPDATE:
            pytest.fail(f"{golden} was missing: written now, check it in")
    assert text == golden.read_text(), f"the plan of {case} changed (HYBRIDRL_UPDATE_PLAN_TABLES=1 rewrites it)"
