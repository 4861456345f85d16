"""The device map (where Ray placed each rank) and how a lost node is named from it; no Ray needed: the
locations are what each worker reports (``RoleWorker.location``)."""

from __future__ import annotations

import json

from hybridrl.placement.plan import Device, ProcessGroupPlan
from hybridrl.runtime.device_map import (
    WorkerLocation,
    describe_lost_nodes,
    lost_node_ranks,
    render_device_map,
    write_device_map,
)
from hybridrl.runtime.group import WorkerGroup

A = "a" * 56
B = "b" * 56


def group(pool: str, roles: dict[str, str], nodes: list[str], ips: dict[str, str], gpus: bool = False) -> WorkerGroup:
    plan = ProcessGroupPlan(pool, "torch-dist", roles, [Device(i // 2, i % 2) for i in range(len(nodes))], 0)
    g = WorkerGroup(plan, [None] * len(nodes))
    g.locations = [WorkerLocation(n, ips[n], (str(i % 2),) if gpus else (), 100 + i) for i, n in enumerate(nodes)]
    return g


IPS = {A: "10.0.0.1", B: "10.0.0.2"}


def test_the_map_joins_consecutive_ranks_of_a_node_and_names_their_gpus(tmp_path):
    train = group("train", {"actor": "fsdp", "ref": "fsdp"}, [A, A, B, B], IPS, gpus=True)
    gen = group("gen", {"rollout": "vllm"}, [B], IPS)
    text = render_device_map([train, gen])
    assert "train/actor+ref ranks 0-1/4 -> 10.0.0.1 [node aaaaaaaa] GPU 0,1" in text
    assert "train/actor+ref ranks 2-3/4 -> 10.0.0.2 [node bbbbbbbb] GPU 0,1" in text
    assert "gen/rollout rank 0/1 -> 10.0.0.2 [node bbbbbbbb] CPU" in text
    rows = json.loads(write_device_map(tmp_path, [train, gen]).read_text())
    assert [(r["group"], r["rank"], r["planned"], r["node_ip"]) for r in rows][:3] == [
        ("train/actor+ref", 0, "node0:0", "10.0.0.1"), ("train/actor+ref", 1, "node0:1", "10.0.0.1"),
        ("train/actor+ref", 2, "node1:0", "10.0.0.2")]


def test_a_lost_node_is_named_with_every_rank_that_ran_there():
    train = group("main", {"actor": "fsdp", "ref": "fsdp"}, [A, B, A, B], IPS)
    gen = group("gen", {"rollout": "hf"}, [B, A], IPS)
    assert [(g.plan.pool, r) for g, r in lost_node_ranks([train, gen], {B})] == [("main", 1), ("main", 3),
                                                                                  ("gen", 0)]
    text = describe_lost_nodes([train, gen], {B})
    assert text == ("node 10.0.0.2 [node bbbbbbbb] was lost, with role actor+ref (pool 'main') ranks 1, 3 of 4; "
                    "role rollout (pool 'gen') rank 0 of 2")
