"""The plans of the shipped Qwen2.5 7B, 32B and 72B configs on 4 and 32 nodes of 8 GPUs, colocated and split, and
of Qwen3-30B-A3B (mixture of experts) on 1 and 2 nodes.

For each case it runs ``hybridrl plan CONFIG --cluster NxM --skip-engine-check OVERRIDES`` (no GPU, no engine:
the plan, its memory estimate and its reshard volume) and keeps the figures the README's table quotes: the
peak memory per device of each pool (and its phase), whether it fits in 80 GiB, and the bytes each weight sync
moves (a copy, delivered to the rollout ranks, crossing between nodes). Writes
``benchmarks/results/cluster_plans.json`` (figures + the commands) and prints a markdown table.

    python benchmarks/cluster_plans.py
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "core"))

from hybridrl.cli import main as hybridrl  # noqa: E402

#: (config, cluster) -> the overrides that spread it over the cluster (the configs are written for 4x8; the 7B
#: ones for one node)
CASES = {
    ("qwen7b-colocated", "4x8"): ["pools.main.nodes=4"],
    ("qwen7b-split", "4x8"): ["pools.train.nodes=2", "pools.train.devices_per_node=8", "pools.gen.nodes=2",
                              "pools.gen.devices_per_node=8"],
    ("qwen32b-colocated", "4x8"): [],
    ("qwen32b-split", "4x8"): [],
    ("qwen72b-colocated", "4x8"): [],
    ("qwen72b-split", "4x8"): [],
    ("qwen7b-colocated", "32x8"): ["pools.main.nodes=32"],
    ("qwen7b-split", "32x8"): ["pools.train.nodes=16", "pools.train.devices_per_node=8", "pools.gen.nodes=16",
                               "pools.gen.devices_per_node=8"],
    ("qwen32b-colocated", "32x8"): ["pools.main.nodes=32"],
    ("qwen32b-split", "32x8"): ["pools.train.nodes=24", "pools.gen.nodes=8"],
    ("qwen72b-colocated", "32x8"): ["pools.main.nodes=32"],
    ("qwen72b-split", "32x8"): ["pools.train.nodes=24", "pools.gen.nodes=8"],
    ("qwen3moe-colocated", "1x8"): ["roles.rollout.backend=vllm"],
    ("qwen3moe-colocated", "2x8"): ["pools.main.nodes=2", "roles.rollout.backend=vllm"],
}

POOL_PEAK = re.compile(r"^pool (\S+) \((\d+) device\(s\), ([^)]*)\): peak ([\d.]+) GiB in (\S+) .*?(ok|DOES NOT FIT)",
                       re.M)
COPY = re.compile(r"^reshard actor -> rollout \((\w+); .*?: ([\d.]+ \w+) a copy; ([^)]*)\):", re.M)
PER_STEP = re.compile(r"^  per step: >= ([\d.]+ \w+|0 B) cross between nodes(?: \(>= ([\d.]+ \w+) into the busiest "
                      r"node\))?(?:; ([\d.]+ \w+) reach the rollout ranks)?", re.M)
GATHER = re.compile(r"^  gather: .* receives ([\d.]+ \w+) of the others' FSDP shards \(all-gather(?:, ([\d.]+ \w+) of "
                    r"it from other nodes)?\)", re.M)


def plan_case(config: str, cluster: str, overrides: list[str]) -> dict:
    args = ["plan", f"examples/{config}.yaml", "--cluster", cluster, "--skip-engine-check", *overrides]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = hybridrl(args)
    text = out.getvalue()
    if status != 0:
        raise SystemExit(f"hybridrl {' '.join(args)} failed ({status}):\n{text}")
    copy, per_step, gather = COPY.search(text), PER_STEP.search(text), GATHER.search(text)
    return {
        "command": "hybridrl " + " ".join(args),
        "pools": [{"pool": m[1], "devices": int(m[2]), "roles": m[3], "peak_gib": float(m[4]), "peak_phase": m[5],
                   "fits_80gib": m[6] == "ok"} for m in POOL_PEAK.finditer(text)],
        "reshard": {"transport": copy[1], "copy": copy[2], "syncs": copy[3],
                    "gather_per_device": gather[1] if gather else "0 B",
                    "gather_from_other_nodes": (gather[2] or "0 B") if gather else "0 B",
                    "cross_node_per_step": per_step[1], "busiest_node_per_step": per_step[2] or "0 B",
                    "delivered_per_step": per_step[3] or "(in place)"},
    }


def main() -> int:
    results = {f"{config} {cluster}": plan_case(config, cluster, overrides)
               for (config, cluster), overrides in CASES.items()}
    out = ROOT / "benchmarks" / "results" / "cluster_plans.json"
    out.write_text(json.dumps({"benchmark": "cluster_plans", "device_memory_gib": 80, "cases": results}, indent=2)
                   + "\n")
    print("| config | cluster | peak GiB per device (pool: phase) | gather per device | sync crossing nodes / step "
          "| delivered to rollout / step |")
    print("|---|---|---|---|---|---|")
    for name, case in results.items():
        config, cluster = name.split()
        peaks = ", ".join(f"{p['pool']} {p['peak_gib']:.1f} ({p['peak_phase']})" +
                          ("" if p["fits_80gib"] else " DOES NOT FIT") for p in case["pools"])
        r = case["reshard"]
        print(f"| {config} | {cluster} | {peaks} | {r['gather_per_device']} | {r['cross_node_per_step']} "
              f"(busiest node {r['busiest_node_per_step']}) | {r['delivered_per_step']} |")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
