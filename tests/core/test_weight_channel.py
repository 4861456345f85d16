"""The broadcast bridge's pieces without Ray: bucket packing, and a real gloo channel between processes."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from hybridrl.runtime.distributed import free_port
from hybridrl.weights.buckets import ALIGN, describe_bucket, pack_bucket, unpack_bucket
from hybridrl.weights.channel import WeightChannel


def sample_bucket(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [("a.weight", torch.randn(3, 5, generator=g)),
            ("b.bias", torch.randn(7, generator=g).to(torch.bfloat16)),
            ("c.idx", torch.arange(3, dtype=torch.int64)),
            ("d.weight", torch.randn(2, 2, 2, generator=g).to(torch.float16))]


def test_pack_unpack_round_trip_is_bit_exact_across_dtypes():
    bucket = sample_bucket()
    spec = describe_bucket(bucket)
    assert all(t.offset % ALIGN == 0 for t in spec.tensors)
    assert spec.nbytes >= sum(t.numel() * t.element_size() for _, t in bucket)
    out = unpack_bucket(pack_bucket(bucket, spec, "cpu"), spec)
    assert [n for n, _ in out] == [n for n, _ in bucket]
    for (_, a), (_, b) in zip(bucket, out):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_a_wire_dtype_casts_floating_tensors_while_packing_and_keeps_integers():
    bucket = sample_bucket(1)
    spec = describe_bucket(bucket, torch.bfloat16)
    assert [t.dtype for t in spec.tensors] == ["bfloat16", "bfloat16", "int64", "bfloat16"]
    assert [t.nbytes for t in spec.tensors] == [15 * 2, 7 * 2, 3 * 8, 8 * 2]
    out = dict(unpack_bucket(pack_bucket(bucket, spec, "cpu"), spec))
    for name, tensor in bucket:
        want = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert out[name].dtype == want.dtype and torch.equal(out[name], want), name


def test_pack_refuses_a_bucket_in_another_order():
    bucket = sample_bucket()
    with pytest.raises(ValueError, match="bucket order changed"):
        pack_bucket(list(reversed(bucket)), describe_bucket(bucket), "cpu")


def _member(rank: int, world: int, port: int, n_buckets: int, queue) -> None:
    torch.set_num_threads(1)
    channel = WeightChannel("127.0.0.1", port, rank, world, "cpu", timeout_s=60)
    buckets = [sample_bucket(seed) for seed in range(n_buckets)]
    specs = [describe_bucket(b) for b in buckets]
    if rank == 0:
        queue.put(("sent", channel.send(iter(buckets), specs)))
        return
    received: list[tuple[str, torch.Tensor]] = []
    channel.receive(specs, lambda bucket: received.extend((n, t.clone()) for n, t in bucket))
    expected = [item for b in buckets for item in b]
    same = len(received) == len(expected) and all(
        n1 == n2 and torch.equal(t1, t2) for (n1, t1), (n2, t2) in zip(received, expected))
    queue.put((rank, same))


def test_channel_broadcasts_every_bucket_bit_for_bit_to_every_receiver():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port, world, n_buckets = free_port(), 3, 5
    procs = [ctx.Process(target=_member, args=(r, world, port, n_buckets, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in range(world))
    for p in procs:
        p.join(timeout=60)
    assert results[1] is True and results[2] is True
    assert results["sent"] == sum(describe_bucket(sample_bucket(s)).nbytes for s in range(n_buckets))


def _silent_sender_member(rank: int, port: int, timeout_s: float, queue) -> None:
    import time

    torch.set_num_threads(1)
    channel = WeightChannel("127.0.0.1", port, rank, 2, "cpu", timeout_s=timeout_s)
    specs = [describe_bucket(sample_bucket())]
    if rank == 0:  # joins the group, then never sends: a peer stuck elsewhere (or one that will never come)
        queue.put(("sender", "ready"))
        time.sleep(timeout_s * 6)
        return
    start = time.perf_counter()
    try:
        channel.receive(specs, lambda bucket: None)
        queue.put(("receiver", "received?!", time.perf_counter() - start))
    except RuntimeError as exc:
        queue.put(("receiver", str(exc).splitlines()[0], time.perf_counter() - start))


def test_a_receive_with_no_sender_fails_after_the_collective_timeout_instead_of_hanging():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port, timeout_s = free_port(), 3.0
    procs = [ctx.Process(target=_silent_sender_member, args=(r, port, timeout_s, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = {}
        for _ in range(2):
            item = queue.get(timeout=120)
            results[item[0]] = item[1:]
    finally:
        for p in procs:
            p.kill()
            p.join(timeout=30)
    message, waited = results["receiver"]
    assert "timed out" in message.lower() or "timeout" in message.lower(), message
    assert timeout_s * 0.8 <= waited < timeout_s * 5, waited


def _silent_nccl_member(rank: int, port: int, timeout_s: float, queue) -> None:
    import time

    torch.cuda.set_device(rank)
    channel = WeightChannel("127.0.0.1", port, rank, 2, "cuda", timeout_s=timeout_s)
    specs = [describe_bucket(sample_bucket())]
    if rank == 0:
        queue.put(("sender", "ready"))
        time.sleep(timeout_s * 6)
        return
    start = time.perf_counter()
    try:
        channel.receive(specs, lambda bucket: None)
        torch.cuda.synchronize()
        queue.put(("receiver", "received?!", time.perf_counter() - start))
    except Exception as exc:  # noqa: BLE001 - NCCL's watchdog error type varies by version
        queue.put(("receiver", f"{type(exc).__name__}: {exc}".splitlines()[0], time.perf_counter() - start))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (one per rank of the NCCL group)")
def test_an_nccl_receive_with_no_sender_fails_after_the_collective_timeout():
    """The NCCL group is made with the run's collective timeout (it had none: a dead sender hung the rollout)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port, timeout_s = free_port(), 10.0
    procs = [ctx.Process(target=_silent_nccl_member, args=(r, port, timeout_s, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        procs[1].join(timeout=timeout_s * 6 + 120)  # start-up, then the timeout: an error, or the watchdog's abort
        ended = not procs[1].is_alive()
    finally:
        for p in procs:
            p.kill()
            p.join(timeout=30)
    messages = []
    while not queue.empty():
        messages.append(queue.get())
    assert ended, "the receiver still waits for a sender that never sends"
    assert not any(m[0] == "receiver" and m[1] == "received?!" for m in messages), messages
