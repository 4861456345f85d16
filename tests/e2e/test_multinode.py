"""More than one Ray node, for real: a 2-node cluster started with ``hybridrl cluster up`` on this machine (the
head on 127.0.0.2, a worker on 127.0.0.3, one CPU slot each; gloo over TCP between them), as the README's
"Running on a cluster" starts one. The drivers are ``hybridrl train`` processes that join it (``hybridrl
cluster env``).

* split pools: the actor and reference on one node, the rollout on the other, the weights broadcast between them;
* a pool over both nodes: the FSDP actor data-parallel across them; then the worker node's raylet is killed
  mid-run: the run stops, naming the node, the roles and ranks that ran there and the checkpoint to resume
  from, without hanging; and it resumes from that checkpoint on the cluster that is left (one node: FSDP
  over another number of ranks).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridrl.runtime import ray_nodes

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
HEAD_IP, WORKER_IP = "127.0.0.2", "127.0.0.3"
SMALL = ["data.prompts_per_step=4", "algorithm.n_samples=4", "trainer.progress=false"]
#: the node-loss run must end well within this (it would hang for COLLECTIVE_TIMEOUT_S without detection)
NODE_LOSS_BOUND_S = 240


def hybridrl(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridrl.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two Ray nodes with the commands a user types; stopped (only they) at the end."""
    folder = tmp_path_factory.mktemp("cluster")
    port = str(ray_nodes.free_port(HEAD_IP))
    env = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3"}  # notice a loss sooner
    try:
        head = hybridrl("cluster", "up", "--head", "--node-ip", HEAD_IP, "--port", port, "--num-cpus", "1",
                        "--dir", str(folder), env=env)
        assert head.returncode == 0, head.stdout + head.stderr
        worker = hybridrl("cluster", "up", "--node-ip", WORKER_IP, "--num-cpus", "1", "--dir", str(folder), env=env)
        assert worker.returncode == 0, worker.stdout + worker.stderr
        exports = hybridrl("cluster", "env", "--dir", str(folder)).stdout
        driver = dict(line.removeprefix("export ").split("=", 1) for line in exports.splitlines())
        assert driver["RAY_ADDRESS"] == f"{HEAD_IP}:{port}"
        yield folder, driver
    finally:
        down = hybridrl("cluster", "down", "--dir", str(folder))
        assert down.returncode == 0, down.stderr
        assert not ray_nodes.node_records(folder), "cluster down left node records"


def device_map(out: Path) -> list[dict]:
    return json.loads((out / "device_map.json").read_text())


def test_split_pools_on_two_nodes_broadcast_between_them(cluster, tmp_path):
    folder, driver = cluster
    out = tmp_path / "run"
    run = hybridrl("train", str(EXAMPLES / "quickstart-split.yaml"), "cluster.devices_per_node=null",
                   "trainer.steps=2", f"trainer.out={out}", *SMALL, env=driver)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "cluster: 2 node(s) x 1 CPU slot(s): 127.0.0.2 (head)" in run.stdout  # the plan names the real nodes
    assert "reshard actor -> rollout: split pools (broadcast), between nodes" in run.stdout
    where = {row["group"]: (row["node_ip"], row["node_id"]) for row in device_map(out)}
    assert set(where) == {"train/actor+ref", "gen/rollout"}
    assert {ip for ip, _ in where.values()} == {HEAD_IP, WORKER_IP}  # the roles run on different nodes
    assert where["train/actor+ref"][1] != where["gen/rollout"][1]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    # the weights crossed: the rollout's log-probs follow the updated actor (no drift after the broadcast)
    assert all(abs(r["rollout/logp_diff"]) < 1e-3 for r in rows if "rollout/logp_diff" in r)


def test_fsdp_across_nodes_survives_a_lost_node_and_resumes_on_one(cluster, tmp_path):
    folder, driver = cluster
    out = tmp_path / "run"
    args = [str(EXAMPLES / "quickstart.yaml"), "cluster.devices_per_node=null", "trainer.save_every=2",
            f"trainer.out={out}", *SMALL]
    proc = subprocess.Popen([sys.executable, "-m", "hybridrl.cli", "train", *args, "pools.main.nodes=2",
                             "trainer.steps=200"], cwd=ROOT, env={**os.environ, **driver},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 400
        while not (out / "checkpoints").is_dir() or not _complete_checkpoints(out):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no checkpoint was written"
            time.sleep(1.0)
        placed = device_map(out)
        actor_ranks = {row["rank"]: row for row in placed if "actor" in row["roles"]}
        assert sorted(actor_ranks) == [0, 1] and {r["node_ip"] for r in actor_ranks.values()} == {HEAD_IP, WORKER_IP}
        lost = next(row for row in actor_ranks.values() if row["node_ip"] == WORKER_IP)
        worker = next(rec for _, rec in ray_nodes.node_records(folder) if not rec.head)
        raylet = ray_nodes.raylet_of(worker)
        assert raylet is not None
        killed = time.monotonic()
        raylet.kill()
        _, err = proc.communicate(timeout=NODE_LOSS_BOUND_S)
        took = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode not in (0, None), err[-3000:]
    message = err[-4000:]
    print(message)  # shown with -rP: what a user reads
    assert f"node {WORKER_IP}" in message and lost["node_id"][:8] in message, message
    assert f"rank {lost['rank']} of 2" in message and "actor" in message, message
    checkpoint = _complete_checkpoints(out)[-1]
    assert str(checkpoint) in message and "resume" in message, message
    assert "Traceback" not in message, message
    assert took < NODE_LOSS_BOUND_S

    # the same run on the node that is left: FSDP over 1 rank instead of 2, from the checkpoint it named
    step = int(checkpoint.name.rsplit("_", 1)[-1])
    resumed = hybridrl("train", *args, "pools.main.nodes=1", f"trainer.steps={step + 1}", env=driver)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert "resum" in (resumed.stdout + resumed.stderr).lower()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == step + 1 and [r["step"] for r in rows] == list(range(1, step + 2))
    assert {row["node_ip"] for row in device_map(out)} == {HEAD_IP}


def _complete_checkpoints(out: Path) -> list[Path]:
    from hybridrl.run import checkpoint as ckpt

    latest = ckpt.latest_checkpoint(out)
    return [] if latest is None else [Path(latest)]
