"""The ``auto`` settings, resolved before any process starts, so that the README's defaults are the fast path.

* ``roles.rollout.log_probs: auto``: on only when something reads the rollout's log-probs: truncated
  importance sampling (``algorithm.tis_cap``) or an algorithm component that declares it needs them
  (``needs = ("rollout_log_probs", ...)`` on a registered advantage, policy loss, loss aggregation or KL
  estimator). Off, vLLM skips a log-softmax over the vocabulary for every sampled token.
* For train roles whose backend registers a memory model (``hybridrl.engines.memory_model``), on GPUs,
  from the memory plan (``hybridrl.placement.memory``): the settings the model offers (``TrainMemoryModel.knobs``;
  FSDP's: the token budget of a micro-batch, ``options.gradient_checkpointing`` and ``options.offload``). Every
  combination of the candidates each model lists is costed by the model (micro-batches launched, the forward that
  checkpointing recomputes, the bytes that offloading moves over PCIe each step) and the cheapest one whose
  every phase fits the device is chosen. Then ``options.head_logits: auto``: the head keeps its logits for the
  backward (one GEMM less) where they fit beside those settings, and makes them again otherwise; they never cost
  a smaller micro-batch, and the search stays as large as it was. A backend without a model gets none of these.
* ``roles.rollout.options.workload``: the step's sequences and their length, from which a preallocating
  engine sizes its KV cache (``hybridrl.rollout.kv_budget``).

Each choice is an ``AutoChoice`` (key path, value, why), printed at start and recorded under ``auto`` in the
run's ``config.json`` with the planned memory of every phase.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from hybridrl.config import RunConfig
from hybridrl.engines.batch import ROLLOUT_LOG_PROBS
from hybridrl.engines.memory_model import AutoChoice, Knobs
from hybridrl.placement.host_memory import HOST_USABLE_SHARE, host_needs, host_problems
from hybridrl.placement.memory import (
    GIB,
    OFFLOAD_MODES,
    MemoryEstimate,
    ModelShape,
    TrainSettings,
    backend_hooks,
    estimate_memory,
    memory_models,
    role_context,
    step_workload,
)
from hybridrl.placement.plan import PlacementPlan
from hybridrl.plugins.registry import Registry, RegistryError, load_object
from hybridrl.roles import role_spec

AUTO = "auto"
#: share of the device the chosen settings may plan to use (the rest absorbs allocator fragmentation and
#: what the estimate misses).
USABLE_SHARE = 0.85

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


def resolve_fused_kernels(cfg: RunConfig, plan: PlacementPlan, registry: Registry, backends: dict[str, str],
                          models: dict[str, Any] | None = None) -> tuple[RunConfig, list[AutoChoice]]:
    """``options.fused_kernels: auto`` (or unset) of each train role whose memory model offers the kernels
    (``TrainMemoryModel.fused_kernels``): on with CUDA where its backend declares them (they keep less for
    backward, which the memory plan then counts), off otherwise."""
    models = memory_models(cfg, plan, registry) if models is None else models
    choices: list[AutoChoice] = []
    for role in plan.role_pool:
        backend = backends.get(role)
        model = models.get(role)
        hint = getattr(model, "fused_kernels", None)
        if role_spec(role).kind != "train" or hint is None:
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
            value, why = False, f"the {backend} backend has no fused layer kernels here ({hint})"
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

def option_problems(cfg: RunConfig, models: dict[str, Any]) -> list[tuple[str, str]]:
    """Values of the searched options that are not allowed, as each role's memory model checks them."""
    return [problem for role, model in models.items() if model is not None and role_spec(role).kind == "train"
            for problem in model.option_problems(cfg, role)]


def _train_models(plan: PlacementPlan, models: dict[str, Any]) -> dict[str, Any]:
    """The placed train roles that have a memory model, with it."""
    return {r: models[r] for r in plan.role_pool
            if role_spec(r).kind == "train" and models.get(r) is not None}


def _with_host(cfg: RunConfig, plan: PlacementPlan, est: MemoryEstimate, host_bytes: float | None) -> MemoryEstimate:
    """``est`` with what each node's host memory holds (on GPUs: where offloading sends state), and a warning
    where it does not fit (``hybridrl.placement.host_memory``)."""
    if plan.cluster.device == "cuda":
        est.host = host_needs(cfg, plan, est, host_bytes)
        est.warnings += host_problems(est.host)
    return est


def resolve_memory(cfg: RunConfig, plan: PlacementPlan, shape: ModelShape, device_bytes: float | None,
                   backends: dict[str, str], shapes: dict[str, ModelShape] | None = None,
                   source: str = "", host_bytes: float | None = None, models: dict[str, Any] | None = None,
                   registry: Registry | None = None) -> AutoResult:
    """Resolve the memory ``auto`` settings of ``cfg`` (see the module docstring) and estimate the result;
    ``host_bytes``: a node's host memory, when known (settings whose offloaded state would not fit are skipped).
    ``models``: each role's memory model (from ``registry`` when not given)."""
    models = memory_models(cfg, plan, registry) if models is None else models
    result = AutoResult(cfg, problems=option_problems(cfg, models))
    if result.problems:
        return result
    modelled = _train_models(plan, models)
    knobs = {r: m.knobs(cfg, r) for r, m in modelled.items()}
    auto_roles = [r for r, k in knobs.items() if k.any]

    def estimate(config: RunConfig, settings: dict[str, TrainSettings] | None = None) -> MemoryEstimate:
        return _with_host(config, plan, estimate_memory(config, plan, shape, device_bytes, source, shapes, settings,
                                                        models), host_bytes)

    if plan.cluster.device != "cuda" or device_bytes is None or not auto_roles:
        cfg = _resolve_off(cfg, modelled, knobs, result.choices, "CPU" if plan.cluster.device != "cuda" else
                           "no device memory known")
        result.cfg = cfg
        result.estimate = estimate(cfg)
        return result
    usable = USABLE_SHARE * device_bytes
    fixed = {r: m.settings(cfg, r) for r, m in modelled.items() if r not in auto_roles}
    contexts = {r: role_context(cfg, plan, r, (shapes or {}).get(r, shape), device_bytes) for r in auto_roles}

    def cost_of(role: str, s: TrainSettings) -> float:
        return modelled[role].cost(contexts[role], s)

    per_role = {r: sorted(modelled[r].candidates(cfg, r, knobs[r]), key=lambda s, r=r: (cost_of(r, s), -s.tokens))
                for r in auto_roles}

    def evaluate(index: tuple[int, ...], check_host: bool = True
                 ) -> tuple[bool, float, dict[str, TrainSettings], MemoryEstimate]:
        return evaluate_settings({**fixed, **{r: per_role[r][i] for r, i in zip(auto_roles, index)}}, check_host)

    def evaluate_settings(settings: dict[str, TrainSettings], check_host: bool = True
                          ) -> tuple[bool, float, dict[str, TrainSettings], MemoryEstimate]:
        est = estimate(cfg, settings)
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
        # a phase no setting brings under the share (a rollout's, beside offloaded trainers) needs the trainers to
        # give up nothing in the others: the cheapest settings whose every phase stays within the share or, where
        # even the least settings exceed it, within what they need there
        limits = {(p.pool, phase): max(usable, need) for p in est.pools for phase, need in p.phases.items()}
        at_least = _cheapest_fitting(per_role, auto_roles, cost_of,
                                     lambda index: _within(evaluate(index, check_host=False), limits))
        if at_least is not None:
            _, peak, chosen, est = at_least
        host = "" if host_bytes is None else \
            f" and {HOST_USABLE_SHARE:.0%} of the {host_bytes / GIB:.0f} GiB host memory of a node"
        why = (f"nothing fits {USABLE_SHARE:.0%} of the {device_bytes / GIB:.0f} GiB device{host}; these settings "
               f"need the least device memory ({peak / GIB:.1f} GiB at the peak)")
    for role in auto_roles:
        cfg = _apply(cfg, role, modelled[role], knobs[role], chosen[role], result.choices, why, est)
    result.cfg = cfg
    result.estimate = estimate(cfg)
    return result


def _within(outcome: tuple[bool, float, dict[str, TrainSettings], MemoryEstimate],
            limits: dict[tuple[str, str], float]) -> tuple[bool, float, dict[str, TrainSettings], MemoryEstimate]:
    """``outcome`` of an evaluation judged phase by phase against ``limits`` ((pool, phase) -> bytes) instead of
    the usable share."""
    _, peak, settings, est = outcome
    fits = all(need <= limits.get((p.pool, phase), 0.0) * (1 + 1e-9) for p in est.pools
               for phase, need in p.phases.items())
    return fits and not _kv_floor_missed(est), peak, settings, est


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


def _apply(cfg: RunConfig, role: str, model: Any, knobs: Knobs, s: TrainSettings, choices: list[AutoChoice],
           why: str, est: MemoryEstimate) -> RunConfig:
    pool = next(p for p in est.pools if role in p.roles)
    where = f"{why}: peak {pool.peak / GIB:.1f} GiB in {pool.peak_phase}"
    update, options, made = model.choices(cfg, role, knobs, s, where)
    choices += made
    return _with_role(cfg, role, update, options) if (update or options) else cfg


def _resolve_off(cfg: RunConfig, models: dict[str, Any], knobs: dict[str, Knobs], choices: list[AutoChoice],
                 why: str) -> RunConfig:
    """Without a device to plan for: each model's least-memory values (``choices`` with no settings)."""
    for role, k in knobs.items():
        update, options, made = models[role].choices(cfg, role, k, None, why)
        choices += made
        if update or options:
            cfg = _with_role(cfg, role, update, options)
    return cfg


def with_workload(cfg: RunConfig, models: dict[str, Any]) -> RunConfig:
    """Tell a preallocating rollout what one step asks of it (``hybridrl.rollout.kv_budget``)."""
    model = models.get("rollout")
    options = cfg.roles.rollout.options or {}
    if model is None or model.demand_sized or options.get("workload"):
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
        "not_estimated": [f"{role}[{backend}]" for role, _, backend in est.unestimated],
    }


# --- everything at once --------------------------------------------------------------------------------

def resolve_auto(cfg: RunConfig, plan: PlacementPlan, registry: Registry, backends: dict[str, str],
                 shape: ModelShape | None, device_bytes: float | None, source: str = "",
                 shapes: dict[str, ModelShape] | None = None, host_bytes: float | None = None) -> AutoResult:
    """Every ``auto`` of ``cfg``: the rollout's log-probs, its workload, the train roles' memory settings; the
    result's ``cfg`` records them under ``auto`` (``record``). ``shape`` None (no model config to read): the
    memory settings resolve as on a CPU (checkpointing off, nothing offloaded)."""
    models = memory_models(cfg, plan, registry)
    cfg, choices = resolve_log_probs(cfg, registry)
    cfg, fused = resolve_fused_kernels(cfg, plan, registry, backends, models)
    cfg, own = resolve_backend_options(cfg, plan, registry, backends)
    choices += fused + own
    cfg = with_workload(cfg, models)
    if shape is None:
        modelled = _train_models(plan, models)
        knobs = {r: m.knobs(cfg, r) for r, m in modelled.items()}
        result = AutoResult(cfg, problems=option_problems(cfg, models))
        if not result.problems:
            result.cfg = _resolve_off(cfg, modelled, knobs, result.choices, "no model config to plan from")
    else:
        result = resolve_memory(cfg, plan, shape, device_bytes, backends, shapes, source, host_bytes, models)
    result.choices = choices + result.choices
    result.cfg = record(result.cfg, result.choices, result.estimate)
    if result.estimate is not None:  # an out-of-memory answer asks each backend for its keys
        result.estimate.oom_fixes = backend_hooks(cfg, plan, registry, "oom_fixes")
    return result
