"""Turn a placement plan into running worker groups: placement groups, Ray actors, process groups, engines."""

from __future__ import annotations

import logging
import os
from typing import Any

from hybridrl.config import RunConfig
from hybridrl.engines import TrainingOptions
from hybridrl.errors import HybridRLError
from hybridrl.lora import LoraSpec, reference_is_actor_base
from hybridrl.placement.plan import STRICT_PACK, PlacementPlan, PoolPlacement
from hybridrl.roles import role_spec
from hybridrl.runtime.cluster import create_placement_group, ensure_ray
from hybridrl.runtime.deadline import CallDeadline
from hybridrl.runtime.device_map import render_device_map, write_device_map
from hybridrl.runtime.group import WorkerGroup, unique_groups
from hybridrl.runtime.worker import RoleWorker

log = logging.getLogger(__name__)

TRAIN_ROLE_FIELDS = {"pool", "backend", "options"}


class EngineStartError(HybridRLError, RuntimeError):
    """A role's engine raised in its constructor, on a worker: one line naming the role, the backend and the
    engine's own error (the worker's traceback stays in its log), so the user reads the cause, not Ray's
    wrapping of it."""


#: what a worker that vanished without a Python error most often met while its engine started.
DIED_HINT = ("the worker process ended without a Python error: on Linux the kernel kills a process when the host "
             "runs out of memory (see dmesg); the device map's 'host memory per node' line is the plan's count "
             "(offload less, or set cluster.host_memory_gb so that the plan checks it)")


def engine_start_error(role: str, backend: str, exc: BaseException) -> EngineStartError:
    cause = getattr(exc, "cause", None) or exc  # a RayTaskError carries the engine's exception as ``cause``
    text = str(cause).strip().splitlines()
    hint = f" ({DIED_HINT})" if type(cause).__name__ == "ActorDiedError" else ""
    return EngineStartError(f"roles.{role}: the '{backend}' engine did not start: {type(cause).__name__}: "
                            f"{text[0] if text else '(no message)'}{hint}")


def role_options(cfg: RunConfig, role: str) -> dict[str, Any]:
    """A role's settings as the engine sees them: the typed keys plus its free-form ``options``."""
    rcfg = getattr(cfg.roles, role)
    if role == "reward":  # the engine of the reward role is its model
        options = rcfg.model.model_dump(exclude={"path", "tiny", "coef"}) if rcfg.model is not None else {}
    else:
        options = rcfg.model_dump(exclude=TRAIN_ROLE_FIELDS)
    options.update(rcfg.options)
    if role == "rollout":  # resolved here: an engine may have to record routing from its start
        options["return_routing"] = cfg.rollout_returns_routing()
    for key in role_spec(role).inherits:
        if options.get(key) is None:
            options[key] = getattr(cfg.roles.actor, key)
    return options


def role_settings(cfg: RunConfig, role: str) -> tuple[TrainingOptions, dict[str, Any]]:
    """What a role's engine receives: the shared training settings (train roles) and the backend's own keys
    (``EngineContext.training`` and ``.options``). A rollout gets all its keys as options."""
    options = role_options(cfg, role)
    if role_spec(role).kind != "train":
        return TrainingOptions(), options
    training, _ = TrainingOptions.split(options)  # the typed keys the driver alone reads (mini_batch ...) stay
    return training, dict(getattr(cfg.roles, role).options)


def start_worker_groups(cfg: RunConfig, plan: PlacementPlan, deadline: CallDeadline | None = None
                        ) -> tuple[dict[str, WorkerGroup], list[Any]]:
    """One ``WorkerGroup`` per process group of the plan, its waits given ``deadline``; returns role -> its
    group, and the placement groups (to remove at shutdown)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    ensure_ray(cfg.cluster, env={"TOKENIZERS_PARALLELISM": "false"})
    device = plan.cluster.device
    used_devices = sum(len(plan.unique_devices(pool)) for pool in plan.pools if pool not in plan.shares)
    # CPU slots: share Ray's CPUs among the devices (fractions when a declared cluster oversubscribes cores).
    available = float(ray.available_resources().get("CPU", 1))
    per_device = max(used_devices, 1)
    cpus = max(available // per_device, min(1.0, available / per_device)) if device == "cpu" else 1.0
    threads = cfg.cluster.threads_per_worker or max(1, (os.cpu_count() or 1) // max(used_devices, 1))
    slots, placement_groups = reserve_pools(plan, device, cpus)
    remote_worker = ray.remote(RoleWorker)
    role_groups: dict[str, WorkerGroup] = {}
    for gplan in plan.groups:
        share = 1.0 / plan.processes_per_device(gplan.pool)
        workers = []
        for rank in range(gplan.world_size):
            pg, index = slots[gplan.pool][rank]
            strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)
            options: dict[str, Any] = {"num_cpus": cpus * share, "scheduling_strategy": strategy,
                                       "name": f"{gplan.name}:{rank}".replace("/", "_")}
            if device == "cuda":
                options["num_gpus"] = share
            workers.append(remote_worker.options(**options).remote(rank, gplan.world_size, device, threads,
                                                                   tuple(cfg.plugins)))
        group = WorkerGroup(gplan, workers, deadline=deadline)
        group.locations = group.call_all("location")
        addr, port = group.gather([workers[0].rendezvous_address.remote()], "rendezvous_address", [0])[0]
        group.call_all("init_distributed", addr, port)
        for role in gplan.roles:
            role_groups[role] = group
    log.info("%s", render_device_map(unique_groups(role_groups)))
    if os.path.isdir(cfg.trainer.out):  # the trainer made it: the map stays with the run
        write_device_map(cfg.trainer.out, unique_groups(role_groups), plan.topology)
    return role_groups, placement_groups


def reserve_pools(plan: PlacementPlan, device: str, cpus: float) -> tuple[dict[str, list[tuple[Any, int]]], list[Any]]:
    """The placement groups of every pool as the plan places them (``plan.placements``; STRICT_PACK ones
    first, so that a SPREAD group cannot take the devices a node's group needs). Returns each pool's
    ``(placement group, bundle index)`` by rank, and the groups (to remove at shutdown; all of them are
    removed here when one cannot be reserved)."""
    from ray.util.placement_group import remove_placement_group

    placements = plan.placements or {pool: PoolPlacement(pool, "PACK", (tuple(range(len(plan.unique_devices(pool)))),),
                                                         "") for pool in plan.pools if pool not in plan.shares}
    slots: dict[str, list[tuple[Any, int]]] = {pool: [] for pool in plan.pools}
    taken: dict[str, dict[int, tuple[Any, int]]] = {pool: {} for pool in plan.pools}
    created: list[Any] = []
    try:
        for placement in sorted(placements.values(), key=lambda p: p.strategy != STRICT_PACK):
            many = len(placement.bundle_sets) > 1
            for k, positions in enumerate(placement.bundle_sets):
                name = f"hybridrl-{placement.pool}" + (f"-{k}" if many else "")
                pg = create_placement_group(len(positions), device, cpus, name, strategy=placement.strategy)
                created.append(pg)
                taken[placement.pool].update({position: (pg, i) for i, position in enumerate(positions)})
    except BaseException:
        for pg in created:
            remove_placement_group(pg)
        raise
    for pool, devices in plan.pools.items():
        owner = plan.device_set(pool)  # a pool sharing devices takes the same bundles as the pool it shares
        position = {device: i for i, device in enumerate(plan.unique_devices(owner))}  # one bundle per device
        slots[pool] = [taken[owner][position[device]] for device in devices]
    return slots, created


def build_engines(cfg: RunConfig, plan: PlacementPlan, groups: dict[str, WorkerGroup], model_path: str,
                  role_model_paths: dict[str, str] | None = None) -> None:
    """Trainers first, rollouts last: engines that size their memory from what is free start after the
    trainers on the same devices. ``role_model_paths`` gives a role its own checkpoint (the critic's
    backbone, the reward model); the others load ``model_path``. With LoRA the actor and the rollout are told
    the adapters (``EngineContext.lora``), and a reference in the actor's process is the actor's base
    (``TrainEngine.reference_view``), built after the actor."""
    order = sorted(groups, key=lambda r: 2 if r == "rollout" else 0 if r == "actor" else 1)
    lora = LoraSpec.from_config(cfg.roles.actor.lora)
    for role in order:
        backend = plan.group_of(role).roles[role]
        path = (role_model_paths or {}).get(role, model_path)
        training, options = role_settings(cfg, role)
        fields = {"model_path": path, "dtype": cfg.model.dtype, "seed": cfg.trainer.seed,
                  "trainable": role_spec(role).trainable, "options": options, "training": training}
        if lora is not None and role in ("actor", "rollout"):
            fields["lora"] = lora
        try:
            if role == "ref" and reference_is_actor_base(cfg, plan):
                groups[role].build_view(role, "actor", backend, fields)
            else:
                groups[role].build(role, backend, fields)
        except Exception as exc:  # noqa: BLE001 - any constructor error, raised on a worker
            raise engine_start_error(role, backend, exc) from exc
