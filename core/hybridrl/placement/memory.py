"""Memory per device of a plan, estimated from the model's HF config before any GPU is spent.

What one role holds comes from its backend's memory model (``hybridrl.engines.memory_model``, registered
with the backend: the FSDP and Megatron trainers, the vLLM and SGLang engines in their plugins, the transformers
rollout in ``hybridrl.rollout.memory``); this module sums them per device and phase. A role whose backend has no
model is shown as not estimated, never sized with another backend's formula.

Roles on one pool time-share the device: a device's peak is its largest *phase*, not the sum of its roles.
In each phase the working role holds its phase's memory and the others their resident state; a colocated
rollout asleep keeps only its CUDA graphs (and its weights with ``sleep_level: kv_cache``), and at ``gen`` it
holds everything it mapped back on wake. The plan is a guide, checked against the device memory measured per
phase (``memory/phase/<phase>/device_peak_mb``) by ``benchmarks/model_sizes.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridrl.config import RunConfig
from hybridrl.engines.memory_model import (  # noqa: F401
    OFFLOAD_MODES,
    RoleContext,
    RoleMemory,
    TrainSettings,
    role_options,  # noqa: F401  (its old home)
)
from hybridrl.model.shape import (  # noqa: F401  (re-exported: their home before)
    MemoryEstimateError,
    ModelShape,
    config_candidates,
    model_shape,
    moe_fields,
    read_hf_config,
    shape_from_hf_config,
    tiny_shape,
)
from hybridrl.placement.lora_memory import apply_lora, apply_lora_rollout
from hybridrl.placement.plan import PlacementPlan, configured_pools
from hybridrl.roles import STEP_PHASES, phase_owner, role_spec
from hybridrl.rollout.kv_budget import KVDemand

GIB = float(2**30)
#: default device memory (GiB) for a cuda cluster whose memory was not declared.
DEFAULT_CUDA_MEMORY_GIB = 80.0
#: CUDA context, NCCL buffers and allocator slack per process on a device.
CUDA_CONTEXT_GIB = 1.0
#: model types whose layer layout the parameter count knows exactly.
KNOWN_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# --- per role ---------------------------------------------------------------------------------------

@dataclass
class PoolMemory:
    pool: str
    devices: int
    roles: list[str]
    processes: int
    phases: dict[str, float]  # phase -> bytes per device
    device_bytes: float | None
    #: "role[backend]" of the pool's roles whose backend has no memory model: the phases leave them out
    unestimated: list[str] = field(default_factory=list)
    #: pools running on this pool's devices at the same time (``pools.<name>.share``): their roles are in ``roles``
    shared_by: list[str] = field(default_factory=list)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.__getitem__) if self.phases else "-"

    @property
    def peak(self) -> float:
        return self.phases[self.peak_phase] if self.phases else 0.0

    @property
    def fits(self) -> bool | None:
        if self.device_bytes is None:
            return None
        if self.peak > self.device_bytes:
            return False
        return None if self.unestimated else True


@dataclass
class MemoryEstimate:
    shape: ModelShape
    source: str
    dtype: str
    device: str
    device_bytes: float | None
    roles: list[RoleMemory]
    pools: list[PoolMemory]
    warnings: list[str] = field(default_factory=list)
    host: list[Any] = field(default_factory=list)  # HostNeed per pool (``hybridrl.placement.host_memory``)
    unestimated: list[tuple[str, str, str]] = field(default_factory=list)  # (role, pool, backend) without a model
    #: role -> its backend's ``BackendSpec.oom_fixes`` hook (or None): what an out-of-memory answer suggests
    oom_fixes: dict[str, Any] = field(default_factory=dict)


def kv_demand(cfg: RunConfig, shape: ModelShape, dtype_bytes: int, replicas: int) -> KVDemand:
    """The step's sequences per replica at full length (``hybridrl.rollout.kv_budget``)."""
    rcfg = cfg.roles.rollout
    tp = max(1, rcfg.tensor_parallel)
    options = rcfg.options or {}
    workload = step_workload(cfg)
    context = options.get("max_model_len") or shape.max_positions
    return KVDemand(-(-workload["sequences"] // max(1, replicas)), workload["tokens_per_sequence"],
                    int(shape.kv_bytes_per_token(dtype_bytes) // tp), context_tokens=context)


def step_workload(cfg: RunConfig) -> dict[str, int]:
    """What one step asks of the rollout: sequences in the whole step (the groups in flight with
    ``roles.rollout.oversample``), tokens of the longest one."""
    groups = math.ceil(cfg.roles.rollout.oversample * cfg.data.prompts_per_step - 1e-9)
    out = {"sequences": groups * cfg.algorithm.n_samples,
           "tokens_per_sequence": cfg.data.max_prompt_len + cfg.roles.rollout.max_new_tokens}
    pool = cfg.pools.get(configured_pools(cfg).get("rollout") or "")
    if pool is not None and pool.per_device > 1:  # replicas side by side: each sizes its cache from its part
        out["replicas_per_device"] = pool.per_device
    return out


def backend_hooks(cfg: RunConfig, plan: PlacementPlan, registry: Any, hook: str) -> dict[str, Any]:
    """Each placed role's backend's loaded ``hook`` (``BackendSpec.memory_model``, ``oom_fixes`` ...), None where
    the backend registers none; ``registry`` None: the plugins' registry for ``cfg``."""
    from hybridrl.plugins.registry import RegistryError

    if registry is None:
        from hybridrl.plugins.discovery import get_registry

        registry = get_registry(tuple(cfg.plugins))
    out: dict[str, Any] = {}
    for role in plan.role_pool:
        try:
            spec = registry.backend(role_spec(role).kind, plan.group_of(role).roles[role])
        except RegistryError:
            out[role] = None
            continue
        out[role] = spec.memory() if hook == "memory_model" else spec.hook(hook)
    return out


def memory_models(cfg: RunConfig, plan: PlacementPlan, registry: Any = None) -> dict[str, Any]:
    """Each placed role's memory model (an instance), None where its backend registers none."""
    return backend_hooks(cfg, plan, registry, "memory_model")


def role_context(cfg: RunConfig, plan: PlacementPlan, role: str, shape: ModelShape,
                 device_bytes: float | None) -> RoleContext:
    return RoleContext(cfg, role, plan.role_pool[role], shape, plan.group_of(role).world_size, plan.cluster.device,
                       DTYPE_BYTES[cfg.model.dtype], device_bytes)


def estimate_memory(cfg: RunConfig, plan: PlacementPlan, shape: ModelShape, device_bytes: float | None,
                    source: str = "", shapes: dict[str, ModelShape] | None = None,
                    settings: dict[str, TrainSettings] | None = None, models: dict[str, Any] | None = None
                    ) -> MemoryEstimate:
    """Per-role and per-pool memory of ``plan``, from each role's backend's memory model (``models``, by role:
    ``memory_models`` when not given). ``shapes`` gives other models by role (a critic or reward model built
    from another checkpoint); the actor's ``shape`` otherwise. ``settings`` overrides the train roles' settings
    by role (the auto choices try several). A role whose backend has no model is listed as not estimated."""
    shapes = shapes or {}
    settings = settings or {}
    models = memory_models(cfg, plan) if models is None else models
    device = plan.cluster.device
    dtype_bytes = DTYPE_BYTES[cfg.model.dtype]
    context = CUDA_CONTEXT_GIB * GIB if device == "cuda" else 0.0
    roles: list[RoleMemory] = []
    unestimated: list[tuple[str, str, str]] = []
    for role, pool in plan.role_pool.items():
        if role == "rollout" or role_spec(role).kind != "train":
            continue
        model = models.get(role)
        if model is None:
            unestimated.append((role, pool, plan.group_of(role).roles[role]))
            continue
        ctx = role_context(cfg, plan, role, shapes.get(role, shape), device_bytes)
        roles.append(model.role_memory(ctx, settings.get(role) or model.settings(cfg, role)))
    compute_bytes = dtype_bytes if device == "cuda" else 4
    apply_lora(cfg, plan, roles, shape, compute_bytes, device)  # base and adapters apart
    rollout_model = models.get("rollout")
    pool_overhead: dict[str, float] = {}
    for pool in plan.pools:
        processes = sum(plan.per_device(pool) for g in plan.groups if g.pool == pool)
        extra = sum(rollout_model.extra_context_bytes * plan.per_device(pool) for g in plan.groups if g.pool == pool
                    for r in g.roles if r == "rollout" and rollout_model is not None) if device == "cuda" else 0.0
        pool_overhead[pool] = processes * context + extra
    if "rollout" in plan.role_pool:
        pool = plan.role_pool["rollout"]
        if rollout_model is None:
            unestimated.append(("rollout", pool, plan.group_of("rollout").roles["rollout"]))
        else:
            same_devices = plan.pools_on_devices_of(pool)
            resident = sum(m.idle for m in roles if m.pool in same_devices)
            overhead = sum(pool_overhead[q] for q in same_devices)
            free = None if device_bytes is None else device_bytes - overhead - resident
            if free is not None:  # replicas side by side (pools.<name>.per_device) each take their part
                free /= plan.per_device(pool)
            ctx = role_context(cfg, plan, "rollout", shapes.get("rollout", shape), device_bytes)
            roles.append(rollout_model.role_memory(ctx, free))
            apply_lora_rollout(cfg, plan, roles[-1], shapes.get("rollout", shape), dtype_bytes, rollout_model)
    by_role = {m.role: m for m in roles}
    pools: list[PoolMemory] = []
    warnings: list[str] = []
    for pool in plan.pools:
        if pool in plan.shares:
            continue  # counted with the pool whose devices it shares: both resident at once
        same_devices = plan.pools_on_devices_of(pool)
        members = [m for m in roles if m.pool in same_devices]
        missing = [f"{r}[{b}]" for r, p, b in unestimated if p in same_devices]
        if not members and not missing:
            continue
        processes = plan.processes_per_device(pool)
        overhead = sum(pool_overhead[q] for q in same_devices)
        # pools whose roles time-share them (more than one role, modelled or not): a rollout there sleeps
        crowded = {q for q in same_devices
                   if sum(m.pool == q for m in members) + sum(p == q for _, p, _ in unestimated) > 1}
        phases: dict[str, float] = {}
        largest: dict[str, RoleMemory] = {}  # phase -> the role holding the most memory in it
        for phase in STEP_PHASES:
            owner = phase_owner(phase)
            if owner is None or owner[0] not in by_role or not members:
                continue
            worker, mode = owner[0], owner[1].mode
            held: dict[str, float] = {}
            for m in members:
                copies = plan.per_device(m.pool)  # one process of the role per rank, several on a device
                if m.role == worker:
                    held[m.role] = m.forward if mode == "forward" and m.kind != "rollout" else m.active
                elif m.kind == "rollout" and m.pool != pool:
                    held[m.role] = m.active  # fractional: it generates while the trainers work
                elif m.kind == "rollout" and m.pool in crowded:
                    held[m.role] = m.asleep  # KV cache released, weights to host (or kept: sleep_level kv_cache)
                else:
                    held[m.role] = m.idle
                held[m.role] *= copies
            phases[phase] = overhead + sum(held.values())
            largest[phase] = by_role[max(held, key=held.__getitem__)]
        pm = PoolMemory(pool, len(plan.unique_devices(pool)), [m.role for m in members], processes, phases,
                        device_bytes, missing, shared_by=[q for q in same_devices if q != pool])
        pools.append(pm)
        if pm.fits is False:
            worst = largest[pm.peak_phase]
            label = f"pools '{pool}' + '{', '.join(pm.shared_by)}' (fractional)" if pm.shared_by else f"pool '{pool}'"
            warnings.append(f"{label} needs ~{pm.peak / GIB:.1f} GiB per device in phase {pm.peak_phase}, "
                            f"more than the {device_bytes / GIB:.0f} GiB device; "
                            f"{models[worst.role].advice(cfg, worst)}")
    for m in roles:
        if m.kind == "rollout" and m.kv_cache < 0:
            warnings.append(f"roles.rollout: no room for a KV cache ({m.kv_cache / GIB:.1f} GiB left under "
                            f"gpu_memory_utilization); raise it or add tensor_parallel")
        elif m.kind == "rollout" and any(n.startswith("KV floor") for n in m.notes):
            warnings.append("roles.rollout: " + next(n for n in m.notes if n.startswith("KV floor")))
    return MemoryEstimate(shape, source, cfg.model.dtype, device, device_bytes, roles, pools, warnings,
                          unestimated=unestimated)


def fractional_problems(est: MemoryEstimate) -> list[tuple[str, str]]:
    """Pools sharing devices (``pools.<name>.share``) that do not fit them together: a refusal, not a warning, since
    nothing sleeps to make room (the trainers' phases run beside the resident rollout)."""
    out = []
    for p in est.pools:
        if p.shared_by and p.fits is False and est.device_bytes is not None:
            rollout = next((m for m in est.roles if m.kind == "rollout" and m.pool in p.shared_by), None)
            beside = f" with the rollout's {rollout.active / GIB:.1f} GiB resident" if rollout is not None else ""
            out.append((f"pools.{p.shared_by[0]}.share",
                        f"pools '{p.pool}' + '{', '.join(p.shared_by)}' need {p.peak / GIB:.1f} GiB per device in "
                        f"phase {p.peak_phase}{beside}, more than the {est.device_bytes / GIB:.0f} GiB device: lower "
                        "the step's sequences or response length (the KV cache), pools.<name>.per_device, or the "
                        "trainers' micro-batch, or put the rollout on the trainers' pool (time-shared)"))
    return out


# --- rendering ---------------------------------------------------------------------------------------

def render_memory(est: MemoryEstimate) -> str:
    """The per-role table, the per-pool phase peaks, the rule used, and any warnings."""
    largest = max([m.active for m in est.roles] + [p.peak for p in est.pools] + [0.0])
    unit, scale = ("GiB", GIB) if largest >= 0.5 * GIB else ("MiB", float(2**20))

    def _gib(value: float) -> str:
        return f"{value / scale:.1f}"

    limit = f"{est.device_bytes / GIB:.0f} GiB per device" if est.device_bytes else "device memory not declared"
    lines = [f"memory per device ({unit}; {est.shape.describe()} from {est.source}, {est.dtype}, {limit}):"]
    header = ("pool", "role", "weights", "split", "grads", "optimizer", "activations", "kv cache", "busy", "idle",
              "notes")
    rows = [header]
    for m in est.roles:
        colocated = m.kind == "rollout" and any(p.pool == m.pool and len(p.roles) > 1 for p in est.pools)
        idle = f"asleep {_gib(m.asleep)}" if colocated else _gib(m.idle)
        rows.append((m.pool, m.role, _gib(m.weights), m.share, _gib(m.grads), _gib(m.optimizer), _gib(m.activations),
                     _gib(m.kv_cache), _gib(m.active), idle, "; ".join(m.notes)))
    for role, pool, backend in est.unestimated:
        rows.append((pool, role, "-", "-", "-", "-", "-", "-", "-", "-",
                     f"not estimated: backend '{backend}' has no memory model"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for i, row in enumerate(rows):
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if i == 0:
            lines.append("  " + "  ".join("-" * w for w in widths))
    for p in est.pools:
        phases = ", ".join(f"{k} {_gib(v)}" for k, v in p.phases.items())
        verdict = "" if p.fits is None else ("  ok" if p.fits else "  DOES NOT FIT")
        if p.unestimated:
            verdict += f"  (without {', '.join(p.unestimated)}: not estimated)"
        name = " + ".join([p.pool, *p.shared_by]) + (" (fractional)" if p.shared_by else "")
        lines.append(f"pool {name} ({p.devices} device(s), {' + '.join(p.roles)}): peak {_gib(p.peak)} {unit} in "
                     f"{p.peak_phase} [{phases}]{verdict}")
    context = f"; +{CUDA_CONTEXT_GIB:g} GiB CUDA context per process" if est.device == "cuda" else ""
    lines.append("rule: colocated roles time-share a device: the rollout sleeps (KV cache released, weights to host, "
                 "CUDA graphs kept) while the trainers work and maps its weights and KV cache back at gen; the "
                 "trainers' weights and optimizer states stay resident unless offloaded; a device's peak is its "
                 f"largest phase, not the sum of its roles{context}")
    from hybridrl.placement.host_memory import render_host  # it reads this module's types

    lines += render_host(est.host)
    lines += [f"WARNING: {w}" for w in est.warnings]
    return "\n".join(lines)


def device_memory_bytes(device: str, declared_gib: float | None) -> float | None:
    """The declared memory, else 80 GiB for cuda; None (no fit check) for CPU slots unless declared."""
    if declared_gib is not None:
        return declared_gib * GIB
    return DEFAULT_CUDA_MEMORY_GIB * GIB if device == "cuda" else None


def planned_device_memory_bytes(device: str, declared_gib: float | None, local: bool) -> float | None:
    """The device memory a plan is checked against, as the run checks it: the declared memory, else on GPUs of
    this machine (``local``: the cluster was read from here, not declared) their own memory, else the default of
    ``device_memory_bytes``."""
    if declared_gib is None and device == "cuda" and local:
        found = local_device_memory_bytes()
        if found:
            return found
    return device_memory_bytes(device, declared_gib)


def local_device_memory_bytes() -> float | None:
    """The memory of the smallest GPU of this machine, asked of ``nvidia-smi``, else of torch in a child process
    (the driver never opens a CUDA context on a GPU the workers will use); None when it cannot tell."""
    import shutil
    import subprocess
    import sys

    if shutil.which("nvidia-smi") is not None:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=20, check=True).stdout
            sizes = [float(line) for line in out.split() if line.strip()]
            if sizes:
                return min(sizes) * 2**20
        except (OSError, subprocess.SubprocessError, ValueError):
            pass
    probe = ("import torch; n = torch.cuda.device_count(); "
             "print(min(torch.cuda.get_device_properties(i).total_memory for i in range(n)) if n else '')")
    try:  # torch in a process of its own: its CUDA context ends with it
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120).stdout
        return float(out.strip()) if out.strip() else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def model_shapes_by_role(cfg: RunConfig, base_dirs: Sequence[str | Path] = ()) -> dict[str, ModelShape]:
    """Shapes of the critic's and the reward model's own checkpoints, where they name one that is readable."""
    out: dict[str, ModelShape] = {}
    critic = getattr(cfg.roles, "critic", None)
    reward_model = getattr(cfg.roles.reward, "model", None)
    for role, path, tiny in (("critic", getattr(critic, "model_path", None), None),
                             ("reward", getattr(reward_model, "path", None), getattr(reward_model, "tiny", None))):
        if tiny is not None:
            out[role] = tiny_shape(tiny)
            continue
        if not path:
            continue
        for candidate in config_candidates(path, base_dirs):
            if (candidate / "config.json").is_file():
                try:
                    out[role] = shape_from_hf_config(read_hf_config(candidate))
                except MemoryEstimateError:
                    pass
                break
    return out
