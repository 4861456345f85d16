"""torch.distributed set-up for the processes that host engines (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

#: seconds a collective (or a rendezvous) may wait for its peers before it fails: a peer that died or hangs
#: ends the run with an error instead of a hang. Every group of the run is made with it.
COLLECTIVE_TIMEOUT_S = float(os.environ.get("HYBRIDRL_COLLECTIVE_TIMEOUT_S", "600"))

#: listening sockets reserved by ``reserve_port`` (port -> socket) for the store this process will host.
_reserved: dict[int, socket.socket] = {}
_in_use: list[socket.socket] = []  # handed to a store: kept open as long as the process lives


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def reserve_port(host: str) -> int:
    """A port of ``host`` bound and listening now, for the TCP store this process will host on it
    (``tcp_store``): bound to that address only (a store binds every interface when it opens its own), and
    never taken by another process in between."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen(128)
    port = int(sock.getsockname()[1])
    _reserved[port] = sock
    return port


def tcp_store(host: str, port: int, world_size: int, is_master: bool,
              timeout_s: float = COLLECTIVE_TIMEOUT_S) -> dist.TCPStore:
    """The rendezvous store at ``host:port``; the master serves it from the socket ``reserve_port`` bound."""
    sock = _reserved.pop(port, None) if is_master else None
    if sock is not None:
        _in_use.append(sock)
    return dist.TCPStore(host, port, world_size, is_master=is_master, timeout=timedelta(seconds=timeout_s),
                         master_listen_fd=sock.fileno() if sock is not None else None)


def node_ip() -> str:
    """This node's address as the run's Ray knows it (127.0.0.1 on a local run), else the outward interface's."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:  # pragma: no cover - ray is a core dependency
        pass
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # no packet is sent; picks the outward interface
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def collective_backend(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def init_process_group(rank: int, world_size: int, master_addr: str, master_port: int, device: str,
                       timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
    """Initialise the default process group of this process once (a no-op when it already exists). Rank 0
    serves the rendezvous from the port it reserved (``reserve_port``) when it did."""
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", master_addr)
    os.environ.setdefault("MASTER_PORT", str(master_port))
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    store = tcp_store(master_addr, master_port, world_size, rank == 0, timeout_s)
    dist.init_process_group(backend=collective_backend(device), store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))


def all_reduce_sum(values: list[float], device: str = "cpu") -> list[float]:
    """Sum a few floats over all ranks (identity without a process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()
