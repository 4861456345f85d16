"""The quick start on a 2-node CPU Ray cluster with split pools: does it learn across nodes?

Starts two Ray nodes on this machine with ``hybridrl cluster up`` (127.0.0.2 the head, 127.0.0.3 a worker, one
CPU slot each), runs ``hybridrl train examples/quickstart-split.yaml cluster.devices_per_node=null`` against
them (the actor and reference on one node, the rollout on the other, the weights broadcast over gloo/TCP
between them), stops the nodes, and writes the command, the device map, the reward of the first and last 10
steps and the wall time to ``benchmarks/results/multinode_quickstart.json``.

    python benchmarks/multinode_quickstart.py [--steps 300] [--out benchmarks/results/multinode_quickstart.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "core"))

from hybridrl.runtime import ray_nodes  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="trainer.steps (the quick start's default: 300)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "multinode_quickstart.json")
    parser.add_argument("--head-ip", default="127.0.0.2")
    parser.add_argument("--worker-ip", default="127.0.0.3")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="hybridrl-multinode-"))
    folder, run = work / "cluster", work / "run"
    try:
        started = time.monotonic()
        ray_nodes.start_node(folder, head=True, node_ip=args.head_ip, port=ray_nodes.free_port(args.head_ip),
                             num_cpus=1)
        ray_nodes.start_node(folder, head=False, node_ip=args.worker_ip, num_cpus=1)
        cluster_s = time.monotonic() - started
        overrides = ["cluster.devices_per_node=null", f"trainer.steps={args.steps}", f"trainer.out={run}",
                     "trainer.progress=false"]
        command = ["hybridrl", "train", "examples/quickstart-split.yaml", *overrides]
        env = {**os.environ, **ray_nodes.driver_env(folder)}
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "hybridrl.cli", *command[1:]], cwd=ROOT, env=env,
                              capture_output=True, text=True)
        train_s = time.monotonic() - started
        if done.returncode != 0:
            print(done.stdout[-3000:], done.stderr[-3000:], sep="\n")
            return done.returncode
        history = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
        rewards = [row["reward/mean"] for row in history if "reward/mean" in row]
        device_map = json.loads((run / "device_map.json").read_text())
    finally:
        ray_nodes.stop_nodes(folder)
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "benchmark": "multinode_quickstart",
        "command": " ".join(["hybridrl cluster up --head --node-ip", args.head_ip, "--num-cpus 1 --dir DIR &&",
                             "hybridrl cluster up --node-ip", args.worker_ip, "--num-cpus 1 --dir DIR &&",
                             'eval "$(hybridrl cluster env --dir DIR)" &&', *command]),
        "nodes": 2, "cpus_per_node": 1,
        "device_map": [{k: row[k] for k in ("group", "rank", "node_ip", "node_id")} for row in device_map],
        "steps": len(rewards),
        "reward_first10": statistics.mean(rewards[:10]),
        "reward_last10": statistics.mean(rewards[-10:]),
        "cluster_start_s": round(cluster_s, 1),
        "train_wall_s": round(train_s, 1),
        "machine": f"{os.cpu_count()} CPU cores shared with other work",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"2-node split quick start: reward first 10 {result['reward_first10']:.3f} -> last 10 "
          f"{result['reward_last10']:.3f} over {result['steps']} steps ({train_s:.0f}s); {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
