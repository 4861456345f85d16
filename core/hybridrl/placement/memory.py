"""Memory per device of a plan, estimated from the model's HF config before any GPU is spent.

The estimate follows what the engines actually hold (the FSDP2 engine keeps fp32 master weights, fp32
gradients and two fp32 AdamW states, sharded over its pool, and gathers one decoder layer at a time in the
compute dtype; a rollout engine holds full weights / tensor parallel plus a KV cache). Roles on one pool
time-share the device: a device's peak is the largest *phase* of a step, not the sum of its roles.
Activations are a rough count of the tensors saved for backward; treat the whole table as a guide, not a
promise. Checked once on an H200 (a 0.5B Qwen2, 16 x 1024 tokens, micro-batch 4, bf16): the actor's update
peak came within 3 % of ``torch.cuda.max_memory_allocated`` with and without gradient checkpointing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from hybridrl.config import RunConfig
from hybridrl.placement.plan import PlacementPlan
from hybridrl.roles import STEP_PHASES, phase_owner, role_spec

GIB = float(2**30)
#: default device memory (GiB) for a cuda cluster whose memory was not declared.
DEFAULT_CUDA_MEMORY_GIB = 80.0
#: CUDA context, NCCL buffers and allocator slack per process on a device.
CUDA_CONTEXT_GIB = 1.0
#: model types whose layer layout the parameter count knows exactly.
KNOWN_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: engines that pre-allocate a KV cache as a share of device memory (vLLM's ``gpu_memory_utilization``).
DEMAND_SIZED_ROLLOUTS = ("hf",)


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

    def saved_per_token_layer(self) -> int:
        """Elements one decoder layer keeps for backward per token: norm in/out (x2), q/k/v, rotated q/k,
        attention output, the MLP's gate, up, act(gate) and product (attention scores are not kept by
        fused SDPA/flash kernels)."""
        return 4 * self.hidden_size + 3 * self.q_dim + 3 * self.kv_dim + 4 * self.intermediate_size

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

@dataclass
class RoleMemory:
    """Bytes one device holds for one role: while the role works (``active``) and while others do (``idle``)."""

    role: str
    pool: str
    kind: str  # "train", "frozen", "rollout"
    share: str  # how the weights are split ("1/8 FSDP", "full", "1/2 TP")
    weights: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    kv_cache: float = 0.0
    idle: float = 0.0
    forward: float = 0.0  # while it runs a forward-only pass (a trainable role's log-probs or values)
    notes: list[str] = field(default_factory=list)

    @property
    def active(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.kv_cache


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


def train_role_memory(cfg: RunConfig, role: str, pool: str, shape: ModelShape, dp: int, compute_bytes: int,
                      trainable: bool) -> RoleMemory:
    """FSDP2 layout: fp32 master shard (+ fp32 grads and 2 AdamW states when trainable), one gathered layer
    plus the root module (embeddings, head) in the compute dtype, and the micro-batch's activations."""
    n = shape.param_count()
    shard = n / dp
    gathered = compute_bytes * (shape.root_params + 2 * shape.layer_params)  # current layer + prefetched next
    options = getattr(getattr(cfg.roles, role, None), "options", {}) or {}
    tokens, resp_tokens = _tokens(cfg, _role_setting(cfg, role, "micro_batch"),
                                  _role_setting(cfg, role, "max_tokens_per_micro_batch"))
    vocab = shape.vocab_size if role_spec(role).vocab_head else 1  # critic and reward model: a scalar head
    per_layer = shape.saved_per_token_layer() * compute_bytes
    forward_activations = tokens * per_layer + resp_tokens * vocab * (compute_bytes + 4)  # one layer, logits
    mem = RoleMemory(role, pool, "train" if trainable else "frozen", f"1/{dp} FSDP")
    mem.weights = 4 * shard + gathered
    if trainable:
        mem.grads = 4 * shard
        mem.optimizer = 8 * shard
        checkpointing = bool(options.get("gradient_checkpointing"))
        layers = tokens * (shape.num_layers * shape.hidden_size * compute_bytes + per_layer) if checkpointing \
            else tokens * shape.num_layers * per_layer
        # logits and their gradient in the compute dtype, the fp32 copy, log-softmax and their fp32 gradient
        # (16 bytes per element in bf16: matches the peak measured on an H200 within ~5 %)
        logits = resp_tokens * vocab * (2 * compute_bytes + 12)
        mem.activations = layers + logits
        mem.idle = 4 * shard + 8 * shard  # gradients are freed after the optimizer step
        mem.notes.append("gradient checkpointing" if checkpointing else "no gradient checkpointing")
    else:
        mem.activations = forward_activations
        mem.idle = 4 * shard
    mem.forward = mem.idle + gathered + forward_activations
    return mem


def rollout_memory(cfg: RunConfig, pool: str, shape: ModelShape, pool_size: int, dtype_bytes: int,
                   device_bytes: float | None, backend: str) -> RoleMemory:
    """Full weights / tensor parallel plus the KV cache: sized to the batch for engines that allocate on
    demand (the transformers rollout), else the budget left under ``gpu_memory_utilization`` (vLLM, SGLang)."""
    rcfg = cfg.roles.rollout
    tp = max(1, rcfg.tensor_parallel)
    replicas = max(1, pool_size // tp)
    seqs = -(-cfg.data.prompts_per_step * cfg.algorithm.n_samples // replicas)
    seq_len = cfg.data.max_prompt_len + rcfg.max_new_tokens
    mem = RoleMemory("rollout", pool, "rollout", "full" if tp == 1 else f"1/{tp} TP")
    mem.weights = shape.param_count() * dtype_bytes / tp
    forward_per_token = (2 * shape.hidden_size + shape.q_dim + 2 * shape.kv_dim + 2 * shape.intermediate_size)
    demand = seqs * seq_len * shape.kv_bytes_per_token(dtype_bytes) / tp
    if backend in DEMAND_SIZED_ROLLOUTS or device_bytes is None:
        prefill = seqs * cfg.data.max_prompt_len
        mem.activations = (prefill * forward_per_token * dtype_bytes + seqs * shape.vocab_size * 4) / tp
        mem.kv_cache = demand
        mem.notes.append(f"KV cache for {seqs} sequences x {seq_len} tokens")
    else:
        util = float(rcfg.options.get("gpu_memory_utilization", 0.9))
        batched = int(rcfg.options.get("max_num_batched_tokens", 8192))
        max_seqs = int(rcfg.options.get("max_num_seqs", 256))
        mem.activations = (batched * forward_per_token * dtype_bytes + min(seqs, max_seqs) * shape.vocab_size * 4) / tp
        mem.kv_cache = util * device_bytes - mem.weights - mem.activations
        mem.notes.append(f"claims gpu_memory_utilization={util:g} of the device")
        if mem.kv_cache < demand:
            mem.notes.append(f"KV budget below the {demand / GIB:.1f} GiB one batch needs: requests will queue")
    mem.idle = mem.active
    return mem


def estimate_memory(cfg: RunConfig, plan: PlacementPlan, shape: ModelShape, device_bytes: float | None,
                    source: str = "", shapes: dict[str, ModelShape] | None = None) -> MemoryEstimate:
    """Per-role and per-pool memory of ``plan``. ``shapes`` gives other models by role (a critic or reward
    model built from another checkpoint); the actor's ``shape`` otherwise."""
    shapes = shapes or {}
    device = plan.cluster.device
    dtype_bytes = DTYPE_BYTES[cfg.model.dtype]
    compute_bytes = dtype_bytes if device == "cuda" else 4  # the FSDP engine computes in fp32 on CPU
    roles: list[RoleMemory] = []
    for role, pool in plan.role_pool.items():
        group = plan.group_of(role)
        role_shape = shapes.get(role, shape)
        if role == "rollout":
            roles.append(rollout_memory(cfg, pool, role_shape, group.world_size, dtype_bytes, device_bytes,
                                        group.roles[role]))
        elif role_spec(role).kind == "train":
            roles.append(train_role_memory(cfg, role, pool, role_shape, group.world_size, compute_bytes,
                                           trainable=role_spec(role).trainable))
    by_role = {m.role: m for m in roles}
    pools: list[PoolMemory] = []
    warnings: list[str] = []
    context = CUDA_CONTEXT_GIB * GIB if device == "cuda" else 0.0
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
                    held[m.role] = 0.0  # asleep: weights moved to host memory, KV cache released
                else:
                    held[m.role] = m.idle
            phases[phase] = processes * context + sum(held.values())
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
    return MemoryEstimate(shape, source, cfg.model.dtype, device, device_bytes, roles, pools, warnings)


def _advice(cfg: RunConfig, worst: RoleMemory) -> str:
    if worst.kind == "rollout":
        return ("lower roles.rollout.options.gpu_memory_utilization, raise roles.rollout.tensor_parallel, or "
                "give the rollout its own pool")
    tips = [f"{worst.role} holds the most: spread it over more devices (pools.{worst.pool})"]
    options = getattr(getattr(cfg.roles, worst.role, None), "options", {}) or {}
    if worst.kind == "train" and not options.get("gradient_checkpointing"):
        tips.append(f"set roles.{worst.role}.options.gradient_checkpointing=true")
    tips.append(f"lower roles.{worst.role}.micro_batch")
    return ", ".join(tips)


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
        idle = "asleep" if m.kind == "rollout" and any(p.pool == m.pool and len(p.roles) > 1 for p in est.pools) \
            else _gib(m.idle)
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
    lines.append("rule: colocated roles time-share a device: the rollout sleeps (weights to host, KV cache freed) "
                 "while the trainers work, trainer weights and optimizer states stay resident; a device's peak "
                 f"is its largest phase, not the sum of its roles{context}")
    lines += [f"WARNING: {w}" for w in est.warnings]
    return "\n".join(lines)


def device_memory_bytes(device: str, declared_gib: float | None) -> float | None:
    """The declared memory, else 80 GiB for cuda; None (no fit check) for CPU slots unless declared."""
    if declared_gib is not None:
        return declared_gib * GIB
    return DEFAULT_CUDA_MEMORY_GIB * GIB if device == "cuda" else None


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
