"""LoRA in the memory plan (``hybridrl.placement.memory``): a LoRA actor's frozen base and its adapters counted
apart, and what the reference and the rollout hold when the actor trains adapters (``roles.actor.lora``).

* The actor: the base frozen (the compute dtype on a GPU, fp32 on the CPU) plus fp32 adapters; gradients, the
  gathered layer's unsharded gradients and AdamW's two states for the adapters only.
* A reference served by the actor's engine (``hybridrl.lora.reference_is_actor_base``): no weights of its own;
  in its phase it holds the forward's transient memory, on the actor's resident weights.
* A rollout sent the adapters alone (``sync: adapter``): its base weights stay on the device while it sleeps
  (``sleep_level: auto`` becomes ``kv_cache``), and it holds slots for one adapter at the rank its memory model
  allocates (vLLM rounds it up to one of its sizes).

Each ``apply_*`` adjusts a ``RoleMemory`` the plan built for a full-weight run; ``RoleMemory.adapters`` holds the
adapters' bytes (part of ``weights``).
"""

from __future__ import annotations

from typing import Any

from hybridrl.lora import ALL_LINEAR, LoraSpec

#: the linear layers of a decoder layer (Qwen2 / Llama names) and what ``all-linear`` covers.
LINEAR_LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_MiB = float(2**20)


def layer_linears(shape: Any) -> dict[str, tuple[int, int]]:
    """``name -> (in_features, out_features)`` of one decoder layer's linear layers."""
    h, q, kv, i = shape.hidden_size, shape.q_dim, shape.kv_dim, shape.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def adapter_params(shape: Any, spec: LoraSpec, rank: int | None = None) -> int:
    """Parameters of the adapters on the model of ``shape`` (at ``rank``, default the spec's)."""
    targets = LINEAR_LAYERS if spec.target_modules == ALL_LINEAR else tuple(spec.target_modules)
    r = spec.rank if rank is None else rank
    per_layer = sum(r * (fan_in + fan_out) for name, (fan_in, fan_out) in layer_linears(shape).items()
                    if name in targets)
    return shape.num_layers * per_layer


def apply_to_actor(mem: Any, shape: Any, spec: LoraSpec, dp: int, compute_bytes: int, device: str) -> None:
    """A trainable role's memory with LoRA (see the module docstring); the optimizer's temporaries stay within
    one param group of the engine (``RoleMemory.optimizer_group_bytes``)."""
    n, adapters = shape.param_count(), adapter_params(shape, spec)
    base_bytes = (compute_bytes if device == "cuda" else 4) * n / dp
    old_weights, old_optimizer = mem.weights, mem.optimizer
    mem.adapters = 4 * adapters / dp
    mem.weights = base_bytes + mem.adapters
    mem.grads = 4 * adapters / dp
    mem.optimizer = 8 * adapters / dp
    mem.optimizer_step = 4 * min(adapters / dp, mem.optimizer_group_bytes / 4)
    # the backward's unsharded gradients of a layer: the adapters' alone
    mem.gathered += compute_bytes * (adapters / shape.num_layers - shape.layer_params)
    resident_optimizer = mem.offload == "none"
    mem.forward += (mem.weights - old_weights) + ((mem.optimizer - old_optimizer) if resident_optimizer else 0.0)
    mem.idle = (0.0 if mem.offload == "all" else mem.weights) + (mem.optimizer if resident_optimizer else 0.0)
    dtype = "bf16/fp16" if device == "cuda" else "fp32"
    mem.notes.insert(0, f"LoRA r={spec.rank}: base {_size(base_bytes)} (frozen, {dtype}) + adapters "
                        f"{_size(mem.adapters)} (fp32); gradients and AdamW for the adapters only")


def apply_to_reference(mem: Any) -> None:
    """A reference served by the LoRA actor's engine: the actor's weights, nothing of its own between phases."""
    mem.forward -= mem.weights
    mem.weights = 0.0
    mem.idle = 0.0
    mem.share = "actor's"
    mem.notes.insert(0, "the LoRA actor's base with its adapters disabled (no copy of the weights)")


def apply_to_rollout(mem: Any, shape: Any, spec: LoraSpec, dtype_bytes: int, model: Any,
                     options: dict[str, Any], colocated: bool) -> None:
    """A rollout sent the adapters alone: adapter slots at the rank its memory model allocates
    (``RolloutMemoryModel.adapter_rank``; None: it merges them), base weights kept asleep."""
    if not spec.sends_adapters:
        return
    rank = model.adapter_rank(spec.rank)
    if rank is None:
        mem.notes.append("LoRA adapters merged on the host into a copy of the adapted layers' base")
        return
    tp = max(1, int(options.get("tensor_parallel") or 1))
    mem.adapters = adapter_params(shape, spec, rank) * dtype_bytes / tp
    mem.weights += mem.adapters
    level = str(options.get("sleep_level", "auto"))
    if colocated and level in ("auto", "kv_cache"):
        mem.asleep += mem.weights  # the base stays on the device: no sync would bring it back
    mem.idle = mem.active
    mem.notes.append(f"LoRA: slots for one rank-{rank} adapter ({_size(mem.adapters)}); the base weights stay "
                     "loaded (only adapters are sent)")


def _size(value: float) -> str:
    return f"{value / 2**30:.2f} GiB" if value >= 2**30 else f"{value / _MiB:.1f} MiB"


def apply_lora(cfg: Any, plan: Any, roles: list[Any], shape: Any, compute_bytes: int, device: str) -> None:
    """The train roles of a LoRA run (``roles``: the plan's ``RoleMemory`` list, adjusted in place)."""
    from hybridrl.lora import reference_is_actor_base

    spec = LoraSpec.from_config(getattr(cfg.roles.actor, "lora", None))
    if spec is None:
        return
    shared_reference = reference_is_actor_base(cfg, plan)
    for mem in roles:
        if mem.role == "actor":
            apply_to_actor(mem, shape, spec, plan.group_of("actor").world_size, compute_bytes, device)
        elif mem.role == "ref" and shared_reference:
            apply_to_reference(mem)


def apply_lora_rollout(cfg: Any, plan: Any, mem: Any, shape: Any, dtype_bytes: int, model: Any) -> None:
    """The rollout of a LoRA run (adjusted in place); ``model``: the rollout backend's memory model."""
    spec = LoraSpec.from_config(getattr(cfg.roles.actor, "lora", None))
    if spec is None:
        return
    rollout = cfg.roles.rollout
    options = {**(rollout.options or {}), "tensor_parallel": rollout.tensor_parallel}
    colocated = any(plan.colocated("rollout", r) for r in plan.role_pool if r != "rollout")
    apply_to_rollout(mem, shape, spec, dtype_bytes, model, options, colocated)
