"""Plans for clusters of many nodes, without a cluster: how Ray is asked to place each pool (STRICT_PACK where a
node's devices talk over NVLink, SPREAD otherwise), devices printed as runs, and the bytes each weight sync moves
(``hybridrl.placement.reshard``) for the shipped Qwen2.5 7B, 32B and 72B configs on 4x8 and 32x8."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridrl.cli import main
from hybridrl.config import load_config
from hybridrl.placement.memory import model_shape, read_hf_config, shape_from_hf_config
from hybridrl.placement.plan import SPREAD, STRICT_PACK, ClusterSpec, plan_placement, resolve_backends
from hybridrl.placement.reshard import estimate_reshard
from hybridrl.plugins.discovery import get_registry

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
QUICKSTART = EXAMPLES / "quickstart.yaml"
SPLIT = ["pools={train: {nodes: 2, devices_per_node: 4}, gen: {nodes: 2, devices_per_node: 4}}",
         "roles.actor.pool=train", "roles.ref.pool=train", "roles.rollout.pool=gen"]
#: Qwen2.5 parameter counts (the published totals: 7.61B, 32.8B, 72.7B)
PARAMS = {"7b": 7_615_616_512, "32b": 32_763_876_352, "72b": 72_706_203_648}


def plan_of(config: Path | str, overrides: list[str], cluster: ClusterSpec):
    cfg = load_config(config, overrides)
    backends, problems = resolve_backends(cfg, get_registry(), check_engines=False)
    assert not problems, problems
    return cfg, plan_placement(cfg, cluster, backends)


def cuda(nodes: int, per_node: int = 8) -> ClusterSpec:
    return ClusterSpec(nodes, per_node, "cuda", declared=True)


# --- placement groups ----------------------------------------------------------------------------------

def test_a_trainer_over_gpus_is_packed_per_node_and_independent_replicas_spread():
    _, plan = plan_of(QUICKSTART, SPLIT, cuda(2))
    train, gen = plan.placements["train"], plan.placements["gen"]
    assert train.strategy == STRICT_PACK
    assert train.bundle_sets == ((0, 1, 2, 3), (4, 5, 6, 7))  # one group per node, in rank order
    assert "collectives" in train.reason
    assert gen.strategy == SPREAD and gen.bundle_sets == (tuple(range(8)),)


def test_a_tensor_parallel_rollout_is_packed_per_node():
    _, plan = plan_of(QUICKSTART, [*SPLIT, "roles.rollout.tensor_parallel=2"], cuda(2))
    gen = plan.placements["gen"]
    assert gen.strategy == STRICT_PACK and gen.bundle_sets == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert "tensor_parallel=2" in gen.reason


def test_cpu_slots_and_one_device_per_node_spread():
    _, plan = plan_of(QUICKSTART, ["pools.main.nodes=3"], ClusterSpec(3, 1, "cpu", declared=True))
    assert plan.placements["main"].strategy == SPREAD
    assert plan.placements["main"].bundle_sets == ((0, 1, 2),)
    _, plan = plan_of(QUICKSTART, ["pools.main.nodes=3"], cuda(3, 1))
    assert plan.placements["main"].strategy == SPREAD  # no NVLink between one GPU per node to keep


def test_devices_print_as_runs_of_nodes():
    _, plan = plan_of(QUICKSTART, SPLIT, cuda(2))
    assert plan.device_runs("train") == [("node0-1:0-3", 0, 7)]
    assert plan.device_runs("gen") == [("node0-1:4-7", 0, 7)]
    _, plan = plan_of(QUICKSTART, ["pools.main.nodes=3"], ClusterSpec(3, 1, "cpu", declared=True))
    assert plan.device_runs("main") == [("node0-2:0", 0, 2)]
    text = plan.render()
    assert "node0-2:0  main  proc 0 (torch-dist)  actor[fsdp] ranks 0-2/3" in text
    assert "pool 'main': SPREAD, 1 group of 3" in text


def test_the_plan_says_when_the_broadcast_crosses_nodes():
    one_node_each = ["pools={train: {nodes: 1, devices_per_node: 8}, gen: {nodes: 1, devices_per_node: 8}}",
                     "roles.actor.pool=train", "roles.ref.pool=train", "roles.rollout.pool=gen"]
    _, plan = plan_of(QUICKSTART, one_node_each, cuda(2))
    assert "reshard actor -> rollout: split pools (broadcast), between nodes" in plan.render()
    _, plan = plan_of(EXAMPLES / "qwen7b-split.yaml", [], cuda(1))
    assert "reshard actor -> rollout: split pools (broadcast)\n" in plan.render()


# --- reshard bytes -------------------------------------------------------------------------------------

def test_shipped_configs_have_the_published_sizes():
    for size, params in PARAMS.items():
        shape = shape_from_hf_config(read_hf_config(EXAMPLES / "configs" / f"qwen2.5-{size}"))
        assert shape.param_count() == params
        assert not shape.tie_word_embeddings and shape.qkv_bias


def test_split_broadcast_on_one_node():
    cfg, plan = plan_of(EXAMPLES / "qwen7b-split.yaml", [], cuda(1))
    shape, _ = model_shape(cfg, base_dirs=(ROOT,))
    est = estimate_reshard(cfg, plan, shape)
    weight = 2 * PARAMS["7b"]  # bf16 on the wire
    assert (est.transport, est.wire_dtype, est.weight_bytes) == ("broadcast", "bfloat16", weight)
    assert est.gather_bytes == pytest.approx(weight * 3 / 4)  # the other 3 of 4 FSDP shards
    assert est.delivered_bytes == 4 * weight and est.kept_bytes == weight
    assert est.cross_node_bytes == 0 and est.remote_nodes == 0


def test_split_broadcast_into_another_node():
    cfg, plan = plan_of(EXAMPLES / "qwen7b-split.yaml", ["pools.train.devices_per_node=8",
                                                          "pools.gen.devices_per_node=8"], cuda(2))
    est = estimate_reshard(cfg, plan, model_shape(cfg, base_dirs=(ROOT,))[0])
    weight = 2 * PARAMS["7b"]
    assert est.remote_nodes == 1 and est.gather_remote_bytes == 0  # the trainer's gather stays on node 0
    assert est.cross_node_bytes == weight and est.busiest_node_bytes == weight


def test_colocated_over_four_nodes_gathers_across_them():
    cfg, plan = plan_of(EXAMPLES / "qwen7b-colocated.yaml", ["pools.main.nodes=4"], cuda(4))
    est = estimate_reshard(cfg, plan, model_shape(cfg, base_dirs=(ROOT,))[0])
    weight = 2 * PARAMS["7b"]
    assert est.transport == "in_process" and est.trainer_ranks == 32
    assert est.gather_bytes == pytest.approx(weight * 31 / 32)
    assert est.gather_remote_bytes == pytest.approx(weight * 24 / 32)  # 24 of the 32 shards are on other nodes
    assert est.cross_node_bytes == pytest.approx(32 * weight * 24 / 32)
    assert est.busiest_node_bytes == pytest.approx(8 * weight * 24 / 32)


def test_tensor_parallel_engines_keep_a_slice_and_pipelining_syncs_less_often():
    cfg, plan = plan_of(EXAMPLES / "qwen72b-split.yaml", ["trainer.pipelined=true", "trainer.max_staleness=2",
                                                          "trainer.sync_every=2"], cuda(4))
    est = estimate_reshard(cfg, plan, model_shape(cfg, base_dirs=(ROOT,))[0])
    weight = 2 * PARAMS["72b"]
    assert est.kept_bytes == weight / 4
    assert est.syncs_per_step == 0.5 and est.per_step == est.delivered_bytes / 2


def test_cpu_and_the_object_store_move_fp32():
    cfg, plan = plan_of(EXAMPLES / "quickstart-split.yaml", [], ClusterSpec(1, 2, "cpu", declared=True))
    shape, _ = model_shape(cfg)
    est = estimate_reshard(cfg, plan, shape)
    assert est.wire_dtype == "float32" and est.weight_bytes == 4 * shape.param_count()
    cfg, plan = plan_of(EXAMPLES / "qwen7b-split.yaml", ["roles.rollout.weight_transport=object_store"], cuda(1))
    est = estimate_reshard(cfg, plan, model_shape(cfg, base_dirs=(ROOT,))[0])
    assert est.wire_dtype == "float32" and est.weight_bytes == 4 * PARAMS["7b"]


@pytest.mark.parametrize("example, overrides_32x8", [
    ("qwen7b-colocated", ["pools.main.nodes=32"]),
    ("qwen7b-split", ["pools.train.nodes=16", "pools.train.devices_per_node=8", "pools.gen.nodes=16",
                      "pools.gen.devices_per_node=8"]),
    ("qwen32b-colocated", ["pools.main.nodes=32"]),
    ("qwen32b-split", ["pools.train.nodes=24", "pools.gen.nodes=8"]),
    ("qwen72b-colocated", ["pools.main.nodes=32"]),
    ("qwen72b-split", ["pools.train.nodes=24", "pools.gen.nodes=8"]),
])
def test_plan_cli_prints_memory_and_reshard_for_large_clusters(example, overrides_32x8, capsys):
    config = str(EXAMPLES / f"{example}.yaml")
    assert main(["plan", config, *overrides_32x8, "--cluster", "32x8", "--skip-engine-check"]) == 0
    out = capsys.readouterr().out
    assert "cluster: 32 node(s) x 8 GPU(s) (declared)" in out
    assert "memory per device" in out and "DOES NOT FIT" not in out
    assert "reshard actor -> rollout" in out and "per step: >= " in out
    assert "ray placement groups:" in out and STRICT_PACK in out


# --- bridges that cannot span the placement ------------------------------------------------------------

def test_an_in_process_bridge_between_processes_is_refused(capsys):
    assert main(["plan", str(EXAMPLES / "quickstart-split.yaml"), "roles.rollout.weight_transport=in_process"]) == 2
    err = capsys.readouterr().err
    assert "roles.rollout.weight_transport: the 'in_process' bridge needs the actor and the rollout in one process" \
        in err and "pool 'gen'" in err


def test_a_node_local_bridge_between_pools_is_refused():
    from hybridrl.plugins.discovery import build_registry, plugin_manager
    from hybridrl.run.preflight import check_config

    registry = build_registry(plugin_manager(()))  # a registry of this test's own (get_registry's is shared)
    registry.current_plugin = "test-ipc"
    registry.add_bridge("fsdp", "hf", "broadcast", "x:IpcBridge", scope="node")  # e.g. CUDA IPC handles
    split = load_config(EXAMPLES / "qwen7b-split.yaml", [])
    _, _, problems = check_config(split, registry, cuda(2), check_engines=False)
    reasons = dict(problems)
    assert "reaches only within a machine" in reasons["roles.rollout.weight_transport"]
    assert "test-ipc" in reasons["roles.rollout.weight_transport"]
    colocated = load_config(EXAMPLES / "qwen7b-colocated.yaml", ["roles.rollout.weight_transport=broadcast"])
    _, _, problems = check_config(colocated, registry, cuda(1), check_engines=False)
    assert "roles.rollout.weight_transport" not in dict(problems)  # one pool: the same devices, one machine


def test_a_bridge_scope_must_be_known():
    from hybridrl.plugins.registry import Registry, RegistryError

    with pytest.raises(RegistryError, match="scope 'rack'"):
        Registry().add_bridge("*", "*", "broadcast", "x:y", scope="rack")
