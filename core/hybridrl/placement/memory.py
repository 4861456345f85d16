"""Memory per device of a plan, estimated from the model's HF config before any GPU is spent.

The estimate follows what the engines actually hold. The FSDP2 engine keeps fp32 master weights (a frozen role
on a GPU: weights in the compute dtype), fp32 gradients and two fp32 AdamW states, sharded over its pool, and
gathers a few decoder layers at a time in the compute dtype; what ``roles.<role>.options.offload`` sends to
host memory is off the device outside the phases that use it. A rollout engine holds full weights / tensor
parallel, a KV cache sized by ``hybridrl.rollout.kv_budget`` (``gpu_memory_utilization: auto``) or by its share
of the device, its activations and its CUDA graphs.

Roles on one pool time-share the device: a device's peak is its largest *phase*, not the sum of its roles.
In each phase the working role holds its phase's memory and the others their resident state; a colocated
rollout asleep keeps only its CUDA graphs (and its weights with ``sleep_level: kv_cache``), and at ``gen`` it
holds everything it mapped back on wake. The activations saved for backward were counted tensor by tensor on a
Qwen2 decoder layer (``saved_bytes_per_token_layer``); the plan is a guide, checked against the device memory
measured per phase (``memory/phase/<phase>/device_peak_mb``) by ``benchmarks/model_sizes.py``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from hybridrl.config import RunConfig
from hybridrl.placement.lora_memory import apply_lora, apply_lora_rollout
from hybridrl.placement.model_protocol import OFFLOAD_MODES, RoleMemory, TrainSettings
from hybridrl.placement.plan import PlacementPlan
from hybridrl.roles import STEP_PHASES, phase_owner, role_spec
from hybridrl.rollout.kv_budget import KVCacheTooSmall, KVDemand, is_auto, size_kv_cache

GIB = float(2**30)
#: default device memory (GiB) for a cuda cluster whose memory was not declared.
DEFAULT_CUDA_MEMORY_GIB = 80.0
#: CUDA context, NCCL buffers and allocator slack per process on a device.
CUDA_CONTEXT_GIB = 1.0
#: model types whose layer layout the parameter count knows exactly.
KNOWN_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: rollouts whose KV cache grows with the batch (everything else preallocates one at start).
DEMAND_SIZED_ROLLOUTS = ("hf",)
#: preallocating rollouts whose numeric ``gpu_memory_utilization`` is a share of the memory free at their start
#: (SGLang's ``mem_fraction_static``); vLLM's is a share of the device's total.
SHARE_OF_FREE_ROLLOUTS = ("sglang",)


class MemoryEstimateError(ValueError):
    """The model config cannot be read or describes an architecture the estimate does not cover."""


# --- the model --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelShape:
    """The sizes of a dense decoder-only transformer that memory and FLOPs depend on."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head's queries and keys
    max_positions: int | None = None  # the context length the model was made for (max_position_embeddings)

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        h, q, kv, i = self.hidden_size, self.q_dim, self.kv_dim, self.intermediate_size
        attn = h * q + 2 * h * kv + q * h
        if self.qkv_bias:
            attn += q + 2 * kv
        if self.o_bias:
            attn += h
        if self.qk_norm:
            attn += 2 * self.head_dim
        mlp = 3 * h * i + (2 * i + h if self.mlp_bias else 0)
        return attn + mlp + 2 * h  # two RMSNorms

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def root_params(self) -> int:
        """Parameters outside the decoder layers: embeddings, LM head (when untied), final norm."""
        return self.embedding_params * (1 if self.tie_word_embeddings else 2) + self.hidden_size

    def param_count(self) -> int:
        return self.num_layers * self.layer_params + self.root_params

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.kv_dim * dtype_bytes

    def saved_bytes_per_token_layer(self, compute_bytes: int, fused: bool = False) -> int:
        """Bytes one decoder layer keeps for backward per token, counted on a real Qwen2 layer (SDPA with
        grouped-query attention, no padding mask): each RMSNorm keeps its fp32 input, the rsqrt and the
        normalised value in the compute dtype; the attention and MLP input projections keep their input; the
        attention keeps rotated q/k, v, its output and the fp32 log-sum-exp per head; the MLP keeps gate, up,
        act(gate) and their product. Exact for bf16 (13608 bytes per token for hidden 256, intermediate 1024,
        8 heads, 2 KV heads), and for fp32, where the dtype casts are no-ops. ``fused`` (the FSDP backend's
        ``fused_kernels``): each RMSNorm keeps its input and the fp32 rsqrt per row, the MLP gate and up only
        (its product is the down projection's input)."""
        h, q, kv, i, cb = self.hidden_size, self.q_dim, self.kv_dim, self.intermediate_size, compute_bytes
        if fused:
            return 2 * (cb * h + 4) + 2 * cb * h + cb * (2 * q + 2 * kv) + 4 * self.num_heads + 3 * cb * i
        norm = 4 * h + 4 + (4 * h if cb == 4 else cb * h)  # fp32 input (the cast is a no-op in fp32), rsqrt, normalised
        return 2 * norm + 2 * cb * h + cb * (2 * q + 2 * kv) + 4 * self.num_heads + 4 * cb * i

    def forward_bytes_per_token_layer(self, compute_bytes: int) -> int:
        """Peak transient bytes per token inside one layer of a forward without autograd (residual stream,
        the fp32 norm, q/k/v and the attention output, the MLP's gate, up and product)."""
        h, q, kv, i, cb = self.hidden_size, self.q_dim, self.kv_dim, self.intermediate_size, compute_bytes
        return 4 * h + cb * (3 * h + 2 * q + 2 * kv + 3 * i)

    def backward_bytes_per_token_layer(self, compute_bytes: int) -> int:
        """Transient bytes per token while one layer runs its backward (gradients of the MLP intermediates and
        of the residual stream)."""
        return compute_bytes * (3 * self.intermediate_size + 2 * self.hidden_size)

    def describe(self) -> str:
        n = self.param_count()
        size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
        return f"{self.model_type} {size} parameters"


def shape_from_hf_config(config: dict[str, Any]) -> ModelShape:
    """``ModelShape`` from a ``config.json`` dict; keys the file leaves out take the transformers class
    defaults (a saved config omits values equal to them)."""
    data = dict(config)
    model_type = str(data.get("model_type", "")).lower()
    try:
        from transformers import AutoConfig

        full = AutoConfig.for_model(model_type, **{k: v for k, v in data.items() if k != "model_type"}).to_dict()
        data = {**full, **data}
    except (ImportError, ValueError, KeyError, TypeError):
        pass  # an unknown model type: use the file's keys as they are
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if data.get(key):
            raise MemoryEstimateError(f"'{model_type}' is a mixture-of-experts model ({key}={data[key]}); "
                                      "the memory estimate covers dense decoder-only models")
    try:
        hidden = int(data["hidden_size"])
        heads = int(data["num_attention_heads"])
        shape = ModelShape(
            model_type=model_type or "unknown",
            vocab_size=int(data["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(data["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(data.get("num_key_value_heads") or heads),
            head_dim=int(data.get("head_dim") or hidden // heads),
            intermediate_size=int(data["intermediate_size"]),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(data.get("attention_bias")),
            o_bias=model_type != "qwen2" and bool(data.get("attention_bias")),
            mlp_bias=bool(data.get("mlp_bias")),
            qk_norm=model_type == "qwen3",
            max_positions=int(data["max_position_embeddings"]) if data.get("max_position_embeddings") else None,
        )
    except KeyError as exc:
        raise MemoryEstimateError(
            f"model config has no {exc.args[0]!r}: not a decoder-only transformer config") from None
    return shape


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """A ``config.json`` given as the file or its folder."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise MemoryEstimateError(
            f"no model config at '{p}' (give --model-config FILE or a folder holding config.json)")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise MemoryEstimateError(f"'{p}' is not valid JSON: {exc}") from None


def tiny_shape(tiny: Any) -> ModelShape:
    """The shape of the model ``model.tiny`` builds (a tied-embedding Qwen2 over its tokenizer's vocabulary)."""
    from hybridrl.tasks.tiny_model import tiny_tokenizer

    try:
        vocab = len(tiny_tokenizer(tiny))
    except (OSError, ValueError) as exc:
        raise MemoryEstimateError(f"model.tiny.tokenizer: {exc}") from None
    return ModelShape("qwen2", vocab, tiny.hidden_size, tiny.num_layers, tiny.num_heads,
                      tiny.num_kv_heads, tiny.hidden_size // tiny.num_heads, tiny.intermediate_size,
                      tie_word_embeddings=True, qkv_bias=True)


def _candidates(path: str, base_dirs: Sequence[str | Path]) -> list[Path]:
    """``path`` as given (relative to the working folder, like every path in a config), then under each base."""
    return [Path(path)] + ([] if Path(path).is_absolute() else [Path(b) / path for b in base_dirs])


def model_shape(cfg: RunConfig, model_config: str | Path | None = None, base_dirs: Sequence[str | Path] = ()
                ) -> tuple[ModelShape, str]:
    """The actor's model shape and where it came from: ``model_config`` (file or folder) if given, the tiny
    model's settings, or ``model.path``/config.json (also tried under ``base_dirs``)."""
    if model_config is not None:
        return shape_from_hf_config(read_hf_config(model_config)), str(model_config)
    if cfg.model.tiny is not None:
        return tiny_shape(cfg.model.tiny), "model.tiny"
    assert cfg.model.path is not None
    for candidate in _candidates(cfg.model.path, base_dirs):
        if (candidate / "config.json").is_file():
            return shape_from_hf_config(read_hf_config(candidate)), str(candidate / "config.json")
    raise MemoryEstimateError(f"model.path '{cfg.model.path}' holds no config.json; give --model-config FILE")


# --- per role ---------------------------------------------------------------------------------------

#: bytes of fp32 parameters per AdamW param group of the FSDP engine: foreach's temporaries (a copy of the
#: group's second moments) stay within one group (``hybridrl_fsdp`` reads this constant).
OPTIMIZER_GROUP_BYTES = 2 * 2**30
#: bytes per logit (in units of the compute dtype) alive at the start of the backward: the logits kept for
#: it, the gradient of the response slice and the full-width gradient the slice's backward builds.
TRAIN_LOGITS_COPIES = 3
#: the fp32 chunks of the chunked log-prob (``hybridrl_fsdp.logprobs``): forward, and backward.
LOG_PROB_CHUNKS_FORWARD = 2 * 256 * 2**20
LOG_PROB_CHUNKS_BACKWARD = 4 * 256 * 2**20
#: the FSDP engine's fused LM head (``hybridrl_fsdp.fused_head``, on unless ``options.fused_lm_head: false``) makes
#: the logits a chunk of tokens at a time: bytes of one chunk and its softmax temporaries (Triton on a GPU: the
#: chunk in the compute dtype; eager elsewhere: fp32 chunks of 256 MiB).
FUSED_HEAD_CHUNK_BYTES = {"cuda": 1.5 * 2**30, "cpu": 3 * 256 * 2**20}
#: the caching allocator's rounding and fragmentation on a backward's transient memory.
ALLOCATOR_SLACK = 1.05
#: a rollout engine's CUDA graph pool: a fixed part and a share of its weights.
GRAPH_POOL_BASE = 0.25 * GIB
GRAPH_POOL_SHARE = 0.03
#: bytes per logit while an engine samples (bf16 logits, their fp32 copy, softmax, the sampler's draw, the
#: processed log-probs).
SAMPLER_BYTES_PER_LOGIT = 16
#: device memory an engine adds beyond the host process's CUDA context: an engine inside the worker's process
#: (its handles and workspaces), an engine with processes of its own (their contexts).
ENGINE_EXTRA_CONTEXT = {"vllm": 0.5 * GIB, "sglang": 1.0 * GIB}
#: per-backend defaults of the batch an engine profiles at start (tokens per step, sequences at once), on
#: devices of at least 70 GiB (vLLM's rule; smaller devices get the second pair).
ENGINE_BATCH_DEFAULTS = {"vllm": ((16384, 1024), (8192, 256)), "sglang": ((8192, 1024), (8192, 256))}


def _tokens(cfg: RunConfig, micro_batch: int | None, max_tokens: int | None) -> tuple[float, float]:
    """(tokens, response tokens) of one micro-batch on one rank, at the longest sequence."""
    prompt, response = cfg.data.max_prompt_len, cfg.roles.rollout.max_new_tokens
    seq = prompt + response
    if max_tokens:
        return float(max_tokens), float(max_tokens) * response / seq
    mb = micro_batch or cfg.roles.actor.micro_batch
    return float(mb * seq), float(mb * response)


def _role_setting(cfg: RunConfig, role: str, key: str) -> Any:
    value = getattr(getattr(cfg.roles, role, None), key, None)
    if value is None:
        value = getattr(cfg.roles.actor, key, None)
    return value


def role_options(cfg: RunConfig, role: str) -> dict[str, Any]:
    return dict(getattr(getattr(cfg.roles, role, None), "options", {}) or {})


def uses_fused_head(cfg: RunConfig, role: str) -> bool:
    """Whether the role's log-probs come from the FSDP engine's fused head: a vocabulary head, not turned off
    (``options.fused_lm_head: false``)."""
    return bool(role_spec(role).vocab_head) and role_options(cfg, role).get("fused_lm_head", True) is not False


def train_settings(cfg: RunConfig, role: str) -> TrainSettings:
    """The role's settings as the config gives them (an ``auto`` not resolved yet counts as off / none)."""
    tokens, resp = _tokens(cfg, _role_setting(cfg, role, "micro_batch"),
                           _role_setting(cfg, role, "max_tokens_per_micro_batch"))
    options = role_options(cfg, role)
    checkpointing = options.get("gradient_checkpointing")
    offload = options.get("offload") or "none"
    return TrainSettings(tokens, resp, checkpointing is True, offload if offload in OFFLOAD_MODES else "none",
                         options.get("fused_kernels") is True, options.get("head_logits") == "keep")


@dataclass
class PoolMemory:
    pool: str
    devices: int
    roles: list[str]
    processes: int
    phases: dict[str, float]  # phase -> bytes per device
    device_bytes: float | None

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.__getitem__)

    @property
    def peak(self) -> float:
        return self.phases[self.peak_phase]

    @property
    def fits(self) -> bool | None:
        return None if self.device_bytes is None else self.peak <= self.device_bytes


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


def train_role_memory(cfg: RunConfig, role: str, pool: str, shape: ModelShape, dp: int, compute_bytes: int,
                      trainable: bool, settings: TrainSettings | None = None, device: str = "cuda") -> RoleMemory:
    """FSDP2 layout: the weights shard (fp32 masters when trainable, the compute dtype for a frozen role on a
    GPU), fp32 gradients and two AdamW states when trainable, a few gathered layers and the root module in
    the compute dtype while computing, and the micro-batch's activations."""
    settings = settings or train_settings(cfg, role)
    n = shape.param_count()
    shard = n / dp
    cb = compute_bytes
    tokens, resp_tokens = settings.tokens, settings.response_tokens
    vocab = shape.vocab_size if role_spec(role).vocab_head else 1  # critic and reward model: a scalar head
    layer_forward = tokens * shape.forward_bytes_per_token_layer(cb)
    chunk_cap = 4 * resp_tokens * vocab * 4  # the fp32 chunks never exceed the logits themselves
    fused = uses_fused_head(cfg, role)
    fused_chunk = min(FUSED_HEAD_CHUNK_BYTES["cuda" if device == "cuda" else "cpu"], chunk_cap)
    if fused:  # the head's logits a chunk at a time, never all at once
        forward_logits = fused_chunk
    else:
        forward_logits = resp_tokens * vocab * cb + (min(LOG_PROB_CHUNKS_FORWARD, chunk_cap) if vocab > 1 else 0)
    mem = RoleMemory(role, pool, "train" if trainable else "frozen", f"1/{dp} FSDP", offload=settings.offload,
                     tokens=tokens, checkpointing=settings.checkpointing, optimizer_group_bytes=OPTIMIZER_GROUP_BYTES)
    master_bytes = 4 if trainable or device != "cuda" else cb
    mem.weights = master_bytes * shard
    mem.gathered = cb * (shape.root_params + 2 * shape.layer_params)  # current layer + the prefetched next
    mem.forward = mem.weights + mem.gathered + layer_forward + forward_logits
    if trainable:
        mem.grads = 4 * shard
        mem.optimizer = 8 * shard
        mem.optimizer_step = 4 * min(shard, OPTIMIZER_GROUP_BYTES / 4)  # sqrt of one group's second moments
        mem.gathered += cb * shape.layer_params  # backward: a layer's unsharded gradients before reduce-scatter
        per_layer = shape.saved_bytes_per_token_layer(cb, fused=settings.fused_layers and device == "cuda")
        if settings.checkpointing:
            layers = tokens * (shape.num_layers * shape.hidden_size * cb + per_layer)
        else:
            layers = tokens * shape.num_layers * per_layer
        if fused:  # backward: a chunk, the head's fp32 weight gradient and a chunk's product, the hidden's gradient
            logits = fused_chunk + vocab * shape.hidden_size * (4 + cb) + resp_tokens * shape.hidden_size * cb
            if settings.keep_logits:  # the micro-batch's logits, kept from the forward: at most one per token
                logits += tokens * vocab * cb  # (a pack with shared prompts is nearly all response tokens)
        else:
            logits = resp_tokens * vocab * cb * TRAIN_LOGITS_COPIES + (min(LOG_PROB_CHUNKS_BACKWARD, chunk_cap)
                                                                       if vocab > 1 else 0)
        mem.activations = (layers + logits + tokens * shape.backward_bytes_per_token_layer(cb)) * ALLOCATOR_SLACK
        if settings.offload == "none":
            mem.forward += mem.optimizer
        mem.notes.append("gradient checkpointing" if settings.checkpointing else "no gradient checkpointing")
    else:
        mem.activations = layer_forward + forward_logits
    mem.notes.append(f"{tokens:.0f} tokens per micro-batch")
    on_device_weights = 0.0 if settings.offload == "all" else mem.weights
    on_device_optimizer = mem.optimizer if settings.offload == "none" else 0.0
    mem.idle = on_device_weights + on_device_optimizer  # gradients are freed after the optimizer step
    if settings.offload != "none":
        mem.notes.append(f"offload {settings.offload}: on the host outside its phases")
    return mem


def rollout_batch(backend: str, options: dict[str, Any], device_bytes: float | None) -> tuple[int, int]:
    """(tokens per engine step, sequences at once) the engine profiles and captures at start."""
    large, small = ENGINE_BATCH_DEFAULTS.get(backend, ENGINE_BATCH_DEFAULTS["vllm"])
    tokens, seqs = large if device_bytes is None or device_bytes >= 70 * GIB else small
    return int(options.get("max_num_batched_tokens") or tokens), int(options.get("max_num_seqs") or seqs)


def rollout_overhead_bytes(shape: ModelShape, dtype_bytes: int, backend: str, options: dict[str, Any],
                           device_bytes: float | None, tp: int = 1, sequences: int | None = None
                           ) -> tuple[float, float]:
    """(activations, CUDA graph pool) of a preallocating engine: the larger of a prefill step's transients
    and the sampler's logits for ``sequences`` at once (the engine's own maximum when None: what it
    profiles at start), and its graph pool (none with ``enforce_eager``)."""
    batched, max_seqs = rollout_batch(backend, options, device_bytes)
    at_once = min(max_seqs, batched) if sequences is None else min(sequences, max_seqs)
    prefill = batched * shape.forward_bytes_per_token_layer(dtype_bytes) / tp
    sampler = at_once * shape.vocab_size * SAMPLER_BYTES_PER_LOGIT
    weights = shape.param_count() * dtype_bytes / tp
    graphs = 0.0 if options.get("enforce_eager") else GRAPH_POOL_BASE + GRAPH_POOL_SHARE * weights
    return max(prefill, sampler), graphs


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
    """What one step asks of the rollout: sequences in the whole step, tokens of the longest one."""
    return {"sequences": cfg.data.prompts_per_step * cfg.algorithm.n_samples,
            "tokens_per_sequence": cfg.data.max_prompt_len + cfg.roles.rollout.max_new_tokens}


def rollout_memory(cfg: RunConfig, pool: str, shape: ModelShape, pool_size: int, dtype_bytes: int,
                   device_bytes: float | None, backend: str, free_at_start: float | None = None) -> RoleMemory:
    """Full weights / tensor parallel plus the KV cache: sized to the batch for engines that allocate on
    demand (the transformers rollout); by ``hybridrl.rollout.kv_budget`` from ``free_at_start`` (what the
    trainers leave) under ``gpu_memory_utilization: auto``; else the share of the device the number asks for
    (vLLM: of total memory, SGLang: of the memory free at its start)."""
    rcfg = cfg.roles.rollout
    tp = max(1, rcfg.tensor_parallel)
    replicas = max(1, pool_size // tp)
    demand = kv_demand(cfg, shape, dtype_bytes, replicas)
    mem = RoleMemory("rollout", pool, "rollout", "full" if tp == 1 else f"1/{tp} TP")
    mem.weights = shape.param_count() * dtype_bytes / tp
    options = dict(rcfg.options or {})
    if backend in DEMAND_SIZED_ROLLOUTS or device_bytes is None:
        seqs, seq_len = demand.sequences, demand.tokens_per_sequence
        forward_per_token = (2 * shape.hidden_size + shape.q_dim + 2 * shape.kv_dim + 2 * shape.intermediate_size)
        prefill = seqs * cfg.data.max_prompt_len
        mem.activations = (prefill * forward_per_token * dtype_bytes + seqs * shape.vocab_size * 4) / tp
        mem.kv_cache = seqs * seq_len * shape.kv_bytes_per_token(dtype_bytes) / tp
        mem.notes.append(f"KV cache for {seqs} sequences x {seq_len} tokens")
        mem.asleep = 0.0
        mem.idle = mem.active
        return mem
    mem.activations, mem.graphs = rollout_overhead_bytes(shape, dtype_bytes, backend, options, device_bytes, tp,
                                                         sequences=demand.sequences)
    start_activations, _ = rollout_overhead_bytes(shape, dtype_bytes, backend, options, device_bytes, tp)
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
        if backend in SHARE_OF_FREE_ROLLOUTS:
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


def estimate_memory(cfg: RunConfig, plan: PlacementPlan, shape: ModelShape, device_bytes: float | None,
                    source: str = "", shapes: dict[str, ModelShape] | None = None,
                    settings: dict[str, TrainSettings] | None = None) -> MemoryEstimate:
    """Per-role and per-pool memory of ``plan``. ``shapes`` gives other models by role (a critic or reward
    model built from another checkpoint); the actor's ``shape`` otherwise. ``settings`` overrides the train
    roles' settings by role (the auto choices try several)."""
    shapes = shapes or {}
    settings = settings or {}
    device = plan.cluster.device
    dtype_bytes = DTYPE_BYTES[cfg.model.dtype]
    compute_bytes = dtype_bytes if device == "cuda" else 4  # the FSDP engine computes in fp32 on CPU
    context = CUDA_CONTEXT_GIB * GIB if device == "cuda" else 0.0
    roles: list[RoleMemory] = []
    for role, pool in plan.role_pool.items():
        group = plan.group_of(role)
        if role != "rollout" and role_spec(role).kind == "train":
            roles.append(train_role_memory(cfg, role, pool, shapes.get(role, shape), group.world_size, compute_bytes,
                                           trainable=role_spec(role).trainable, settings=settings.get(role),
                                           device=device))
    apply_lora(cfg, plan, roles, shape, compute_bytes, device, OPTIMIZER_GROUP_BYTES)  # base and adapters apart
    pool_overhead: dict[str, float] = {}
    for pool in plan.pools:
        processes = sum(1 for g in plan.groups if g.pool == pool)
        extra = sum(ENGINE_EXTRA_CONTEXT.get(backend, 0.0) for g in plan.groups if g.pool == pool
                    for r, backend in g.roles.items() if r == "rollout") if device == "cuda" else 0.0
        pool_overhead[pool] = processes * context + extra
    if "rollout" in plan.role_pool:
        pool = plan.role_pool["rollout"]
        group = plan.group_of("rollout")
        resident = sum(m.idle for m in roles if m.pool == pool)
        free = None if device_bytes is None else device_bytes - pool_overhead[pool] - resident
        roles.append(rollout_memory(cfg, pool, shapes.get("rollout", shape), group.world_size, dtype_bytes,
                                    device_bytes, group.roles["rollout"], free))
        apply_lora_rollout(cfg, plan, roles[-1], shapes.get("rollout", shape), dtype_bytes)
    by_role = {m.role: m for m in roles}
    pools: list[PoolMemory] = []
    warnings: list[str] = []
    for pool, devices in plan.pools.items():
        members = [m for m in roles if m.pool == pool]
        if not members:
            continue
        processes = sum(1 for g in plan.groups if g.pool == pool)
        colocated = len(members) > 1
        phases: dict[str, float] = {}
        largest: dict[str, RoleMemory] = {}  # phase -> the role holding the most memory in it
        for phase in STEP_PHASES:
            owner = phase_owner(phase)
            if owner is None or owner[0] not in by_role:
                continue
            worker, mode = owner[0], owner[1].mode
            held: dict[str, float] = {}
            for m in members:
                if m.role == worker:
                    held[m.role] = m.forward if mode == "forward" and m.kind != "rollout" else m.active
                elif m.kind == "rollout" and colocated:
                    held[m.role] = m.asleep  # KV cache released, weights to host (or kept: sleep_level kv_cache)
                else:
                    held[m.role] = m.idle
            phases[phase] = pool_overhead[pool] + sum(held.values())
            largest[phase] = by_role[max(held, key=held.__getitem__)]
        pm = PoolMemory(pool, len(devices), [m.role for m in members], processes, phases, device_bytes)
        pools.append(pm)
        if pm.fits is False:
            warnings.append(f"pool '{pool}' needs ~{pm.peak / GIB:.1f} GiB per device in phase {pm.peak_phase}, "
                            f"more than the {device_bytes / GIB:.0f} GiB device; "
                            f"{_advice(cfg, largest[pm.peak_phase])}")
    for m in roles:
        if m.kind == "rollout" and m.kv_cache < 0:
            warnings.append(f"roles.rollout: no room for a KV cache ({m.kv_cache / GIB:.1f} GiB left under "
                            f"gpu_memory_utilization); raise it or add tensor_parallel")
        elif m.kind == "rollout" and any(n.startswith("KV floor") for n in m.notes):
            warnings.append("roles.rollout: " + next(n for n in m.notes if n.startswith("KV floor")))
    return MemoryEstimate(shape, source, cfg.model.dtype, device, device_bytes, roles, pools, warnings)


def _advice(cfg: RunConfig, worst: RoleMemory) -> str:
    if worst.kind == "rollout":
        return ("set roles.rollout.options.gpu_memory_utilization=auto (or lower it), offload the trainers "
                "(roles.ref.options.offload=all, roles.actor.options.offload=optimizer), raise "
                "roles.rollout.tensor_parallel, or give the rollout its own pool")
    tips = []
    options = role_options(cfg, worst.role)
    tips.append(f"lower roles.{worst.role}.max_tokens_per_micro_batch (or micro_batch)")
    if worst.kind == "train" and options.get("gradient_checkpointing") is not True:
        tips.append(f"set roles.{worst.role}.options.gradient_checkpointing=true")
    if worst.offload != "all":
        mode = "optimizer" if worst.kind == "train" and worst.offload == "none" else "all"
        tips.append(f"roles.{worst.role}.options.offload={mode}")
    tips.append(f"spread {worst.role} over more devices (pools.{worst.pool})")
    return f"{worst.role} holds the most: " + ", ".join(tips)


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
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for i, row in enumerate(rows):
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if i == 0:
            lines.append("  " + "  ".join("-" * w for w in widths))
    for p in est.pools:
        phases = ", ".join(f"{k} {_gib(v)}" for k, v in p.phases.items())
        verdict = "" if p.fits is None else ("  ok" if p.fits else "  DOES NOT FIT")
        lines.append(f"pool {p.pool} ({p.devices} device(s), {' + '.join(p.roles)}): peak {_gib(p.peak)} {unit} in "
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
        for candidate in _candidates(path, base_dirs):
            if (candidate / "config.json").is_file():
                try:
                    out[role] = shape_from_hf_config(read_hf_config(candidate))
                except MemoryEstimateError:
                    pass
                break
    return out
