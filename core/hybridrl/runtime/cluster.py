"""Ray: start a local cluster or join one, read its size, and turn pools into placement groups."""

from __future__ import annotations

import os
from typing import Any

from hybridrl.config import ClusterConfig, ConfigError
from hybridrl.placement.plan import ClusterSpec


def local_device_kind(requested: str) -> str:
    if requested != "auto":
        return requested
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 - a broken CUDA install means CPU
        return "cpu"


def declared_cluster(cfg: ClusterConfig) -> ClusterSpec | None:
    """The cluster given in config (``cluster.nodes``/``devices_per_node``), for plans made elsewhere."""
    if cfg.nodes is None and cfg.devices_per_node is None:
        return None
    device = "cuda" if cfg.device == "auto" else cfg.device
    return ClusterSpec(cfg.nodes or 1, cfg.devices_per_node or 1, device, declared=True)


def ray_address(cfg: ClusterConfig) -> str | None:
    return cfg.address or os.environ.get("RAY_ADDRESS") or None


def detect_cluster(cfg: ClusterConfig) -> ClusterSpec:
    """Declared cluster, else the Ray cluster being joined, else this machine (GPUs, or CPU cores as slots)."""
    declared = declared_cluster(cfg)
    if declared is not None:
        return declared
    if ray_address(cfg):
        ensure_ray(cfg)
        return cluster_from_ray(local_device_kind(cfg.device))
    device = local_device_kind(cfg.device)
    if device == "cuda":
        import torch

        return ClusterSpec(1, torch.cuda.device_count(), "cuda")
    return ClusterSpec(1, os.cpu_count() or 1, "cpu")


def cluster_from_ray(device: str) -> ClusterSpec:
    """The joined Ray cluster's size (alive nodes with devices of ``device``'s kind; the smallest sets the
    devices per node) and its nodes, the head first, then by address."""
    import ray

    from hybridrl.placement.plan import NodeHost

    key = "GPU" if device == "cuda" else "CPU"
    hosts = [NodeHost(n["NodeID"], n["NodeManagerAddress"], int(n["Resources"].get(key, 0)),
                      head="node:__internal_head__" in n["Resources"])
             for n in ray.nodes() if n.get("Alive")]
    hosts = sorted((h for h in hosts if h.devices > 0), key=lambda h: (not h.head, h.ip, h.node_id))
    if not hosts:
        return ClusterSpec(1, 0, device)
    return ClusterSpec(len(hosts), min(h.devices for h in hosts), device, hosts=tuple(hosts))


def ensure_ray(cfg: ClusterConfig, env: dict[str, str] | None = None) -> None:
    """Join ``cluster.address`` / ``RAY_ADDRESS`` when given (after checking that it answers), else start a
    local Ray sized to this machine, reachable from it only (``hybridrl.runtime.local_ray``)."""
    import ray

    if ray.is_initialized():
        return
    runtime_env: dict[str, Any] = {"env_vars": dict(env or {})}
    address = ray_address(cfg)
    if address:
        problem = address_problem(address)
        if problem:
            key = "cluster.address" if cfg.address else "RAY_ADDRESS"
            raise ConfigError([(key, problem)])
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
    else:
        from hybridrl.runtime.local_ray import LOOPBACK_ENV, start_local_ray

        runtime_env["env_vars"] = {**LOOPBACK_ENV, **runtime_env["env_vars"]}
        start_local_ray(os.cpu_count() or 1, runtime_env)


#: the ports Ray listens on when an address gives none: the GCS (``host``), the Ray Client (``ray://host``).
GCS_PORT, CLIENT_PORT = 6379, 10001


#: the whole budget of the check of a ``cluster.address``: one TCP connection, then one call to its GCS.
ADDRESS_TIMEOUT_S = 5.0


def gcs_problem(address: str, timeout_s: float) -> str | None:
    """Why ``address`` (host:port, something accepts TCP there) is not a Ray head: one call to its GCS, given
    ``timeout_s`` in all. A firewall or proxy that accepts every connection answers it with an HTTP error; a GCS
    answers, or refuses a client without its token (still a Ray head: ``ray.init`` reports that itself).
    Ray's client waits about 40 s on a peer that accepts and never answers (its connect, pub-sub and cluster-id
    timeouts, whatever the call's own), so the call runs in a thread that is abandoned at the deadline."""
    import threading

    try:
        from ray._raylet import GcsClient
    except ImportError:  # pragma: no cover - another Ray layout: the TCP check alone
        return None
    outcome: list[BaseException | None] = []

    def call() -> None:
        try:
            GcsClient(address=address).internal_kv_keys(b"", namespace=None, timeout=timeout_s)
            outcome.append(None)
        except Exception as exc:  # noqa: BLE001 - whatever the client raises says something about the peer
            outcome.append(exc)

    thread = threading.Thread(target=call, name="gcs-probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        return f"it accepts connections, but no Ray head replied there within {timeout_s:.0f}s"
    exc = outcome[0]
    if exc is None:
        return None
    text = str(exc).lower()
    if any(word in text for word in ("auth", "token", "permission")):
        return None
    return f"no Ray head replied there ({str(exc).strip().splitlines()[0][:200]})"


def address_problem(address: str, timeout_s: float = ADDRESS_TIMEOUT_S) -> str | None:
    """Why ``address`` cannot be joined, found by one TCP connection and one call to its GCS within ``timeout_s``
    in all (``ray.init`` would retry for about 40 s and end in a traceback); None when a Ray head answers.
    ``auto`` and ``local`` are left to Ray (they look for a cluster started on this machine)."""
    import socket
    import time

    if address in ("auto", "local"):
        return None
    deadline = time.monotonic() + timeout_s
    client = address.startswith("ray://")
    hostport = address.removeprefix("ray://").rstrip("/")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        host, port = hostport, str(CLIENT_PORT if client else GCS_PORT)
    host = host.strip("[]")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
        left = max(1.0, deadline - time.monotonic())
        why = None if client else gcs_problem(f"{host}:{port}", left)
        if why is None:
            return None
    except socket.gaierror:
        why = f"the host '{host}' does not resolve"
    except TimeoutError:
        why = f"nothing answered on port {port} within {timeout_s:.0f}s"
    except OSError as exc:
        why = (exc.strerror or str(exc)).lower()
    except ValueError as exc:
        why = str(exc)
    return (f"the address '{address}' does not answer ({why}): start the cluster's head there (ray start --head), "
            "correct the address, or leave it unset to run on a local Ray")


def bundle_resources(device: str, cpus: float) -> dict[str, float]:
    return {"CPU": cpus, "GPU": 1.0} if device == "cuda" else {"CPU": cpus}


def create_placement_group(n_devices: int, device: str, cpus_per_device: float, name: str,
                           timeout_s: float = 120.0, strategy: str = "PACK") -> Any:
    """One bundle per device, placed with ``strategy`` (``PoolPlacement``); waits until Ray has reserved them all."""
    import ray
    from ray.util.placement_group import placement_group

    bundles = [bundle_resources(device, cpus_per_device) for _ in range(n_devices)]
    pg = placement_group(bundles, strategy=strategy, name=name)
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(pg)
        one_node = " on one node" if strategy == "STRICT_PACK" else ""
        raise RuntimeError(f"Ray could not reserve pool '{name}' ({n_devices} x {bundles[0]}{one_node}, {strategy}) "
                           f"within {timeout_s:.0f}s; available: {ray.available_resources()}") from None
    return pg
