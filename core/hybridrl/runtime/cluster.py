"""Ray: start a local cluster or join one, read its size, and turn pools into placement groups."""

from __future__ import annotations

import os
from typing import Any

from hybridrl.config import ClusterConfig
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
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    key = "GPU" if device == "cuda" else "CPU"
    per_node = [int(n["Resources"].get(key, 0)) for n in nodes]
    per_node = [c for c in per_node if c > 0] or [0]
    return ClusterSpec(len(per_node), min(per_node), device)


def ensure_ray(cfg: ClusterConfig, env: dict[str, str] | None = None) -> None:
    """Join ``cluster.address`` / ``RAY_ADDRESS`` when given, else start a local Ray sized to this machine."""
    import ray

    if ray.is_initialized():
        return
    runtime_env: dict[str, Any] = {"env_vars": dict(env or {})}
    address = ray_address(cfg)
    if address:
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
    else:
        ray.init(num_cpus=os.cpu_count() or 1, runtime_env=runtime_env, include_dashboard=False,
                 log_to_driver=True, configure_logging=False)


def bundle_resources(device: str, cpus: float) -> dict[str, float]:
    return {"CPU": cpus, "GPU": 1.0} if device == "cuda" else {"CPU": cpus}


def create_placement_group(n_devices: int, device: str, cpus_per_device: float, name: str,
                           timeout_s: float = 120.0) -> Any:
    """One bundle per device; waits until Ray has reserved them all."""
    import ray
    from ray.util.placement_group import placement_group

    bundles = [bundle_resources(device, cpus_per_device) for _ in range(n_devices)]
    pg = placement_group(bundles, strategy="PACK", name=name)
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(pg)
        raise RuntimeError(f"Ray could not reserve pool '{name}' ({n_devices} x {bundles[0]}) within {timeout_s:.0f}s; "
                           f"available: {ray.available_resources()}") from None
    return pg
