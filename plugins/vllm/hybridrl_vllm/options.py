"""The rollout role's settings as the vLLM engine reads them, and the ``vllm.LLM`` arguments they make
(engine-free: no vLLM import, so the translation is tested without the engine).

The keys of ``roles.rollout`` (typed) and ``roles.rollout.options`` (free-form) this backend reads are
``OPTIONS`` below (``hybridrl plugins vllm`` prints them); the pre-flight also writes ``workload``
(``{sequences, tokens_per_sequence}`` of one step) for the ``auto`` KV cache, and ``tied_weights``
(``{alias: source}``, default ``lm_head.weight`` <- ``model.embed_tokens.weight`` when embeddings are tied) names
tensors sent twice with the layerwise reload.
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
from hybridrl_vllm.sampling import SEED_MODES
from hybridrl_vllm.sleep import LEVELS

WEIGHT_LOADS = ("auto", "direct", "layerwise")
#: how ``from_options`` reads each typed key (an unset or ``None`` key keeps the field's default).
_CASTS = {**{k: v for k, v in ENGINE_OPTION_CASTS.items() if k != "gpu_memory_utilization"},
          "kv_cache_gb": float, "fast_import": bool, "copy_graphs": bool, "graph_sequences": int}
#: left free at start beyond the share asked of vLLM (it allocates a little before checking).
START_SLACK_BYTES = 2**30
GIB = float(2**30)


@dataclass(frozen=True)
class VLLMOptions:
    tensor_parallel: int = 1
    gpu_memory_utilization: float | str = AUTO
    kv_cache_gb: float | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enforce_eager: bool | None = None
    enable_prefix_caching: bool | None = None
    sleep_mode: bool | None = None
    sleep_level: int | str = "auto"
    seed_mode: str = "auto"
    weight_load: str = "auto"
    fast_import: bool = True
    copy_graphs: bool = True
    graph_sequences: int | None = None
    engine_kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> VLLMOptions:
        level = options.get("sleep_level", "auto")
        made = cls(
            **read_options(options, _CASTS),
            **read_choices(options, ("seed_mode", "weight_load")),
            gpu_memory_utilization=read_utilization(options.get("gpu_memory_utilization")),
            sleep_level=_sleep_level(level),
            engine_kwargs=dict(options.get("engine_kwargs") or {}),
        )
        made.validate()
        return made

    @property
    def auto_memory(self) -> bool:
        return self.gpu_memory_utilization == AUTO and self.kv_cache_gb is None

    def validate(self) -> None:
        check_engine_options(self.tensor_parallel, 0.5 if self.gpu_memory_utilization == AUTO
                             else self.gpu_memory_utilization)
        if self.graph_sequences is not None and self.graph_sequences <= 0:
            raise ValueError(f"graph_sequences must be positive, got {self.graph_sequences}")
        if self.kv_cache_gb is not None and self.kv_cache_gb <= 0:
            raise ValueError(f"kv_cache_gb must be positive, got {self.kv_cache_gb}")
        if self.sleep_level not in LEVELS:
            raise ValueError(f"sleep_level must be one of {LEVELS}, got {self.sleep_level!r}")
        check_choice("seed_mode", self.seed_mode, SEED_MODES)
        check_choice("weight_load", self.weight_load, WEIGHT_LOADS)


def read_utilization(value: Any) -> float | str:
    """``auto`` (also unset), or a share in (0, 1] (checked by ``validate``)."""
    return AUTO if is_auto(value) else float(value)


@dataclass(frozen=True)
class StartMemory:
    """What the engine is told at start: the KV cache's bytes (None: vLLM's own rule), the share of the device
    it may take (vLLM checks at start that this much is free), and how the cache was sized."""

    utilization: float
    kv_cache_bytes: int | None = None
    sizing: KVSizing | None = None


def start_memory(opts: VLLMOptions, free_bytes: int, total_bytes: int, weights_bytes: int, overhead_bytes: int,
                 demand: KVDemand | None, device: str = "the GPU") -> StartMemory:
    """``gpu_memory_utilization: auto``: the cache from ``size_kv_cache``, given to vLLM as
    ``kv_cache_memory_bytes`` (vLLM then skips its own sizing), and a share that passes vLLM's start-up
    check (free >= total x share: what is free now, less a little). A number: vLLM's rule, refused here with
    the numbers when the share is not free (vLLM would fail the same check with a traceback)."""
    if opts.kv_cache_gb is not None:
        utilization = opts.gpu_memory_utilization if opts.gpu_memory_utilization != AUTO else \
            _share_of_free(free_bytes, total_bytes)
        return StartMemory(float(utilization), int(opts.kv_cache_gb * GIB))
    if opts.gpu_memory_utilization != AUTO:
        share = float(opts.gpu_memory_utilization)
        if share * total_bytes > free_bytes:
            raise KVCacheTooSmall(
                f"{UTILIZATION_KEY}={share:g} asks vLLM for {share * total_bytes / GIB:.1f} GiB ({share:g} of the "
                f"{total_bytes / GIB:.1f} GiB of {device}) but only {free_bytes / GIB:.1f} GiB are free after the "
                f"trainers' resident state: set it to auto (the KV cache sized from what is free) or at most "
                f"{max(free_bytes - START_SLACK_BYTES, 0) / total_bytes:.2f}",
                {"free_bytes": free_bytes, "total_bytes": total_bytes, "utilization": share})
        return StartMemory(share)
    sizing = size_kv_cache(demand, free_bytes, weights_bytes, overhead_bytes, device=device)
    return StartMemory(_share_of_free(free_bytes, total_bytes), sizing.kv_bytes, sizing)


def _share_of_free(free_bytes: int, total_bytes: int) -> float:
    return max(0.01, min(1.0, (free_bytes - START_SLACK_BYTES) / total_bytes))


def _sleep_level(value: Any) -> int | str:
    """1/2 from YAML ints or strings; anything else as given (``validate`` names the key if it is wrong)."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return value


def resolve_weight_load(choice: str, device: str, quantized: bool) -> str:
    """``direct`` only where the loaded tensors are the live ones: unquantized weights on CUDA. On CPU vLLM
    repacks linear weights after loading (and drops the originals), and quantization methods convert them;
    there the in-place ``layerwise`` reload re-runs that processing. ``direct`` asked for where it cannot
    work is refused (``check_weight_load``)."""
    check_weight_load(choice, device, quantized)
    if choice != "auto":
        return choice
    return "direct" if device == "cuda" and not quantized else "layerwise"


def check_weight_load(choice: str, device: str, quantized: bool = False) -> None:
    """Refuse ``weight_load='direct'`` on CPU or for a quantized model: ``load_weights`` into those parameters
    fails at the first sync (on CPU the repacked linear layers have no ``weight_loader`` left) or writes
    unconverted values. Called before the engine starts (device) and once it has loaded (quantization)."""
    if choice != "direct":
        return
    if device != "cuda":
        raise ValueError("weight_load='direct' needs CUDA: on CPU vLLM repacks the linear weights after loading "
                         "and they can no longer be loaded in place; use 'layerwise' or 'auto'")
    if quantized:
        raise ValueError("weight_load='direct' cannot load a quantized model (its weights are converted after "
                         "loading); use 'layerwise' or 'auto'")


def llm_kwargs(opts: VLLMOptions, *, model_path: str, dtype: str, device: str, seed: int,
               distributed: bool, logprobs_kwargs: Mapping[str, Any], memory: StartMemory | None = None,
               return_routing: bool = False, sequences: int | None = None) -> dict[str, Any]:
    """Arguments of ``vllm.LLM``. ``distributed``: the host process already has a default process group
    (then vLLM joins it as an external launcher, each tensor-parallel group of it one engine);
    ``logprobs_kwargs``: the version's way to ask for processed log-probs (``compat``); ``return_routing``: record
    each fed token's experts (an MoE model; ``roles.rollout.return_routing``); ``sequences``: what one replica
    holds at once in a step (``graph_kwargs``)."""
    cuda = device == "cuda"
    kwargs: dict[str, Any] = {
        "model": model_path,
        "dtype": dtype,
        "tensor_parallel_size": opts.tensor_parallel,
        "seed": seed,
        "skip_tokenizer_init": True,
        "disable_log_stats": True,
        "enforce_eager": (not cuda) if opts.enforce_eager is None else opts.enforce_eager,
        **logprobs_kwargs,
    }
    if cuda:
        if memory is not None:
            kwargs["gpu_memory_utilization"] = memory.utilization
        elif opts.gpu_memory_utilization != AUTO:
            kwargs["gpu_memory_utilization"] = opts.gpu_memory_utilization
        kwargs["enable_sleep_mode"] = True if opts.sleep_mode is None else opts.sleep_mode
    if memory is not None and memory.kv_cache_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = int(memory.kv_cache_bytes)
    elif opts.kv_cache_gb is not None:
        kwargs["kv_cache_memory_bytes"] = int(opts.kv_cache_gb * 2**30)
    if distributed:
        kwargs["distributed_executor_backend"] = "external_launcher"
    if return_routing:
        kwargs["enable_return_routed_experts"] = True
    for key in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching"):
        value = getattr(opts, key)
        if value is not None:
            kwargs[key] = value
    if cuda and not kwargs["enforce_eager"]:
        kwargs.update(graph_kwargs(opts, sequences))
    kwargs.update(opts.engine_kwargs)
    return kwargs


#: the largest decode batch vLLM captures as a CUDA graph unless told (its default on Hopper GPUs).
VLLM_GRAPH_SEQUENCES = 512
#: the sequences vLLM schedules at once unless told (its default for the ``LLM`` class on 70+ GiB GPUs).
VLLM_MAX_NUM_SEQS = 1024


def graph_kwargs(opts: VLLMOptions, sequences: int | None) -> dict[str, Any]:
    """CUDA graphs for every decode batch a step can hold. Past vLLM's largest captured batch (512 sequences)
    a decode step runs without a graph, bound by kernel launches at small models, which over-provisioned
    steps (``roles.rollout.oversample``) reach: the capture size follows ``graph_sequences``, else the step's
    sequences per replica when they exceed the default (rounded up to 16; ``max_num_seqs`` raised with it
    when unset). Nothing when the user passes ``compilation_config`` in ``engine_kwargs``."""
    if "compilation_config" in opts.engine_kwargs:
        return {}
    want = opts.graph_sequences
    if want is None:
        if sequences is None or sequences <= VLLM_GRAPH_SEQUENCES:
            return {}
        want = -(-sequences // 16) * 16
    out: dict[str, Any] = {"compilation_config": {"max_cudagraph_capture_size": int(want)}}
    if opts.max_num_seqs is None and want > VLLM_MAX_NUM_SEQS:
        out["max_num_seqs"] = int(want)
    return out


#: the pre-flight check of the rollout's settings (registered as the backend's ``check_options``).
option_problems = parse_check(VLLMOptions.from_options)


#: one line per option for ``hybridrl plugins vllm`` (``OPTIONS``); every field of ``VLLMOptions`` has one.
OPTION_DESCRIPTIONS = {
    "tensor_parallel": "ranks per engine replica (consecutive ranks of the pool)",
    "gpu_memory_utilization": "auto: the KV cache holds the step's sequences, sized from what is free when the "
                              "engine starts (hybridrl.rollout.kv_budget); or vLLM's share of the device's total "
                              "memory, which must be free when it starts",
    "kv_cache_gb": "a fixed KV-cache size (GiB) instead of either",
    "max_model_len": "context length (default: the model's)",
    "max_num_seqs": "sequences decoded at once (default: vLLM's)",
    "max_num_batched_tokens": "tokens per engine step (default: vLLM's)",
    "graph_sequences": "the largest decode batch captured as a CUDA graph (default: the step's sequences per "
                       "replica where they exceed vLLM's 512)",
    "enforce_eager": "no CUDA graphs or torch.compile (default: on for CPU, off for GPU)",
    "enable_prefix_caching": "default: vLLM's (on); the prompts of a GRPO group share their prefix",
    "sleep_mode": "allocate so that sleep can release memory (default: on for GPU)",
    "sleep_level": "1, 2, auto or kv_cache (weights stay resident; hybridrl_vllm.sleep)",
    "seed_mode": "request (one seed per row, reproducible), engine (one stream: fast on GPU) or auto (request on "
                 "CPU, engine on GPU)",
    "weight_load": "auto, direct (load_weights into the live parameters: CUDA, unquantized) or layerwise (vLLM's "
                   "in-place reload that re-runs weight processing: CPU, quantized)",
    "fast_import": "with direct loads, copy each tensor straight into its slice of the live parameters after the "
                   "first update taught where it goes (copy_plan)",
    "copy_graphs": "on CUDA, replay a bucket's planned copies from a CUDA graph once the same bucket came at two "
                   "updates in a row",
    "engine_kwargs": "any other vllm.LLM keyword arguments (they win)",
}
OPTIONS = dataclass_options(VLLMOptions, OPTION_DESCRIPTIONS,
                            types={"gpu_memory_utilization": "float | auto", "sleep_level": "int | auto | kv_cache"})
