"""A backend's memory model: what one role of that backend holds on a device, and the settings it lets the
``auto`` search try. The planner (``hybridrl.placement.memory``) sums what the models return per device and
phase; the search (``hybridrl.placement.auto``) tries the settings each model offers. Neither knows a backend:
each registers its model with ``registry.add_train_engine(..., memory_model=...)`` / ``add_rollout``.

A backend without a model is shown as "not estimated" in the plan and gets no memory-driven ``auto``: the
planner never guesses with another backend's formula.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from hybridrl.roles import role_spec

if TYPE_CHECKING:
    from hybridrl.config import RunConfig
    from hybridrl.placement.memory import ModelShape

AUTO = "auto"
#: where ``options.offload`` may keep a train role's state while other roles work (the search's vocabulary).
OFFLOAD_MODES = ("none", "optimizer", "all")


@dataclass(frozen=True)
class AutoChoice:
    """One resolved ``auto``: the key path, the value it took, and why."""

    key: str
    value: Any
    reason: str

    def note(self) -> str:
        shown = str(self.value).lower() if isinstance(self.value, bool) else str(self.value)
        return f"auto: {self.key}={shown} ({self.reason})"


@dataclass(frozen=True)
class TrainSettings:
    """What sizes a train role's memory: the tokens of one micro-batch (at the longest sequence), activation
    checkpointing, what it offloads to host memory between its phases, and two head/kernel switches."""

    tokens: float
    response_tokens: float
    checkpointing: bool = False
    offload: str = "none"
    fused_layers: bool = False  # fused RMSNorm / SwiGLU kernels keep less for backward
    keep_logits: bool = False  # the head keeps its logits for the backward


@dataclass(frozen=True)
class Knobs:
    """Which of a train role's settings the model lets the search choose (they are ``auto`` in the config)."""

    budget: bool
    checkpointing: bool
    offload: bool
    trainable: bool
    head_logits: bool = False

    @property
    def any(self) -> bool:
        return self.budget or self.checkpointing or self.offload or self.head_logits


@dataclass
class RoleMemory:
    """Bytes one device holds for one role: while the role works (``active``, ``forward``), between its phases
    (``idle``, its resident state), and, for a colocated rollout, asleep (``asleep``)."""

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
    gathered: float = 0.0  # unsharded layers in the compute dtype while it computes
    optimizer_step: float = 0.0  # the optimizer step's temporaries
    graphs: float = 0.0  # a rollout's CUDA graph pool (kept while asleep)
    asleep: float = 0.0  # a colocated rollout between generations
    offload: str = "none"
    tokens: float = 0.0  # a train role's micro-batch (tokens at the longest sequence)
    checkpointing: bool = False
    utilization: Any = None  # a preallocating rollout's gpu_memory_utilization (auto or a share)
    adapters: float = 0.0  # LoRA adapters, part of weights (``hybridrl.placement.lora_memory``)
    #: fp32 parameters per optimizer param group: offloaded states come through the device two groups at a time
    optimizer_group_bytes: float = math.inf
    host_copy_asleep: bool = False  # a rollout that copies its weights to host memory while asleep
    notes: list[str] = field(default_factory=list)

    @property
    def active(self) -> float:
        if self.kind == "rollout":
            return self.weights + self.kv_cache + self.activations + self.graphs
        resident_optimizer = self.optimizer if self.offload == "none" else 0.0
        compute = self.weights + self.grads + self.gathered + self.activations + resident_optimizer
        streamed = min(self.optimizer, 2 * self.optimizer_group_bytes)
        optimizer = self.optimizer if self.offload == "none" else streamed
        step = self.weights + self.grads + optimizer + self.optimizer_step
        return max(compute, step if self.grads else 0.0)


@dataclass(frozen=True)
class RoleContext:
    """What a model is asked about: one role of ``cfg`` on ``world_size`` devices of ``pool``."""

    cfg: RunConfig
    role: str
    pool: str
    shape: ModelShape
    world_size: int
    device: str  # "cuda" or "cpu"
    dtype_bytes: int  # the model's dtype (``model.dtype``)
    device_bytes: float | None = None

    @property
    def compute_bytes(self) -> int:
        """Bytes of the compute dtype: the model's on a GPU, fp32 on the CPU."""
        return self.dtype_bytes if self.device == "cuda" else 4

    @property
    def trainable(self) -> bool:
        return role_spec(self.role).trainable

    @property
    def options(self) -> dict[str, Any]:
        return role_options(self.cfg, self.role)


def role_options(cfg: RunConfig, role: str) -> dict[str, Any]:
    return dict(getattr(getattr(cfg.roles, role, None), "options", {}) or {})


@runtime_checkable
class TrainMemoryModel(Protocol):
    """The memory of a train backend's role (the actor, the reference, a critic or reward model)."""

    #: the install hint when the backend offers ``options.fused_kernels`` (fused layer kernels on CUDA, declared
    #: by the ``fused_layer_kernels`` capability where installed); None when it offers none.
    fused_kernels: str | None

    def settings(self, cfg: RunConfig, role: str) -> TrainSettings:
        """The role's settings as the config gives them (an unresolved ``auto`` counts as off)."""

    def knobs(self, cfg: RunConfig, role: str) -> Knobs:
        """Which settings are ``auto`` in the config and offered to the search."""

    def candidates(self, cfg: RunConfig, role: str, knobs: Knobs) -> list[TrainSettings]:
        """The settings the search may try for ``knobs`` (head logits are decided after the search)."""

    def cost(self, ctx: RoleContext, settings: TrainSettings) -> float:
        """Seconds a step spends on what ``settings`` add; only the order of the candidates matters."""

    def role_memory(self, ctx: RoleContext, settings: TrainSettings) -> RoleMemory:
        """The bytes one device of the role holds with ``settings``."""

    def option_problems(self, cfg: RunConfig, role: str) -> list[tuple[str, str]]:
        """``(key path, reason)`` for each value of a searched option that is not allowed."""

    def choices(self, cfg: RunConfig, role: str, knobs: Knobs, settings: TrainSettings | None, why: str
                ) -> tuple[dict[str, Any], dict[str, Any], list[AutoChoice]]:
        """The chosen settings as ``(role field updates, option updates, choices)``; ``why`` says why they
        were chosen (the search's reason with the pool's peak); with ``settings`` None, nothing could be planned
        (on a CPU, no device memory, no model config) and ``why`` says that."""

    def advice(self, cfg: RunConfig, mem: RoleMemory) -> str:
        """What to change when the role holds the most of a device that does not fit."""


@runtime_checkable
class RolloutMemoryModel(Protocol):
    """The memory of a rollout backend's engine."""

    #: the KV cache grows with the batch (no ``workload`` to size a preallocated cache from).
    demand_sized: bool
    #: device bytes the engine adds to each pool beyond the hosting process's CUDA context.
    extra_context_bytes: float

    def role_memory(self, ctx: RoleContext, free_at_start: float | None) -> RoleMemory:
        """The engine's bytes on one device; ``free_at_start``: what the trainers leave of the device."""

    def adapter_rank(self, rank: int) -> int | None:
        """The rank of the adapter slots it allocates for LoRA adapters of ``rank`` (None: it merges them)."""

    def advice(self, cfg: RunConfig, mem: RoleMemory) -> str:
        """What to change when the rollout holds the most of a device that does not fit."""


def token_budget_is_auto(cfg: RunConfig, role: str) -> bool:
    """Neither the role (nor, for roles without one of their own, the actor) sets its micro-batch."""
    rcfg = getattr(cfg.roles, role)
    actor = cfg.roles.actor
    actor_auto = "micro_batch" not in actor.model_fields_set and actor.max_tokens_per_micro_batch is None
    if role == "actor":
        return actor_auto
    if role == "reward":  # its micro-batch is roles.reward.model.micro_batch, rows only
        return False
    return (getattr(rcfg, "micro_batch", None) is None and getattr(rcfg, "max_tokens_per_micro_batch", None) is None
            and actor_auto)


def micro_batch_tokens(cfg: RunConfig, role: str) -> tuple[float, float]:
    """(tokens, response tokens) of one micro-batch of ``role`` on one rank, at the longest sequence: the token
    budget when set, else the rows (the role's ``micro_batch``, else the actor's)."""
    micro_batch = _role_setting(cfg, role, "micro_batch")
    max_tokens = _role_setting(cfg, role, "max_tokens_per_micro_batch")
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


# --- a cost model a backend may use --------------------------------------------------------------------------

#: host work per micro-batch (seconds), sustained bf16 throughput for the forward that checkpointing recomputes,
#: host<->device copy speed: only the order of the candidates they give matters.
MICRO_BATCH_SECONDS = {"train": 0.02, "forward": 0.01}
SUSTAINED_FLOPS = 400e12
HOST_COPY_BYTES_PER_S = 25e9


def step_cost(ctx: RoleContext, s: TrainSettings) -> float:
    """Seconds a step spends on what ``s`` adds for a data-parallel role over ``ctx.world_size`` ranks: the
    micro-batches launched, the forward checkpointing recomputes, the bytes offloading moves over PCIe."""
    cfg = ctx.cfg
    dp = ctx.world_size
    rows = cfg.data.prompts_per_step * cfg.algorithm.n_samples
    seq = cfg.data.max_prompt_len + cfg.roles.rollout.max_new_tokens
    tokens_per_rank = rows * seq / dp
    trainable = ctx.trainable
    cost = math.ceil(tokens_per_rank / max(s.tokens, 1.0)) * MICRO_BATCH_SECONDS["train" if trainable else "forward"]
    n = ctx.shape.param_count() / dp
    if s.checkpointing:
        cost += 2 * n * tokens_per_rank / SUSTAINED_FLOPS  # one more forward of every micro-batch
    weights = (4 if trainable else 2) * n
    moved = {"none": 0.0, "optimizer": 8 * n, "all": 8 * n + weights}[s.offload] if trainable else \
        {"none": 0.0, "all": weights}[s.offload]
    return cost + 2 * moved / HOST_COPY_BYTES_PER_S
