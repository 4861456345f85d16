"""The Megatron engine's memory model (``hybridrl.engines.memory_model.TrainMemoryModel``): tensor and
pipeline parallel, not FSDP's sharding. Engine-free (no torch, no Megatron): a laptop plans it.

What one device holds (``hybridrl_megatron.optim``, ``use_distributed_optimizer=False``):

* Weights, gradients and optimizer state are split over the tensor x pipeline grid only: each data-parallel
  replica keeps a whole copy of its ``1/(tp*pp)`` slice. On a GPU a trainable role holds the bf16/fp16
  parameters, their fp32 main copy, the DDP's fp32 gradient buffer (``grad_reduce_in_fp32``, kept between
  steps) and Adam's two fp32 moments: 18 bytes per parameter of the slice; a frozen role the parameters alone.
  On the CPU everything is fp32 (weights, gradients, two moments: 16 bytes).
* Activations: a pipeline stage runs ``L/pp`` layers and, under 1F1B, keeps up to ``pp`` micro-batches in flight,
  so the first stage holds ``L`` layers' worth of one micro-batch; each layer's saved tensors are split over the
  tensor-parallel ranks (``/tp``). ``recompute`` keeps each layer's input (not split: no sequence parallelism)
  and one layer's tensors at a time. The last stage's logits are split over the vocabulary (``/tp``): the
  compute-dtype logits, their fp32 copy and the softmax's fp32 temporaries (and their gradients in a backward).
  The plan counts both ends on one device: an upper bound for ``pp > 1``.
* Micro-batches are rows (``micro_batch``), never a token budget; the engine has no ``offload`` option. The
  search may only choose ``gradient_checkpointing: auto`` (Megatron's full recompute) when it is asked to.

This model has not been checked against a measured run yet (``plugins/megatron/benchmarks/tp_pp_gpu.py`` is the
place to do it).
"""

from __future__ import annotations

from typing import Any

from hybridrl.engines.memory_model import (
    AUTO,
    AutoChoice,
    Knobs,
    RoleContext,
    RoleMemory,
    TrainSettings,
    micro_batch_tokens,
    role_options,
    step_cost,
)
from hybridrl.roles import role_spec


def layout(cfg: Any, role: str, world_size: int) -> tuple[int, int, int]:
    """(tp, pp, dp) of the role: its options, else the actor's (a reference fused with a Megatron actor takes the
    layout already in its process), else 1."""
    own, actor = role_options(cfg, role), role_options(cfg, "actor")

    def size(key: str) -> int:
        value = own.get(key) if own.get(key) is not None else actor.get(key)
        return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1

    tp, pp = size("tensor_parallel"), size("pipeline_parallel")
    return tp, pp, max(1, world_size // (tp * pp))


def expert_parallel(cfg: Any, role: str) -> int:
    """The role's ``expert_parallel`` (else the actor's, as ``layout``), 1 when unset."""
    own, actor = role_options(cfg, role), role_options(cfg, "actor")
    value = own.get("expert_parallel") if own.get("expert_parallel") is not None else actor.get("expert_parallel")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1


def expert_parallel_problems(cfg: Any, role: str) -> list[tuple[str, str]]:
    """``options.expert_parallel`` against the pool (it must divide the data-parallel ranks) and the model (it
    must divide the experts; a dense model has none to split)."""
    ep = role_options(cfg, role).get("expert_parallel")
    if not isinstance(ep, int) or isinstance(ep, bool) or ep <= 1:
        return []  # unset, 1, or a bad value (the options checker names it)
    from hybridrl.placement.memory import MemoryEstimateError, model_shape
    from hybridrl_megatron.settings import layout_problem

    key = f"roles.{role}.options.expert_parallel"
    problems = []
    pool = cfg.pools.get(getattr(getattr(cfg.roles, role, None), "pool", None) or "")
    if pool is not None:
        tp, pp, _ = layout(cfg, role, pool.size)
        problem = layout_problem(pool.size, tp, pp, ep)
        if problem and "expert_parallel" in problem:
            problems.append((key, problem))
    try:
        shape, source = model_shape(cfg)
    except MemoryEstimateError:  # no config to read here (its own check reports an unknown layout)
        return problems
    if not shape.is_moe:
        problems.append((key, f"the model ({source}) has no experts to split: expert_parallel needs a "
                              "mixture-of-experts model"))
    elif shape.num_experts % ep:
        problems.append((key, f"expert_parallel={ep} does not divide the model's {shape.num_experts} experts "
                              f"({source})"))
    return problems


def model_problems(cfg: Any, role: str) -> list[tuple[str, str]]:
    """A checkpoint (``model.path``) the Megatron conversion cannot build (another family, a feature it lacks, such
    as Qwen2-MoE's shared expert), found before any process starts; named once, for the first Megatron role of
    the policy model (the actor, else the reference)."""
    if role not in ("actor", "ref") or (role == "ref" and cfg.roles.actor.backend == "megatron"):
        return []
    if cfg.model.tiny is not None or not cfg.model.path:
        return []
    from hybridrl.placement.memory import MemoryEstimateError, read_hf_config
    from hybridrl_megatron.convert import ConversionError, ModelSpec

    try:
        config = read_hf_config(cfg.model.path)
    except MemoryEstimateError:
        return []  # a missing or unreadable config is reported under model.path by the core
    try:
        ModelSpec.from_hf_config(config)
    except ConversionError as exc:
        return [("model.path", f"roles.{role}.backend=megatron cannot build this checkpoint: {exc}")]
    return []


def recomputes(options: dict[str, Any]) -> bool:
    return options.get("recompute", options.get("gradient_checkpointing", False)) is True


class MegatronMemory:
    """See the module docstring."""

    fused_kernels = None

    def settings(self, cfg: Any, role: str) -> TrainSettings:
        tokens, resp = micro_batch_tokens(cfg, role)
        return TrainSettings(tokens, resp, recomputes(role_options(cfg, role)))

    def knobs(self, cfg: Any, role: str) -> Knobs:
        options = role_options(cfg, role)
        trainable = role_spec(role).trainable
        asked = options.get("gradient_checkpointing") == AUTO and "recompute" not in options
        return Knobs(budget=False, checkpointing=trainable and asked, offload=False, trainable=trainable)

    def candidates(self, cfg: Any, role: str, knobs: Knobs) -> list[TrainSettings]:
        base = self.settings(cfg, role)
        flags = [False, True] if knobs.checkpointing else [base.checkpointing]
        return [TrainSettings(base.tokens, base.response_tokens, flag) for flag in flags]

    def cost(self, ctx: RoleContext, settings: TrainSettings) -> float:
        return step_cost(ctx, settings)

    def role_memory(self, ctx: RoleContext, settings: TrainSettings) -> RoleMemory:
        shape, cb, tokens = ctx.shape, ctx.compute_bytes, settings.tokens
        tp, pp, dp = layout(ctx.cfg, ctx.role, ctx.world_size)
        trainable = ctx.trainable
        cuda = ctx.device == "cuda"
        ep = expert_parallel(ctx.cfg, ctx.role)
        experts = shape.num_layers * shape.num_experts * 3 * shape.hidden_size * shape.moe_intermediate_size
        part = (shape.param_count() - experts) / (tp * pp) + experts / (tp * pp * ep)  # experts split over ep too
        vocab = shape.vocab_size if role_spec(ctx.role).vocab_head else 1
        split = f"TP{tp} PP{pp} DP{dp}" + (f" EP{ep}" if ep > 1 else "")
        mem = RoleMemory(ctx.role, ctx.pool, "train" if trainable else "frozen", split,
                         tokens=tokens, checkpointing=settings.checkpointing)
        if tp * pp * dp != ctx.world_size:
            mem.notes.append(f"tensor_parallel x pipeline_parallel = {tp * pp} does not divide {ctx.world_size} "
                             "devices")
        forward_logits = tokens * vocab / tp * (cb + 8)  # logits, their fp32 copy, the softmax's temporaries
        layer_forward = tokens * shape.forward_bytes_per_token_layer(cb) / tp
        if trainable:
            mem.weights = (cb + 4 if cuda else 4) * part  # the model's parameters and their fp32 main copy
            mem.grads = 4 * part  # the DDP's fp32 gradient buffer
            mem.optimizer = 8 * part
            per_layer = shape.saved_bytes_per_token_layer(cb) / tp
            if settings.checkpointing:
                layers = tokens * (shape.num_layers * shape.hidden_size * cb + per_layer)
            else:
                layers = tokens * shape.num_layers * per_layer
            logits = tokens * vocab / tp * (2 * cb + 12)  # and their gradients (compute dtype, fp32)
            mem.activations = layers + logits + tokens * shape.backward_bytes_per_token_layer(cb) / tp
            mem.forward = mem.weights + mem.grads + mem.optimizer + layer_forward + forward_logits
            mem.idle = mem.weights + mem.grads + mem.optimizer  # the gradient buffer stays allocated
            mem.notes.append("recompute" if settings.checkpointing else "no recompute")
        else:
            mem.weights = (cb if cuda else 4) * part
            mem.activations = layer_forward + forward_logits
            mem.forward = mem.weights + mem.activations
            mem.idle = mem.weights
        mem.notes.append(f"{tokens:.0f} tokens per micro-batch")
        return mem

    def option_problems(self, cfg: Any, role: str) -> list[tuple[str, str]]:
        value = role_options(cfg, role).get("gradient_checkpointing")
        if value is not None and value != AUTO and not isinstance(value, bool):
            return [(f"roles.{role}.options.gradient_checkpointing", f"must be true, false or auto, got {value!r}")]
        return expert_parallel_problems(cfg, role) + model_problems(cfg, role)

    def choices(self, cfg: Any, role: str, knobs: Knobs, settings: TrainSettings | None, why: str
                ) -> tuple[dict[str, Any], dict[str, Any], list[AutoChoice]]:
        if not knobs.checkpointing:
            return {}, {}, []
        value = False if settings is None else settings.checkpointing
        reason = why if settings is None else ("the activations do not fit without it" if value else
                                               "the activations fit without it")
        return {}, {"gradient_checkpointing": value}, [
            AutoChoice(f"roles.{role}.options.gradient_checkpointing", value, reason)]

    def advice(self, cfg: Any, mem: RoleMemory) -> str:
        tips = [f"lower roles.{mem.role}.micro_batch"]
        if mem.kind == "train" and not mem.checkpointing:
            tips.append(f"set roles.{mem.role}.options.recompute=true")
        tips.append(f"raise roles.{mem.role}.options.tensor_parallel or pipeline_parallel")
        tips.append(f"spread {mem.role} over more devices (pools.{mem.pool})")
        return f"{mem.role} holds the most: " + ", ".join(tips)


MEGATRON_MEMORY = MegatronMemory()


def oom_fixes(role: str, mem: RoleMemory | None, phase: str | None) -> list[str]:
    """Keys that lower the role's memory in ``phase``, cheapest first (``phase`` None: nothing to give up, the
    engine keeps its state on the device)."""
    if phase is None:
        return []
    fixes = [f"roles.{role}.micro_batch lower"]
    if phase.startswith("update") and not (mem is not None and mem.checkpointing):
        fixes.append(f"roles.{role}.options.recompute=true")
    fixes.append(f"roles.{role}.options.tensor_parallel (or pipeline_parallel) higher")
    return fixes
