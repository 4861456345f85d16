"""Rollout memory models (``hybridrl.engines.memory_model.RolloutMemoryModel``): the core's ``hf`` rollout,
whose KV cache grows with the batch, and ``PreallocatingRollout``, the arithmetic of an engine that claims its
KV cache at start (a plugin instantiates it with its own batch defaults and KV sizing policy).

A preallocating engine holds full weights / tensor parallel, a KV cache sized by ``hybridrl.rollout.kv_budget``
(``gpu_memory_utilization: auto``) or by its share of the device (of the total, or of what is free at its
start), the activations of its largest step and its CUDA graph pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridrl.engines.memory_model import RoleContext, RoleMemory
from hybridrl.placement.memory import GIB, ModelShape, kv_demand
from hybridrl.rollout.kv_budget import KVCacheTooSmall, is_auto, size_kv_cache

#: a rollout engine's CUDA graph pool: a fixed part and a share of its weights.
GRAPH_POOL_BASE = 0.25 * GIB
GRAPH_POOL_SHARE = 0.03
#: bytes per logit while an engine samples (bf16 logits, their fp32 copy, softmax, the sampler's draw, the
#: processed log-probs).
SAMPLER_BYTES_PER_LOGIT = 16
#: what to change when a rollout holds the most of a device that does not fit.
ROLLOUT_ADVICE = ("offload the trainers (roles.ref.options.offload=all, roles.actor.options.offload=optimizer), "
                  "or give the rollout its own pool")
#: the same for an engine that preallocates its cache and splits over ranks (vLLM, SGLang).
PREALLOCATING_ADVICE = ("set roles.rollout.options.gpu_memory_utilization=auto (or lower it), offload the trainers "
                        "(roles.ref.options.offload=all, roles.actor.options.offload=optimizer), raise "
                        "roles.rollout.tensor_parallel, or give the rollout its own pool")


def _start(ctx: RoleContext) -> tuple[int, int, RoleMemory]:
    tp = max(1, ctx.cfg.roles.rollout.tensor_parallel)
    mem = RoleMemory("rollout", ctx.pool, "rollout", "full" if tp == 1 else f"1/{tp} TP")
    mem.weights = ctx.shape.param_count() * ctx.dtype_bytes / tp
    return tp, max(1, ctx.world_size // tp), mem


def demand_sized_memory(ctx: RoleContext) -> RoleMemory:
    """Weights, the prefill's transients and a KV cache for every sequence of the step at full length."""
    tp, replicas, mem = _start(ctx)
    shape, dtype_bytes = ctx.shape, ctx.dtype_bytes
    demand = kv_demand(ctx.cfg, shape, dtype_bytes, replicas)
    seqs, seq_len = demand.sequences, demand.tokens_per_sequence
    forward_per_token = (2 * shape.hidden_size + shape.q_dim + 2 * shape.kv_dim + 2 * shape.intermediate_size)
    prefill = seqs * ctx.cfg.data.max_prompt_len
    mem.activations = (prefill * forward_per_token * dtype_bytes + seqs * shape.vocab_size * 4) / tp
    mem.kv_cache = seqs * seq_len * shape.kv_bytes_per_token(dtype_bytes) / tp
    mem.notes.append(f"KV cache for {seqs} sequences x {seq_len} tokens")
    mem.asleep = 0.0
    mem.idle = mem.active
    return mem


class DemandSizedRollout:
    """The transformers rollout: a KV cache sized to the batch, weights left where they are while it sleeps,
    LoRA adapters merged into a copy of the adapted layers."""

    demand_sized = True
    extra_context_bytes = 0.0

    def role_memory(self, ctx: RoleContext, free_at_start: float | None) -> RoleMemory:
        return demand_sized_memory(ctx)

    def adapter_rank(self, rank: int) -> int | None:
        return None

    def advice(self, cfg: Any, mem: RoleMemory) -> str:
        return ROLLOUT_ADVICE


HF_MEMORY = DemandSizedRollout()


@dataclass(frozen=True)
class PreallocatingRollout:
    """An engine that claims its KV cache at start. ``batch_defaults``: (tokens per step, sequences at once) it
    profiles on devices of at least 70 GiB, then on smaller ones; ``extra_context_bytes``: what it adds beyond
    the hosting process's CUDA context; ``share_of_free``: a numeric ``gpu_memory_utilization`` is a share of
    the memory free at its start (else of the device's total); ``lora_ranks``: the adapter ranks it allocates
    slots for (a rank rounds up to the next; empty: the rank as given)."""

    batch_defaults: tuple[tuple[int, int], tuple[int, int]]
    extra_context_bytes: float
    share_of_free: bool = False
    lora_ranks: tuple[int, ...] = ()
    demand_sized: bool = False

    def batch(self, options: dict[str, Any], device_bytes: float | None) -> tuple[int, int]:
        """(tokens per engine step, sequences at once) the engine profiles and captures at start."""
        large, small = self.batch_defaults
        tokens, seqs = large if device_bytes is None or device_bytes >= 70 * GIB else small
        return int(options.get("max_num_batched_tokens") or tokens), int(options.get("max_num_seqs") or seqs)

    def overhead_bytes(self, shape: ModelShape, dtype_bytes: int, options: dict[str, Any],
                       device_bytes: float | None, tp: int = 1, sequences: int | None = None) -> tuple[float, float]:
        """(activations, CUDA graph pool): the larger of a prefill step's transients and the sampler's logits for
        ``sequences`` at once (the engine's own maximum when None: what it profiles at start), and its graph
        pool (none with ``enforce_eager``)."""
        batched, max_seqs = self.batch(options, device_bytes)
        at_once = min(max_seqs, batched) if sequences is None else min(sequences, max_seqs)
        prefill = batched * shape.forward_bytes_per_token_layer(dtype_bytes) / tp
        sampler = at_once * shape.vocab_size * SAMPLER_BYTES_PER_LOGIT
        weights = shape.param_count() * dtype_bytes / tp
        graphs = 0.0 if options.get("enforce_eager") else GRAPH_POOL_BASE + GRAPH_POOL_SHARE * weights
        return max(prefill, sampler), graphs

    def role_memory(self, ctx: RoleContext, free_at_start: float | None) -> RoleMemory:
        """On a device of unknown size (a CPU), sized like the demand-sized rollout."""
        device_bytes = ctx.device_bytes
        if device_bytes is None:
            mem = demand_sized_memory(ctx)
            mem.host_copy_asleep = True
            return mem
        tp, replicas, mem = _start(ctx)
        mem.host_copy_asleep = True
        shape, dtype_bytes = ctx.shape, ctx.dtype_bytes
        demand = kv_demand(ctx.cfg, shape, dtype_bytes, replicas)
        options = dict(ctx.cfg.roles.rollout.options or {})
        mem.activations, mem.graphs = self.overhead_bytes(shape, dtype_bytes, options, device_bytes, tp,
                                                          sequences=demand.sequences)
        start_activations, _ = self.overhead_bytes(shape, dtype_bytes, options, device_bytes, tp)
        util = options.get("gpu_memory_utilization")
        mem.utilization = "auto" if is_auto(util) else util
        if is_auto(util):
            free = device_bytes if free_at_start is None else free_at_start
            try:
                sizing = size_kv_cache(demand, int(free), int(mem.weights), int(start_activations + mem.graphs))
                mem.kv_cache = float(sizing.kv_bytes)
                mem.notes.append(f"KV cache for {demand.describe()} (gpu_memory_utilization=auto)")
            except KVCacheTooSmall as exc:
                mem.kv_cache = float(demand.floor_bytes)
                mem.notes.append(f"KV floor for {demand.describe()} does not fit: {exc}")
        else:
            share = float(util)
            if self.share_of_free:
                base = device_bytes if free_at_start is None else free_at_start
                mem.kv_cache = share * base - mem.weights
                mem.notes.append(f"claims gpu_memory_utilization={share:g} of the memory free at its start")
            else:
                mem.kv_cache = share * device_bytes - mem.weights - start_activations - mem.graphs
                mem.notes.append(f"claims gpu_memory_utilization={share:g} of the device")
            if mem.kv_cache < demand.floor_bytes:
                mem.notes.append(f"KV budget below the {demand.floor_bytes / GIB:.1f} GiB one batch needs: requests "
                                 "will queue")
        mem.asleep = mem.graphs + (mem.weights if str(options.get("sleep_level")) == "kv_cache" else 0.0)
        mem.idle = mem.active
        return mem

    def adapter_rank(self, rank: int) -> int | None:
        return next((allowed for allowed in self.lora_ranks if allowed >= rank), rank)

    def advice(self, cfg: Any, mem: RoleMemory) -> str:
        return PREALLOCATING_ADVICE


#: the fix of an engine that splits over ranks (capability ``tensor_parallel``); the answer lists it after what the
#: trainers beside it can give up (``hybridrl.run.oom``)
TENSOR_PARALLEL_FIX = "roles.rollout.tensor_parallel=2 (the engine over more devices)"


def preallocating_oom_fixes(role: str, mem: RoleMemory | None, phase: str | None) -> list[str]:
    """A preallocating engine's own fixes (vLLM, SGLang): a cache sized from what is free instead of a fixed share,
    and the engine split over more devices."""
    fixes = []
    if phase is not None and mem is not None and mem.utilization not in (None, "auto"):
        fixes.append("roles.rollout.options.gpu_memory_utilization=auto (the KV cache sized from what is free)")
    return [*fixes, TENSOR_PARALLEL_FIX]
