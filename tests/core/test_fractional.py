"""Fractional devices: a pool that shares another pool's devices (``pools.<name>.share``), both resident at once.

The plan, the memory arithmetic, the transport and the refusals run here; the CUDA IPC transport itself needs a
GPU (the ``gpu`` test below, in the GPU host's ``gpu-tests``).
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
import torch

from hybridrl.config import ConfigError, load_config
from hybridrl.placement.memory import estimate_memory, read_hf_config, shape_from_hf_config
from hybridrl.placement.plan import ClusterSpec, plan_placement, resolve_backends
from hybridrl.plugins.discovery import get_registry
from hybridrl.weights.bridges import bridge_placement_problems, resolve_transport
from hybridrl.weights.buckets import describe_bucket, pack_bucket, unpack_bucket

QUICKSTART = str(Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml")
QWEN_05B = str(Path(__file__).resolve().parents[2] / "examples" / "configs" / "qwen2.5-0.5b")
FRACTIONAL = ["pools={train: {nodes: 1, devices_per_node: 2}, gen: {nodes: 1, devices_per_node: 2, share: train}}",
              "roles.actor.pool=train", "roles.ref.pool=train", "roles.rollout.pool=gen"]


def plan_for(overrides, cluster):
    cfg = load_config(QUICKSTART, overrides)
    backends, problems = resolve_backends(cfg, get_registry(), check_engines=False)
    assert not problems, problems
    return cfg, plan_placement(cfg, cluster, backends)


def test_a_sharing_pool_runs_on_the_devices_of_the_pool_it_shares():
    cfg, plan = plan_for(FRACTIONAL, ClusterSpec(1, 2, "cuda", declared=True))  # two pools on two GPUs
    assert plan.pools["gen"] == plan.pools["train"] and [str(d) for d in plan.pools["gen"]] == ["node0:0", "node0:1"]
    assert plan.fractional("actor", "rollout") and not plan.colocated("actor", "rollout")
    assert plan.same_devices("actor", "ref") and not plan.fractional("actor", "ref")
    assert plan.processes_per_device("gen") == plan.processes_per_device("train") == 2
    assert set(plan.placements) == {"train"}  # the sharing pool takes its host's bundles
    assert resolve_transport("auto", plan) == "cuda_ipc"
    assert bridge_placement_problems(cfg, plan, get_registry()) == []
    text = plan.render()
    assert "fractional: pool 'gen' runs on the devices of pool 'train'" in text
    assert "reshard actor -> rollout: fractional devices, separate processes" in text


def test_on_cpu_a_sharing_pool_gets_its_weights_by_broadcast():
    _, plan = plan_for(FRACTIONAL, ClusterSpec(1, 2, "cpu", declared=True))
    assert resolve_transport("auto", plan) == "broadcast"


def test_cuda_ipc_is_refused_between_pools_on_different_devices():
    split = ["pools={train: {nodes: 1, devices_per_node: 1}, gen: {nodes: 1, devices_per_node: 1}}",
             "roles.actor.pool=train", "roles.ref.pool=train", "roles.rollout.pool=gen",
             "roles.rollout.weight_transport=cuda_ipc"]
    cfg, plan = plan_for(split, ClusterSpec(1, 2, "cuda", declared=True))
    [(key, text)] = bridge_placement_problems(cfg, plan, get_registry())
    assert key == "roles.rollout.weight_transport" and "pools.<name>.share: train" in text


def test_the_memory_plan_holds_the_rollout_resident_through_the_trainers_phases():
    cfg, plan = plan_for(FRACTIONAL, ClusterSpec(1, 2, "cuda", declared=True))
    shape = shape_from_hf_config(read_hf_config(QWEN_05B))
    est = estimate_memory(cfg, plan, shape, 80 * 2**30)
    [pool] = est.pools  # one row for the two pools on the same devices
    assert pool.pool == "train" and pool.shared_by == ["gen"] and pool.processes == 2
    rollout = next(m for m in est.roles if m.role == "rollout")
    actor = next(m for m in est.roles if m.role == "actor")
    # while the actor updates, the rollout keeps its KV cache and weights (it is generating the next step)
    assert pool.phases["update_actor"] >= actor.active + rollout.active
    colocated = estimate_memory(cfg.model_copy(update={"pools": {"train": cfg.pools["train"]}}),
                                plan_for(["pools={train: {nodes: 1, devices_per_node: 2}}", "roles.actor.pool=train",
                                          "roles.ref.pool=train", "roles.rollout.pool=train"],
                                         ClusterSpec(1, 2, "cuda", declared=True))[1],
                                shape, 80 * 2**30)
    assert pool.phases["update_actor"] > colocated.pools[0].phases["update_actor"]  # asleep there


@pytest.mark.parametrize("pools, text", [
    ("{train: {}, gen: {share: gen}}", "cannot share its own devices"),
    ("{train: {}, gen: {share: nope}}", "unknown pool 'nope'"),
    ("{train: {}, mid: {share: train}, gen: {share: mid}}", "itself shares pool 'train'"),
    ("{train: {devices_per_node: 2}, gen: {share: train}}", "the same nodes and devices_per_node"),
])
def test_bad_sharing_is_refused_with_its_key(pools, text):
    with pytest.raises(ConfigError) as err:
        load_config(QUICKSTART, [f"pools={pools}", "roles.actor.pool=train", "roles.ref.pool=train",
                                 "roles.rollout.pool=gen"])
    assert "share" in str(err.value) and text in str(err.value)


def test_sharing_a_pool_without_roles_is_refused():
    with pytest.raises(ConfigError, match=r"pools.gen.share.*pool 'spare' has no role"):
        plan_for(["pools={train: {}, spare: {}, gen: {share: spare}}", "roles.actor.pool=train", "roles.ref.pool=train",
                  "roles.rollout.pool=gen"], ClusterSpec(1, 2, "cuda", declared=True))


def test_a_bucket_packs_into_a_kept_buffer_and_unpacks_to_the_same_tensors():
    bucket = [("a", torch.randn(3, 5)), ("b", torch.arange(7, dtype=torch.int64)), ("c", torch.randn(4))]
    spec = describe_bucket(bucket, torch.bfloat16)
    kept = torch.zeros(spec.nbytes + 100, dtype=torch.uint8)
    packed = pack_bucket(bucket, spec, "cpu", out=kept)
    assert packed.data_ptr() == kept.data_ptr() and packed.numel() == spec.nbytes
    for (name, want), (got_name, got) in zip(bucket, unpack_bucket(kept, spec)):
        assert name == got_name
        expected = want.to(torch.bfloat16) if want.is_floating_point() else want
        assert torch.equal(got, expected)


def _receive(queue_in, queue_out):
    from hybridrl.weights.cuda_ipc import IpcReceiver

    receiver = IpcReceiver()
    while (offer := queue_in.get()) is not None:
        bucket = receiver.open(offer)
        queue_out.put([(name, t.float().sum().item(), t.data_ptr()) for name, t in bucket])
        receiver.done()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
def test_cuda_ipc_hands_a_bucket_to_another_process_and_reuses_its_buffer():
    from hybridrl.weights.cuda_ipc import IpcSender

    ctx = mp.get_context("spawn")
    queue_in, queue_out = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_receive, args=(queue_in, queue_out))
    child.start()
    try:
        sender = IpcSender()
        first = [("w", torch.randn(64, 64, device="cuda")), ("b", torch.randn(64, device="cuda"))]
        offer = sender.offer(first, torch.bfloat16)
        queue_in.put(offer)
        got = queue_out.get(timeout=60)
        assert [n for n, _, _ in got] == ["w", "b"]
        for (_, want), (_, total, _) in zip(first, got):
            assert total == pytest.approx(want.to(torch.bfloat16).float().sum().item(), rel=1e-3, abs=1e-2)
        second = [("w", torch.ones(64, 64, device="cuda")), ("b", torch.full((64,), 2.0, device="cuda"))]
        offer2 = sender.offer(second, torch.bfloat16)
        assert offer2.generation == offer.generation  # same buffer, mapped once
        queue_in.put(offer2)
        got2 = queue_out.get(timeout=60)
        assert [total for _, total, _ in got2] == [64 * 64.0, 128.0]
        assert got2[0][2] == got[0][2]  # the receiver reads the same mapping
    finally:
        queue_in.put(None)
        child.join(timeout=60)
    assert child.exitcode == 0


REPLICAS = ["pools={train: {nodes: 1, devices_per_node: 2}, "
            "gen: {nodes: 1, devices_per_node: 2, share: train, per_device: 2}}",
            "roles.actor.pool=train", "roles.ref.pool=train", "roles.rollout.pool=gen"]


def test_per_device_puts_several_rollout_ranks_on_each_device():
    cfg, plan = plan_for(REPLICAS, ClusterSpec(1, 2, "cuda", declared=True))
    assert [str(d) for d in plan.pools["gen"]] == ["node0:0", "node0:0", "node0:1", "node0:1"]
    assert plan.group_of("rollout").world_size == 4 and plan.per_device("gen") == 2
    assert plan.unique_devices("gen") == plan.pools["train"]
    assert plan.processes_per_device("train") == 3  # the trainers' process and two replicas
    assert "pool 'gen': 2 ranks per device" in plan.render()
    assert "rollout[hf] ranks 0-3/4" in plan.render()
    from hybridrl.placement.memory import step_workload
    assert step_workload(cfg)["replicas_per_device"] == 2


def test_per_device_multiplies_the_rollouts_memory_on_its_device():
    shape = shape_from_hf_config(read_hf_config(QWEN_05B))
    one_cfg, one = plan_for(FRACTIONAL, ClusterSpec(1, 2, "cuda", declared=True))
    two_cfg, two = plan_for(REPLICAS, ClusterSpec(1, 2, "cuda", declared=True))
    rollout = {name: next(m for m in estimate_memory(c, p, shape, 80 * 2**30).roles if m.role == "rollout")
               for name, (c, p) in {"one": (one_cfg, one), "two": (two_cfg, two)}.items()}
    assert rollout["two"].weights == rollout["one"].weights  # per replica: a whole copy of the weights
    assert rollout["two"].kv_cache < rollout["one"].kv_cache  # and half the step's sequences
    [pool] = estimate_memory(two_cfg, two, shape, 80 * 2**30).pools
    actor = next(m for m in estimate_memory(two_cfg, two, shape, 80 * 2**30).roles if m.role == "actor")
    assert pool.phases["update_actor"] >= actor.active + 2 * rollout["two"].active


@pytest.mark.parametrize("extra, text", [
    (["roles.rollout.pool=train", "pools.train.per_device=2"], "also holds actor, ref"),
    (["roles.rollout.tensor_parallel=2", "roles.rollout.backend=vllm"], "tensor_parallel must be 1"),
])
def test_per_device_is_refused_where_it_cannot_hold(extra, text):
    with pytest.raises(ConfigError, match=r"pools\.(train|gen)\.per_device") as err:
        plan_for([*REPLICAS, *extra], ClusterSpec(1, 2, "cuda", declared=True))
    assert text in str(err.value)


def test_pools_that_do_not_fit_one_device_together_are_refused_with_the_numbers():
    from hybridrl.placement.memory import fractional_problems

    shape = shape_from_hf_config(read_hf_config(QWEN_05B))
    long_steps = ["data.prompts_per_step=64", "algorithm.n_samples=8", "roles.rollout.max_new_tokens=4096",
                  "roles.actor.micro_batch=1", "roles.actor.options.gradient_checkpointing=true",
                  "model.dtype=bfloat16"]
    cfg, plan = plan_for([*FRACTIONAL, *long_steps], ClusterSpec(1, 2, "cuda", declared=True))
    assert fractional_problems(estimate_memory(cfg, plan, shape, 80 * 2**30)) == []
    [(key, text)] = fractional_problems(estimate_memory(cfg, plan, shape, 16 * 2**30))
    assert key == "pools.gen.share"
    assert "pools 'train' + 'gen' need" in text and "more than the 16 GiB device" in text and "resident" in text


def test_each_replica_on_a_device_sizes_its_cache_from_its_share_of_the_free_memory():
    from hybridrl.rollout.kv_budget import free_share

    assert free_share(10 * 2**30, {}) == 10 * 2**30
    assert free_share(10 * 2**30, {"workload": {"sequences": 512, "tokens_per_sequence": 64}}) == 10 * 2**30
    assert free_share(10 * 2**30, {"workload": {"replicas_per_device": 4}}) == 10 * 2**30 // 4
