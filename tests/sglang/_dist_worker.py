"""One side of the split-mode protocol test over gloo (run as a script by ``test_sglang_logic``).

``sender``: the trainer side, ``hybridrl_sglang.distributed`` (``open_group`` + ``broadcast_buckets``).
``receiver``: what SGLang 0.5.16's scheduler does, written out here independently of the plugin: its
``init_custom_process_group`` (rendezvous + ``PrefixStore(group_name)`` + ``_new_process_group_helper``) and its
``_update_bucketed_weights_from_distributed`` (empty tensors, ``FlattenedTensorBucket`` = concatenated uint8
views, one broadcast from rank 0, slices viewed back)."""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch


def _bucket_state(seed: int) -> list[list[tuple[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    return [
        [("a.weight", torch.randn(3, 5, generator=g)), ("a.bias", torch.randn(5, generator=g)),
         ("steps", torch.arange(7, dtype=torch.int32))],
        [("b.weight", torch.randn(4, 3, generator=g).to(torch.float64)), ("c", torch.randn(1, generator=g))],
    ]


def _sglang_group(host: str, port: int, rank: int, world: int, group_name: str):
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = timedelta(seconds=60)
    store, rank, world = next(rendezvous(f"tcp://{host}:{port}", rank, world, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world, rank, [], Backend("gloo"), store, group_name=group_name,
                                      backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world)}
    return pg


def _sglang_receive(pg, names, dtypes, shapes) -> list[tuple[str, torch.Tensor]]:
    named = [(n, torch.empty(s, dtype=getattr(torch, d))) for n, d, s in zip(names, dtypes, shapes)]
    flat = torch.cat([t.flatten().view(torch.uint8) for _, t in named], dim=0)
    meta, idx = [], 0
    for n, t in named:
        k = t.flatten().view(torch.uint8).numel()
        meta.append((n, t.shape, t.dtype, idx, idx + k))
        idx += k
    torch.distributed.broadcast(flat, src=0, group=pg)
    return [(n, flat[s:e].view(dt).reshape(sh)) for n, sh, dt, s, e in meta]


def _close(pg) -> None:
    """Both sides reach the end before either exits, and the group is torn down before the interpreter is: a
    process that leaves with gloo's threads still connected can abort at exit ("terminate called without an
    active exception")."""
    torch.distributed.barrier(group=pg)
    torch.distributed.destroy_process_group(pg)


def main() -> None:
    role, port, out, engine_dtype = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    from hybridrl.weights.buckets import describe_bucket
    from hybridrl_sglang.distributed import broadcast_buckets, open_group, receive_layout

    buckets = _bucket_state(0)
    layout = receive_layout([describe_bucket(b) for b in buckets], engine_dtype)
    if role == "sender":
        pg = open_group("127.0.0.1", port, 0, 2, "grp", "gloo", timeout_s=60)
        sent = broadcast_buckets(pg, buckets, layout, "cpu")
        json.dump({"sent": sent}, open(out, "w"))
        _close(pg)
        return
    pg = _sglang_group("127.0.0.1", port, 1, 2, "grp")
    got = {}
    for entries in layout:
        names = [e[0] for e in entries]
        dtypes = [e[1] for e in entries]
        shapes = [e[2] for e in entries]
        for name, tensor in _sglang_receive(pg, names, dtypes, shapes):
            got[name] = {"dtype": str(tensor.dtype), "shape": list(tensor.shape),
                         "values": tensor.to(torch.float64).flatten().tolist()}
    json.dump(got, open(out, "w"))
    _close(pg)


if __name__ == "__main__":
    main()
