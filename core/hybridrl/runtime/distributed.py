"""torch.distributed set-up for the processes that host engines (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def node_ip() -> str:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # no packet is sent; picks the outward interface
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def collective_backend(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def init_process_group(rank: int, world_size: int, master_addr: str, master_port: int, device: str,
                       timeout_s: float = 600.0) -> None:
    """Initialise the default process group of this process once (a no-op when it already exists)."""
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", master_addr)
    os.environ.setdefault("MASTER_PORT", str(master_port))
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend=collective_backend(device), init_method=f"tcp://{master_addr}:{master_port}",
                            rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))


def all_reduce_sum(values: list[float], device: str = "cpu") -> list[float]:
    """Sum a few floats over all ranks (identity without a process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()
