"""Placement: pools on a declared cluster, colocation into processes, and the plans that are refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridrl.cli import main
from hybridrl.config import ConfigError, load_config
from hybridrl.placement.plan import ClusterSpec, plan_placement, resolve_backends
from hybridrl.plugins.discovery import get_registry
from hybridrl.plugins.registry import Registry

QUICKSTART = str(Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml")
SPLIT_2x8 = ["pools={train: {nodes: 2, devices_per_node: 4}, gen: {nodes: 2, devices_per_node: 4}}",
             "roles.actor.pool=train", "roles.ref.pool=train", "roles.rollout.pool=gen"]
CLUSTER_2x8 = ClusterSpec(2, 8, "cuda", declared=True)


def plan_for(overrides, cluster=CLUSTER_2x8, registry=None):
    cfg = load_config(QUICKSTART, overrides)
    registry = registry or get_registry()
    backends, problems = resolve_backends(cfg, registry, check_engines=False)
    assert not problems, problems
    return plan_placement(cfg, cluster, backends)


def test_split_plan_on_declared_2x8_cluster():
    plan = plan_for(SPLIT_2x8)
    train = plan.pools["train"]
    gen = plan.pools["gen"]
    assert [str(d) for d in train] == [f"node{n}:{i}" for n in (0, 1) for i in range(4)]
    assert [str(d) for d in gen] == [f"node{n}:{i}" for n in (0, 1) for i in range(4, 8)]
    group = plan.group_of("actor")
    assert group is plan.group_of("ref") and set(group.roles) == {"actor", "ref"} and group.world_size == 8
    assert plan.group_of("rollout").world_size == 8
    assert not plan.colocated("actor", "rollout")
    assert plan.split_roles() == ["rollout"]
    rows = plan.rows()
    assert len(rows) == 16
    assert ("node1:7", "gen", "proc 0 (any)", "rollout[hf] rank 7/8") in rows
    assert "split pools (broadcast)" in plan.render()


def test_colocated_plan_fuses_roles_into_one_process_per_device():
    plan = plan_for(["pools.main.nodes=2", "pools.main.devices_per_node=8"])
    assert len(plan.groups) == 1
    assert set(plan.groups[0].roles) == {"actor", "ref", "rollout"} and plan.groups[0].world_size == 16
    assert "in-process" in plan.render()


def test_plan_cli_prints_the_device_map(capsys):
    assert main(["plan", QUICKSTART, *SPLIT_2x8, "--cluster", "2x8"]) == 0
    out = capsys.readouterr().out
    assert "2 node(s) x 8 GPU(s) (declared)" in out
    # devices print as runs: the same indices on consecutive nodes are one row
    assert "node0-1:0-3  train" in out and "actor[fsdp] ranks 0-7/8, ref[fsdp] ranks 0-7/8" in out
    assert "node0-1:4-7  gen" in out and "rollout[hf] ranks 0-7/8" in out


@pytest.mark.parametrize("overrides, key, text", [
    (["pools.main.nodes=3", "pools.main.devices_per_node=8"], "pools", "ask for 24 devices"),
    (["pools={a: {nodes: 2, devices_per_node: 8}, b: {nodes: 1, devices_per_node: 1}}", "roles.actor.pool=a",
      "roles.ref.pool=a", "roles.rollout.pool=b"], "pools", "ask for 17 devices"),
    (["roles.rollout.pool=gen"], "roles.rollout.pool", "unknown pool 'gen'"),
    (["pools.main.devices_per_node=9"], "pools.main.devices_per_node", "a node has 8"),
])
def test_bad_plans_are_rejected_naming_the_key(overrides, key, text, capsys):
    with pytest.raises(ConfigError) as err:
        plan_for(overrides)
    problems = dict(err.value.problems)
    assert key in problems and text in problems[key], problems
    assert main(["plan", QUICKSTART, *overrides, "--cluster", "2x8"]) == 2
    assert key in capsys.readouterr().err


def test_roles_whose_backends_cannot_share_a_process():
    registry = Registry()
    registry.add_train_engine("fsdp", "x:y", process_family="torch-dist")
    registry.add_train_engine("megatron", "x:y", process_family="megatron")
    registry.add_rollout("hf", "x:y")
    overrides = ["roles.ref.backend=megatron"]
    with pytest.raises(ConfigError) as err:
        plan_for(overrides, registry=registry)
    (key, reason), = err.value.problems
    assert key == "roles (pool 'main')" and "cannot share a process" in reason and "ref[megatron]" in reason
    plan = plan_for([*overrides, "cluster.max_colocate_count=2"], registry=registry)
    assert [sorted(g.roles) for g in plan.groups] == [["actor", "rollout"], ["ref"]]
    assert [g.slot for g in plan.groups] == [0, 1]
    assert not plan.same_process("actor", "ref") and plan.colocated("actor", "ref")


def test_backend_that_cannot_run_on_the_cluster_device():
    registry = Registry()
    registry.add_train_engine("fsdp", "x:y")
    registry.add_rollout("hf", "x:y", devices=("cuda",))
    with pytest.raises(ConfigError, match="runs on cuda, the cluster has cpu"):
        plan_for([], cluster=ClusterSpec(1, 2, "cpu"), registry=registry)
