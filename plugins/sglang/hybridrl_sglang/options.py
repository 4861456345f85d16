"""The rollout role's settings as the SGLang engine reads them, and the ``sglang.Engine`` arguments they make
(engine-free: no SGLang import, so the translation is tested without the engine).

The keys are the vLLM plugin's where the meaning is the same, so that ``roles.rollout.backend=sglang`` is the
only change a config needs; keys of other backends (``sleep_level``, ``weight_load`` ...) are ignored.

=========================  ==========================================================================
``tensor_parallel``        ranks per engine replica (``tp_size``; consecutive ranks of the pool)
``gpu_memory_utilization`` ``auto`` (default): the KV pool holds the step's sequences (the ``workload`` the
                           pre-flight writes), sized from what is free when the engine starts, after the
                           trainers' resident state (``hybridrl.rollout.kv_budget``; given to SGLang as
                           ``mem_fraction_static`` and ``max_total_tokens``, see ``auto_fraction``); or a
                           number: ``mem_fraction_static`` itself, in SGLang 0.5.16 the share of the memory
                           *free at its start* that weights and KV pool may take
``max_model_len``          context length (``context_length``; default: the model's)
``max_num_seqs``           requests decoded at once (``max_running_requests``)
``max_num_batched_tokens`` tokens per prefill chunk (``chunked_prefill_size``)
``enforce_eager``          no CUDA graphs at all (``disable_cuda_graph``)
``prefill_cuda_graph``     default off (``cuda_graph_backend_prefill="disabled"``): the default prefill
                           graph failed in cuBLAS on the H200 host with SGLang 0.5.16
``enable_prefix_caching``  default on (radix cache); off sets ``disable_radix_cache``
``sleep_mode``             start with the memory saver so ``sleep`` can release memory (default on)
``weights_cpu_backup``     back the weights up to host memory when sleeping (``enable_weights_cpu_backup``);
                           off (default): the weights are released only when an import will refill
                           them before the next generation (see ``hybridrl_sglang.sleep``)
``seed_mode``              ``engine`` (default: the engine's random stream, seeded per replica) or
                           ``request`` (one seed per row via ``sampling_seed``; turns on SGLang's
                           deterministic inference, which is slower)
``logprob_top_n``          top log-probs fetched per token to renormalise a top-p nucleus (default 64)
``weight_sync``            split pools only: ``channel`` (default: the core's broadcast into the
                           worker, then CUDA IPC) or ``distributed`` (SGLang's schedulers join the
                           group: ``update_weights_from_distributed``, see ``hybridrl_sglang.distributed``)
``return_routing``         set by the core (``roles.rollout.return_routing``): record each fed token's
                           experts from the start (``enable_return_routed_experts``; an MoE model)
``engine_kwargs``          any other ``sglang.Engine`` keyword arguments (they win); a float32 model gets
                           ``attention_backend="triton"`` unless set here
=========================  ==========================================================================
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hybridrl.engines.rollout_kit import (
    ENGINE_OPTION_CASTS,
    check_choice,
    check_engine_options,
    parse_check,
    read_choices,
    read_options,
)
from hybridrl.plugins.options import dataclass_options
from hybridrl.rollout.kv_budget import (
    AUTO,
    UTILIZATION_KEY,
    KVCacheTooSmall,
    KVDemand,
    KVSizing,
    is_auto,
    size_kv_cache,
)

SEED_MODES = ("engine", "request")
WEIGHT_SYNCS = ("channel", "distributed")
#: how ``from_options`` reads each typed key (an unset or ``None`` key keeps the field's default).
_CASTS = {**{k: v for k, v in ENGINE_OPTION_CASTS.items() if k != "gpu_memory_utilization"},
          "prefill_cuda_graph": bool, "weights_cpu_backup": bool, "logprob_top_n": int, "return_routing": bool}
GIB = float(2**30)
#: device memory the scheduler process takes before it measures what is free (its CUDA context, NCCL).
SCHEDULER_START_BYTES = int(1.0 * GIB)
#: what loading the weights allocates besides them (buffers, rotary caches), charged to the static share.
LOAD_EXTRA_BYTES = int(0.5 * GIB)
#: the largest ``mem_fraction_static`` asked for (SGLang needs some memory outside it in any case).
MAX_FRACTION = 0.97


@dataclass(frozen=True)
class SGLangOptions:
    tensor_parallel: int = 1
    gpu_memory_utilization: float | str = AUTO
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enforce_eager: bool = False
    prefill_cuda_graph: bool = False
    enable_prefix_caching: bool = True
    sleep_mode: bool = True
    weights_cpu_backup: bool = False
    seed_mode: str = "engine"
    logprob_top_n: int = 64
    weight_sync: str = "channel"
    return_routing: bool = False
    engine_kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> SGLangOptions:
        value = options.get("gpu_memory_utilization")
        made = cls(
            **read_options(options, _CASTS),
            **read_choices(options, ("seed_mode", "weight_sync")),
            gpu_memory_utilization=AUTO if is_auto(value) else float(value),
            engine_kwargs=dict(options.get("engine_kwargs") or {}),
        )
        made.validate()
        return made

    def validate(self) -> None:
        check_engine_options(self.tensor_parallel, 0.5 if self.gpu_memory_utilization == AUTO
                             else self.gpu_memory_utilization)
        check_choice("seed_mode", self.seed_mode, SEED_MODES)
        check_choice("weight_sync", self.weight_sync, WEIGHT_SYNCS)
        if self.logprob_top_n < 1:
            raise ValueError(f"logprob_top_n must be >= 1, got {self.logprob_top_n}")


@dataclass(frozen=True)
class PoolMemory:
    """What SGLang is told at start: ``mem_fraction_static``, and the KV pool's size in tokens (None: SGLang's
    own from the fraction)."""

    fraction: float
    max_total_tokens: int | None = None
    sizing: KVSizing | None = None


def auto_fraction(free_bytes: int, weights_bytes: int, overhead_bytes: int, bytes_per_token: int,
                  demand: KVDemand | None, device: str = "the GPU") -> PoolMemory:
    """``gpu_memory_utilization: auto`` in SGLang 0.5.16's terms. Its scheduler measures the memory free before
    loading (``pre``), loads the weights, and makes the KV pool ``free after loading - pre x (1 - fraction)``;
    ``max_total_tokens`` then caps the pool. So the pool is sized here by ``size_kv_cache`` from what will be
    free (``free_bytes`` less the scheduler's own start), the fraction is the share of ``pre`` that weights,
    what loading adds and the pool take (the rest, ``pre x (1 - fraction)``, is left to SGLang's graphs and
    activations, ``overhead_bytes`` at least), and the cap makes the pool exactly that size."""
    pre = free_bytes - SCHEDULER_START_BYTES
    sizing = size_kv_cache(demand, pre, weights_bytes + LOAD_EXTRA_BYTES, overhead_bytes, device=device)
    static = weights_bytes + LOAD_EXTRA_BYTES + int(sizing.kv_bytes * 1.02)  # a little over: the cap trims it
    fraction = min(MAX_FRACTION, static / pre)
    tokens = sizing.kv_bytes // max(1, bytes_per_token)
    return PoolMemory(round(fraction, 4), int(tokens), sizing)


def check_fraction(fraction: float, free_bytes: int, weights_bytes: int, device: str = "the GPU") -> None:
    """A number: SGLang's share of the memory free at its start must at least hold the weights."""
    pre = free_bytes - SCHEDULER_START_BYTES
    if fraction * pre <= weights_bytes + LOAD_EXTRA_BYTES:
        raise KVCacheTooSmall(
            f"{UTILIZATION_KEY}={fraction:g} gives SGLang {fraction * pre / GIB:.1f} GiB ({fraction:g} of the "
            f"{pre / GIB:.1f} GiB free on {device} at its start), not even its {weights_bytes / GIB:.1f} GiB of "
            "weights: set it to auto or raise it", {"free_bytes": free_bytes, "fraction": fraction})


def engine_kwargs(opts: SGLangOptions, *, model_path: str, dtype: str, seed: int,
                  memory: PoolMemory | None = None) -> dict[str, Any]:
    """Keyword arguments of ``sglang.Engine`` (``ServerArgs`` fields). Token-in/token-out: no tokenizer
    (``skip_tokenizer_init``), so no detokenizer work per step; EOS ids are passed per request. ``memory``:
    the start's sizing (``auto_fraction``); without it a numeric share goes to SGLang as it is."""
    fraction = memory.fraction if memory is not None else (
        0.5 if opts.gpu_memory_utilization == AUTO else opts.gpu_memory_utilization)
    kwargs: dict[str, Any] = {
        "model_path": model_path,
        "dtype": dtype,
        "tp_size": opts.tensor_parallel,
        "mem_fraction_static": fraction,
        "random_seed": int(seed),
        "skip_tokenizer_init": True,
        "enable_memory_saver": opts.sleep_mode,
        "log_level": "error",
    }
    if memory is not None and memory.max_total_tokens:
        kwargs["max_total_tokens"] = memory.max_total_tokens
    if opts.weights_cpu_backup:
        kwargs["enable_weights_cpu_backup"] = True
    if opts.enforce_eager:
        kwargs["disable_cuda_graph"] = True
    elif not opts.prefill_cuda_graph:
        kwargs["cuda_graph_backend_prefill"] = "disabled"
    if not opts.enable_prefix_caching:
        kwargs["disable_radix_cache"] = True
    if opts.seed_mode == "request":
        kwargs["enable_deterministic_inference"] = True
    if opts.return_routing:
        kwargs["enable_return_routed_experts"] = True
    if dtype in ("float32", "float"):
        kwargs["attention_backend"] = "triton"  # the default kernels (FlashAttention-3, FlashInfer) want 16-bit
    for ours, theirs in (("max_model_len", "context_length"), ("max_num_seqs", "max_running_requests"),
                         ("max_num_batched_tokens", "chunked_prefill_size")):
        value = getattr(opts, ours)
        if value is not None:
            kwargs[theirs] = value
    kwargs.update(opts.engine_kwargs)
    return kwargs


def split_known(kwargs: Mapping[str, Any], known: set[str] | frozenset[str]) -> tuple[dict[str, Any], list[str]]:
    """``(accepted, dropped names)``: the arguments this SGLang version's ``ServerArgs`` has, and the others
    (an argument a newer or older version lacks is dropped with a warning rather than crashing the start).
    An empty ``known`` (fields could not be read) accepts everything."""
    if not known:
        return dict(kwargs), []
    accepted = {k: v for k, v in kwargs.items() if k in known}
    return accepted, sorted(k for k in kwargs if k not in known)


#: the pre-flight check of the rollout's settings (registered as the backend's ``check_options``).
option_problems = parse_check(SGLangOptions.from_options)


#: one line per option for ``hybridrl plugins sglang`` (``OPTIONS``); every field of ``SGLangOptions`` has one.
OPTION_DESCRIPTIONS = {
    "tensor_parallel": "ranks per engine replica (tp_size; consecutive ranks of the pool)",
    "gpu_memory_utilization": "auto: the KV pool holds the step's sequences, sized from what is free when the engine "
                              "starts (hybridrl.rollout.kv_budget); or mem_fraction_static itself (SGLang's share of "
                              "the memory free at its start)",
    "max_model_len": "context length (context_length; default: the model's)",
    "max_num_seqs": "requests decoded at once (max_running_requests)",
    "max_num_batched_tokens": "tokens per prefill chunk (chunked_prefill_size)",
    "enforce_eager": "no CUDA graphs at all (disable_cuda_graph)",
    "prefill_cuda_graph": "CUDA graphs for prefill too (off: cuda_graph_backend_prefill='disabled')",
    "enable_prefix_caching": "the radix cache (off: disable_radix_cache)",
    "sleep_mode": "start with the memory saver, so that sleep releases memory",
    "weights_cpu_backup": "back the weights up to host memory when sleeping (off: released only when an import "
                          "refills them before the next generation)",
    "seed_mode": "engine (its random stream, seeded per replica) or request (a seed per row; turns on SGLang's "
                 "slower deterministic inference)",
    "logprob_top_n": "top log-probs fetched per token to renormalise a top-p nucleus",
    "weight_sync": "split pools: channel (the core's broadcast, then CUDA IPC) or distributed (SGLang's schedulers "
                   "join the group)",
    "return_routing": "record each fed token's experts (an MoE model; set by the core from "
                      "roles.rollout.return_routing)",
    "engine_kwargs": "any other sglang.Engine keyword arguments (they win)",
}
OPTIONS = dataclass_options(SGLangOptions, OPTION_DESCRIPTIONS,
                            types={"gpu_memory_utilization": "float | auto", "engine_kwargs": "dict"})
