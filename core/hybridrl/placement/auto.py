"""The ``auto`` settings, resolved before any process starts, so that the README's defaults are the fast path.

* ``roles.rollout.log_probs: auto``: on only when something reads the rollout's log-probs: truncated
  importance sampling (``algorithm.tis_cap``) or an algorithm component that declares it needs them
  (``needs = ("rollout_log_probs", ...)`` on a registered advantage, policy loss, loss aggregation or KL
  estimator). Off, vLLM skips a log-softmax over the vocabulary for every sampled token.
* For train roles on an FSDP backend on GPUs, from the memory plan (``hybridrl.placement.memory``):
  the token budget of a micro-batch (``max_tokens_per_micro_batch``, when neither it nor ``micro_batch`` is
  set), ``options.gradient_checkpointing: auto`` and ``options.offload: auto``. Every combination is
  costed (micro-batches launched, the forward that checkpointing recomputes, the bytes that offloading moves
  over PCIe each step) and the cheapest one whose every phase fits the device is chosen. Then
  ``options.head_logits: auto``: the fused LM head keeps its logits for the backward (one GEMM less) where they
  fit beside those settings, and makes them again otherwise; they never cost a smaller micro-batch, and the
  search stays as large as it was.
* ``roles.rollout.options.workload``: the step's sequences and their length, from which a preallocating
  engine sizes its KV cache (``hybridrl.rollout.kv_budget``).

Each choice is an ``AutoChoice`` (key path, value, why), printed at start and recorded under ``auto`` in the
run's ``config.json`` with the planned memory of every phase.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Any

from hybridrl.batch import ROLLOUT_LOG_PROBS
from hybridrl.config import RunConfig
from hybridrl.placement.host_memory import HOST_USABLE_SHARE, host_needs, host_problems
from hybridrl.placement.memory import (DEMAND_SIZED_ROLLOUTS, GIB, OFFLOAD_MODES, MemoryEstimate, ModelShape,
                                       TrainSettings, estimate_memory, step_workload, train_settings,
                                       uses_fused_head)
from hybridrl.placement.model_protocol import AutoChoice, Knobs
from hybridrl.placement.plan import PlacementPlan
from hybridrl.plugins.registry import Registry, RegistryError, load_object
from hybridrl.roles import role_spec

AUTO = "auto"
#: train backends whose memory the plan models (FSDP2's layout); the memory choices apply to them only.
MEMORY_MODELLED_BACKENDS = ("fsdp",)
#: share of the device the chosen settings may plan to use (the rest absorbs allocator fragmentation and
#: what the estimate misses).
USABLE_SHARE = 0.85
#: token budgets tried for one micro-batch: a trainable role's backward keeps activations, a forward does not.
TRAIN_TOKEN_BUDGETS = (65536, 49152, 32768, 24576, 16384, 12288, 8192, 6144, 4096, 3072, 2048, 1536, 1024)
FORWARD_TOKEN_BUDGETS = (65536, 49152, 32768, 24576, 16384, 12288, 8192, 4096, 2048, 1024)
#: the cost model (seconds per step; only the order of the candidates matters): host work per micro-batch,
#: sustained bf16 throughput for the forward that checkpointing recomputes, host<->device copy speed.
MICRO_BATCH_SECONDS = {"train": 0.02, "forward": 0.01}
SUSTAINED_FLOPS = 400e12
HOST_COPY_BYTES_PER_S = 25e9


@dataclass
class AutoResult:
    cfg: RunConfig
    choices: list[AutoChoice] = field(default_factory=list)
    estimate: MemoryEstimate | None = None
    problems: list[tuple[str, str]] = field(default_factory=list)

    def notes(self) -> list[str]:
        return [c.note() for c in self.choices]


# --- the rollout's log-probs -----------------------------------------------------------------------------

def rollout_log_prob_readers(cfg: RunConfig, registry: Registry) -> list[str]:
    """What reads the rollout's sampled-token log-probs in this run."""
    from hybridrl.algorithms.objective import resolve_algorithm

    readers = []
    if cfg.algorithm.tis_cap is not None:
        readers.append("truncated importance sampling (algorithm.tis_cap)")
    try:
        algo = resolve_algorithm(cfg.algorithm, registry)
    except RegistryError:
        return readers
    components = [("advantage", algo.advantage), ("policy_loss", algo.policy_loss), ("loss_aggregation", algo.loss_agg)]
    if cfg.algorithm.kl is not None and cfg.algorithm.kl.coef > 0:
        components.append(("kl_estimator", cfg.algorithm.kl.estimator))
    for category, name in components:
        try:
            component = registry.get(category, name)
        except RegistryError:
            continue
        if ROLLOUT_LOG_PROBS in tuple(getattr(component, "needs", ()) or ()):
            readers.append(f"the {category.replace('_', ' ')} '{name}'")
    return readers


def resolve_log_probs(cfg: RunConfig, registry: Registry) -> tuple[RunConfig, list[AutoChoice]]:
    rollout = cfg.roles.rollout
    if rollout.log_probs != AUTO:
        return cfg, []
    readers = rollout_log_prob_readers(cfg, registry)
    value = bool(readers)
    reason = ("read by " + ", ".join(readers)) if readers else \
        "nothing reads them: no truncated importance sampling, no component that needs them; true turns them on " \
        "(and the rollout/logp_diff diagnostic)"
    return _with_rollout(cfg, log_probs=value), [AutoChoice("roles.rollout.log_probs", value, reason)]


def _with_rollout(cfg: RunConfig, **update: Any) -> RunConfig:
    roles = cfg.roles.model_copy(update={"rollout": cfg.roles.rollout.model_copy(update=update)})
    return cfg.model_copy(update={"roles": roles})


def _with_role(cfg: RunConfig, role: str, update: dict[str, Any], options: dict[str, Any]) -> RunConfig:
    rcfg = getattr(cfg.roles, role)
    merged = {**(rcfg.options or {}), **options}
    rcfg = rcfg.model_copy(update={**update, "options": merged})
    return cfg.model_copy(update={"roles": cfg.roles.model_copy(update={role: rcfg})})


# --- fused layer kernels ----------------------------------------------------------------------------------

#: ``roles.<role>.options.fused_kernels`` of a train backend that declares ``fused_layer_kernels``.
FUSED_KERNELS = "fused_kernels"


def resolve_fused_kernels(cfg: RunConfig, plan: PlacementPlan, registry: Registry, backends: dict[str, str]
                          ) -> tuple[RunConfig, list[AutoChoice]]:
    """``options.fused_kernels: auto`` (or unset) of each modelled train role: on with CUDA where its backend
    declares the kernels (they keep less for backward, which the memory plan then counts), off otherwise."""
    choices: list[AutoChoice] = []
    for role in plan.role_pool:
        backend = backends.get(role)
        if role_spec(role).kind != "train" or backend not in MEMORY_MODELLED_BACKENDS:
            continue
        options = getattr(cfg.roles, role).options or {}
        if options.get(FUSED_KERNELS, AUTO) != AUTO:
            continue
        try:
            declared = registry.backend("train", backend).can("fused_layer_kernels")
        except RegistryError:
            declared = False
        if plan.cluster.device != "cuda":
            value, why = False, "CPU: the fused kernels are Triton kernels for CUDA"
        elif not declared:
            value, why = False, f"the {backend} backend has no fused layer kernels here (for FSDP: liger-kernel, " \
                                "pip install 'hybridrl-fsdp[kernels]')"
        else:
            value, why = True, "fused RMSNorm, SwiGLU and rotary kernels: fewer passes over the activations, " \
                               "less kept for backward"
        cfg = _with_role(cfg, role, {}, {FUSED_KERNELS: value})
        choices.append(AutoChoice(f"roles.{role}.options.{FUSED_KERNELS}", value, why))
    return cfg, choices


# --- a backend's own auto options ------------------------------------------------------------------------

def resolve_backend_options(cfg: RunConfig, plan: PlacementPlan, registry: Registry, backends: dict[str, str]
                            ) -> tuple[RunConfig, list[AutoChoice]]:
    """Each role's backend resolves its own ``auto`` options (``BackendEntry.resolve_options``) for the
    cluster's device; the values go into ``roles.<role>.options`` and are recorded like the core's choices."""
    choices: list[AutoChoice] = []
    for role in plan.role_pool:
        backend = backends.get(role)
        try:
            entry = registry.backend(role_spec(role).kind, backend) if backend else None
        except RegistryError:
            continue
        if entry is None or entry.resolve_options is None:
            continue
        try:
            resolve = load_object(entry.resolve_options)
        except (ImportError, AttributeError) as exc:
            raise RegistryError(f"roles.{role}.backend: backend '{entry.name}' (plugin {entry.plugin}) cannot load "
                                f"its auto options {entry.resolve_options}: {exc}") from exc
        for key, value, reason in resolve(role, dict(getattr(cfg.roles, role).options or {}), plan.cluster.device):
            cfg = _with_role(cfg, role, {}, {key: value})
            choices.append(AutoChoice(f"roles.{role}.options.{key}", value, reason))
    return cfg, choices


# --- memory choices ----------------------------------------------------------------------------------------

def option_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """Values of ``options.offload`` / ``options.gradient_checkpointing`` that are not allowed."""
    problems = []
    for role, rcfg in cfg.role_configs().items():
        if role_spec(role).kind != "train":
            continue
        options = rcfg.options or {}
        offload = options.get("offload")
        allowed = OFFLOAD_MODES if role_spec(role).trainable else ("none", "all")
        if offload is not None and offload != AUTO and offload not in allowed:
            problems.append((f"roles.{role}.options.offload", f"must be one of {(AUTO, *allowed)}, got {offload!r}"
                             + ("" if role_spec(role).trainable else f" ({role} has no optimizer)")))
        ckpt = options.get("gradient_checkpointing")
        if ckpt is not None and ckpt != AUTO and not isinstance(ckpt, bool):
            problems.append((f"roles.{role}.options.gradient_checkpointing",
                             f"must be true, false or auto, got {ckpt!r}"))
    return problems


def _knobs(cfg: RunConfig, role: str) -> Knobs:
    rcfg = getattr(cfg.roles, role)
    options = rcfg.options or {}
    actor = cfg.roles.actor
    actor_budget_auto = "micro_batch" not in actor.model_fields_set and actor.max_tokens_per_micro_batch is None
    if role == "actor":
        budget = actor_budget_auto
    elif role == "reward":  # its micro-batch is roles.reward.model.micro_batch, rows only
        budget = False
    else:
        budget = (getattr(rcfg, "micro_batch", None) is None
                  and getattr(rcfg, "max_tokens_per_micro_batch", None) is None and actor_budget_auto)
    trainable = role_spec(role).trainable
    return Knobs(budget=budget, checkpointing=trainable and options.get("gradient_checkpointing", AUTO) == AUTO,
                 offload=options.get("offload", AUTO) == AUTO, trainable=trainable,
                 head_logits=trainable and uses_fused_head(cfg, role) and options.get("head_logits", AUTO) == AUTO)


def _candidates(cfg: RunConfig, role: str, knobs: Knobs) -> list[TrainSettings]:
    base = train_settings(cfg, role)
    seq = cfg.data.max_prompt_len + cfg.roles.rollout.max_new_tokens
    share = cfg.roles.rollout.max_new_tokens / seq
    if knobs.budget:
        grid = TRAIN_TOKEN_BUDGETS if knobs.trainable else FORWARD_TOKEN_BUDGETS
        budgets = sorted({max(seq, b) for b in grid}, reverse=True)
        tokens = [(float(b), float(b) * share) for b in budgets]
    else:
        tokens = [(base.tokens, base.response_tokens)]
    checkpointing = [False, True] if knobs.checkpointing else [base.checkpointing]
    offloads = (list(OFFLOAD_MODES) if knobs.trainable else ["none", "all"]) if knobs.offload else [base.offload]
    return [TrainSettings(t, r, c, o, base.fused_layers, base.keep_logits)
            for (t, r), c, o in itertools.product(tokens, checkpointing, offloads)]


def _cost(cfg: RunConfig, shape: ModelShape, role: str, s: TrainSettings, dp: int) -> float:
    """Seconds a step spends on what these settings add (see the module docstring)."""
    rows = cfg.data.prompts_per_step * cfg.algorithm.n_samples
    seq = cfg.data.max_prompt_len + cfg.roles.rollout.max_new_tokens
    tokens_per_rank = rows * seq / dp
    trainable = role_spec(role).trainable
    cost = math.ceil(tokens_per_rank / max(s.tokens, 1.0)) * MICRO_BATCH_SECONDS["train" if trainable else "forward"]
    n = shape.param_count() / dp
    if s.checkpointing:
        cost += 2 * n * tokens_per_rank / SUSTAINED_FLOPS  # one more forward of every micro-batch
    weights = (4 if trainable else 2) * n
    moved = {"none": 0.0, "optimizer": 8 * n, "all": 8 * n + weights}[s.offload] if trainable else \
        {"none": 0.0, "all": weights}[s.offload]
    return cost + 2 * moved / HOST_COPY_BYTES_PER_S


def _with_host(cfg: RunConfig, plan: PlacementPlan, est: MemoryEstimate, host_bytes: float | None,
               backends: dict[str, str]) -> MemoryEstimate:
    """``est`` with what each node's host memory holds (on GPUs: where offloading sends state), and a warning
    where it does not fit (``hybridrl.placement.host_memory``)."""
    if plan.cluster.device == "cuda":
        est.host = host_needs(cfg, plan, est, host_bytes, backends.get("rollout"))
        est.warnings += host_problems(est.host)
    return est


def resolve_memory(cfg: RunConfig, plan: PlacementPlan, shape: ModelShape, device_bytes: float | None,
                   backends: dict[str, str], shapes: dict[str, ModelShape] | None = None,
                   source: str = "", host_bytes: float | None = None) -> AutoResult:
    """Resolve the memory ``auto`` settings of ``cfg`` (see the module docstring) and estimate the result;
    ``host_bytes``: a node's host memory, when known (settings whose offloaded state would not fit are skipped)."""
    result = AutoResult(cfg, problems=option_problems(cfg))
    if result.problems:
        return result
    modelled = [r for r in plan.role_pool
                if role_spec(r).kind == "train" and backends.get(r) in MEMORY_MODELLED_BACKENDS]
    knobs = {r: _knobs(cfg, r) for r in modelled}
    auto_roles = [r for r, k in knobs.items() if k.budget or k.checkpointing or k.offload or k.head_logits]
    if plan.cluster.device != "cuda" or device_bytes is None or not auto_roles:
        cfg = _resolve_off(cfg, knobs, result.choices, "CPU" if plan.cluster.device != "cuda" else
                           "no device memory known")
        result.cfg = cfg
        result.estimate = _with_host(cfg, plan, estimate_memory(cfg, plan, shape, device_bytes, source, shapes),
                                     host_bytes, backends)
        return result
    usable = USABLE_SHARE * device_bytes
    fixed = {r: train_settings(cfg, r) for r in modelled if r not in auto_roles}

    def cost_of(role: str, s: TrainSettings) -> float:
        return _cost(cfg, (shapes or {}).get(role, shape), role, s, plan.group_of(role).world_size)

    per_role = {r: sorted(_candidates(cfg, r, knobs[r]), key=lambda s, r=r: (cost_of(r, s), -s.tokens))
                for r in auto_roles}

    def evaluate(index: tuple[int, ...], check_host: bool = True
                 ) -> tuple[bool, float, dict[str, TrainSettings], MemoryEstimate]:
        return evaluate_settings({**fixed, **{r: per_role[r][i] for r, i in zip(auto_roles, index)}}, check_host)

    def evaluate_settings(settings: dict[str, TrainSettings], check_host: bool = True
                          ) -> tuple[bool, float, dict[str, TrainSettings], MemoryEstimate]:
        est = _with_host(cfg, plan, estimate_memory(cfg, plan, shape, device_bytes, source, shapes, settings),
                         host_bytes, backends)
        peak = max((p.peak for p in est.pools), default=0.0)
        host_fits = not check_host or all(need.fits is not False for need in est.host)
        return peak <= usable and host_fits and not _kv_floor_missed(est), peak, settings, est

    found = _cheapest_fitting(per_role, auto_roles, cost_of, evaluate)
    why, check_host = "the cheapest settings whose every phase fits", True
    if found is None and host_bytes is not None:  # the host is what no setting fits: fit the device, and warn
        found = _cheapest_fitting(per_role, auto_roles, cost_of, lambda index: evaluate(index, check_host=False))
        why, check_host = ("the cheapest settings whose every phase fits the device (the host memory does not fit: "
                           "see below)"), False
    if found is not None:
        chosen, est = found[2], found[3]
        for role in (r for r in auto_roles if knobs[r].head_logits):  # kept logits: where they fit beside these
            keeping = evaluate_settings({**chosen, role: replace(chosen[role], keep_logits=True)},
                                        check_host)
            if keeping[0]:
                chosen, est = keeping[2], keeping[3]
    else:  # nothing fits: the settings that need the least memory, and the plan's warning says so
        least = tuple(min(range(len(per_role[r])), key=lambda i, r=r: _own_memory(per_role[r][i])) for r in auto_roles)
        _, peak, chosen, est = evaluate(least)
        host = "" if host_bytes is None else \
            f" and {HOST_USABLE_SHARE:.0%} of the {host_bytes / GIB:.0f} GiB host memory of a node"
        why = (f"nothing fits {USABLE_SHARE:.0%} of the {device_bytes / GIB:.0f} GiB device{host}; these settings "
               f"need the least device memory ({peak / GIB:.1f} GiB at the peak)")
    for role in auto_roles:
        cfg = _apply(cfg, role, knobs[role], chosen[role], result.choices, why, est)
    result.cfg = cfg
    result.estimate = _with_host(cfg, plan, estimate_memory(cfg, plan, shape, device_bytes, source, shapes),
                                 host_bytes, backends)
    return result


def _kv_floor_missed(est: MemoryEstimate) -> bool:
    return any(w.startswith("roles.rollout: KV floor") for w in est.warnings)


def _own_memory(s: TrainSettings) -> tuple[int, int, float]:
    """Order a role's candidates by how little memory they take: offload, then checkpointing, then tokens."""
    return (-OFFLOAD_MODES.index(s.offload), -int(s.checkpointing), s.tokens)


#: candidate combinations evaluated at most before giving up on finding one that fits.
MAX_EVALUATIONS = 4000


def _cheapest_fitting(per_role: dict[str, list[TrainSettings]], roles: list[str], cost_of, evaluate):
    """Best-first over the product of each role's candidates (each list sorted by cost): the first combination
    that fits is the cheapest one that does."""
    import heapq

    def total(index: tuple[int, ...]) -> float:
        return sum(cost_of(r, per_role[r][i]) for r, i in zip(roles, index))

    start = tuple(0 for _ in roles)
    heap = [(total(start), start)]
    seen = {start}
    evaluations = 0
    while heap and evaluations < MAX_EVALUATIONS:
        _, index = heapq.heappop(heap)
        evaluations += 1
        outcome = evaluate(index)
        if outcome[0]:
            return outcome
        for k in range(len(roles)):
            if index[k] + 1 < len(per_role[roles[k]]):
                nxt = index[:k] + (index[k] + 1,) + index[k + 1:]
                if nxt not in seen:
                    seen.add(nxt)
                    heapq.heappush(heap, (total(nxt), nxt))
    return None


def _apply(cfg: RunConfig, role: str, knobs: Knobs, s: TrainSettings, choices: list[AutoChoice], why: str,
           est: MemoryEstimate) -> RunConfig:
    pool = next(p for p in est.pools if role in p.roles)
    where = f"{why}: peak {pool.peak / GIB:.1f} GiB in {pool.peak_phase}"
    update: dict[str, Any] = {}
    options: dict[str, Any] = {}
    if knobs.budget:
        budget = int(s.tokens)
        update["max_tokens_per_micro_batch"] = budget
        choices.append(AutoChoice(f"roles.{role}.max_tokens_per_micro_batch", budget, where))
    if knobs.checkpointing:
        options["gradient_checkpointing"] = s.checkpointing
        choices.append(AutoChoice(f"roles.{role}.options.gradient_checkpointing", s.checkpointing,
                                  "the activations do not fit without it" if s.checkpointing else
                                  "the activations fit without it"))
    if knobs.offload:
        options["offload"] = s.offload
        choices.append(AutoChoice(f"roles.{role}.options.offload", s.offload,
                                  "the resident state and the engine fit on the device" if s.offload == "none" else
                                  f"kept on the host outside its phases so that every phase fits ({where})"))
    if knobs.head_logits:
        options["head_logits"] = "keep" if s.keep_logits else "recompute"
        choices.append(AutoChoice(f"roles.{role}.options.head_logits", options["head_logits"],
                                  "the fused head keeps its logits for the backward: one GEMM less" if s.keep_logits
                                  else "the fused head's logits, kept for the backward, would not fit beside these "
                                  "settings: made again there"))
    return _with_role(cfg, role, update, options) if (update or options) else cfg


def _resolve_off(cfg: RunConfig, knobs: dict[str, Knobs], choices: list[AutoChoice], why: str) -> RunConfig:
    """Without a device to plan for: checkpointing off, nothing offloaded, the head's logits made again (the
    least memory), the backend's micro-batch."""
    for role, k in knobs.items():
        options: dict[str, Any] = {}
        if k.checkpointing:
            options["gradient_checkpointing"] = False
            choices.append(AutoChoice(f"roles.{role}.options.gradient_checkpointing", False, why))
        if k.offload:
            options["offload"] = "none"
            choices.append(AutoChoice(f"roles.{role}.options.offload", "none", why))
        if k.head_logits:
            options["head_logits"] = "recompute"
            choices.append(AutoChoice(f"roles.{role}.options.head_logits", "recompute", why))
        if options:
            cfg = _with_role(cfg, role, {}, options)
    return cfg


def with_workload(cfg: RunConfig, backends: dict[str, str]) -> RunConfig:
    """Tell a preallocating rollout what one step asks of it (``hybridrl.rollout.kv_budget``)."""
    backend = backends.get("rollout")
    options = cfg.roles.rollout.options or {}
    if backend is None or backend in DEMAND_SIZED_ROLLOUTS or options.get("workload"):
        return cfg
    return _with_rollout(cfg, options={**options, "workload": step_workload(cfg)})


def record(cfg: RunConfig, choices: list[AutoChoice], estimate: MemoryEstimate | None) -> RunConfig:
    """``cfg.auto``: each choice with its reason, and the planned memory of every phase of every pool."""
    auto: dict[str, Any] = {"choices": {c.key: {"value": c.value, "reason": c.reason} for c in choices}}
    if estimate is not None:
        auto["memory"] = memory_summary(estimate)
    return cfg.model_copy(update={"auto": auto})


def memory_summary(est: MemoryEstimate) -> dict[str, Any]:
    """The estimate in MiB, as ``config.json`` records it (the benchmark compares it with what was measured)."""
    mib = float(2**20)
    return {
        "device_mb": None if est.device_bytes is None else est.device_bytes / mib,
        "pools": {p.pool: {"peak_phase": p.peak_phase, "peak_mb": p.peak / mib,
                           "phases_mb": {k: v / mib for k, v in p.phases.items()}, "fits": p.fits} for p in est.pools},
        "roles": {m.role: {"weights_mb": m.weights / mib, "optimizer_mb": m.optimizer / mib,
                           "grads_mb": m.grads / mib, "activations_mb": m.activations / mib,
                           "kv_cache_mb": m.kv_cache / mib, "resident_mb": m.idle / mib,
                           "graphs_mb": m.graphs / mib, "offload": m.offload, "adapters_mb": m.adapters / mib}
                  for m in est.roles},
        "host": {n.pool: {"per_node_mb": n.total / mib, "parts_mb": {k: v / mib for k, v in n.parts.items()},
                          "host_mb": None if n.host_bytes is None else n.host_bytes / mib, "fits": n.fits}
                 for n in est.host},
        "warnings": list(est.warnings),
    }


# --- everything at once --------------------------------------------------------------------------------

def resolve_auto(cfg: RunConfig, plan: PlacementPlan, registry: Registry, backends: dict[str, str],
                 shape: ModelShape | None, device_bytes: float | None, source: str = "",
                 shapes: dict[str, ModelShape] | None = None, host_bytes: float | None = None) -> AutoResult:
    """Every ``auto`` of ``cfg``: the rollout's log-probs, its workload, the train roles' memory settings; the
    result's ``cfg`` records them under ``auto`` (``record``). ``shape`` None (no model config to read): the
    memory settings resolve as on a CPU (checkpointing off, nothing offloaded)."""
    cfg, choices = resolve_log_probs(cfg, registry)
    cfg, fused = resolve_fused_kernels(cfg, plan, registry, backends)
    cfg, own = resolve_backend_options(cfg, plan, registry, backends)
    choices += fused + own
    cfg = with_workload(cfg, backends)
    if shape is None:
        knobs = {r: _knobs(cfg, r) for r in plan.role_pool if role_spec(r).kind == "train"
                 and backends.get(r) in MEMORY_MODELLED_BACKENDS}
        result = AutoResult(cfg, problems=option_problems(cfg))
        if not result.problems:
            result.cfg = _resolve_off(cfg, knobs, result.choices, "no model config to plan from")
    else:
        result = resolve_memory(cfg, plan, shape, device_bytes, backends, shapes, source, host_bytes)
    result.choices = choices + result.choices
    result.cfg = record(result.cfg, result.choices, result.estimate)
    return result
