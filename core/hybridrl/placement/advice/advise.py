"""Rank the candidate maps of a config on a cluster: each candidate's config is planned and its memory
estimated exactly as ``hybridrl plan`` does (``plan_candidate``); those the memory models refuse, or cannot
estimate, are dropped with the reason; the others get a predicted step (``predict``) and are ranked by
samples/s. ``render`` prints the table, ``write_config`` the winner as the user's YAML plus its overrides."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridrl.algorithms.objective import kl_in_reward, old_log_probs_needed
from hybridrl.config import ConfigError, RunConfig, load_config
from hybridrl.placement.advice.candidates import Candidate, candidate_maps
from hybridrl.placement.advice.predict import Prediction, predict
from hybridrl.placement.advice.profile import PROFILE_THIS, CostProfile, ProfileError, uncovered_roles
from hybridrl.placement.memory import GIB
from hybridrl.placement.plan import ClusterSpec

#: a busy fraction below this makes a pool "idle" in the table's reasons
IDLE = 0.5


@dataclass
class Planned:
    """A candidate's config, plan and memory estimate, or why it was dropped."""

    cfg: RunConfig | None = None
    plan: Any = None  # PlacementPlan
    peak_gib: dict[str, float] = field(default_factory=dict)  # pool -> peak per device
    reshard: Any = None  # ReshardEstimate
    dropped: str | None = None
    shape: Any = None  # the model's ModelShape: the collectives of multi-rank train pools
    log_prob_cost: float = 1.0  # the rollout backend's ``BackendSpec.log_prob_cost`` (1: none declared)


@dataclass
class Ranked:
    candidate: Candidate
    planned: Planned
    prediction: Prediction | None = None
    why: str = ""


#: plans one candidate's config: (config, its candidate) -> Planned
Planner = Callable[[RunConfig, Candidate], Planned]


def plan_candidate(cluster: ClusterSpec, registry: Any, device_bytes: float | None, shape: Any,
                   shapes: dict[str, Any] | None = None, host_bytes: float | None = None) -> Planner:
    """The planner ``hybridrl plan`` amounts to: placement (``check_config``), the auto settings and the memory
    estimate (``resolve_auto``) and the reshard volume, for the declared cluster and model shape."""

    def planner(cfg: RunConfig, candidate: Candidate) -> Planned:
        from hybridrl.placement.auto import resolve_auto
        from hybridrl.placement.reshard import estimate_reshard
        from hybridrl.run.preflight import check_config

        try:
            backends, plan, problems = check_config(cfg, registry, cluster, check_engines=False)
        except ConfigError as exc:
            return Planned(dropped=f"config: {exc}")
        if problems or plan is None:
            key, why = problems[0] if problems else ("", "no plan")
            return Planned(dropped=f"config: {key}: {why}")
        names = {role: entry.name for role, entry in backends.items()}
        log_prob_cost = getattr(backends.get("rollout"), "log_prob_cost", None) or 1.0
        auto = resolve_auto(cfg, plan, registry, names, shape, device_bytes, "", shapes, host_bytes)
        if auto.problems:
            key, why = auto.problems[0]
            return Planned(dropped=f"config: {key}: {why}")
        est = auto.estimate
        if est is None:
            return Planned(auto.cfg, plan, dropped="memory: not estimated (no model shape)")
        if est.unestimated:
            role, _, backend = est.unestimated[0]
            return Planned(auto.cfg, plan, dropped=f"memory: not estimated: backend '{backend}' of role {role} "
                                                   "registers no memory model")
        peaks = {p.pool: p.peak / GIB for p in est.pools}
        over = [p for p in est.pools if device_bytes is not None and p.peak > device_bytes]
        if over and device_bytes is not None:
            p = over[0]
            return Planned(auto.cfg, plan, peaks, dropped=f"memory: pool {p.pool} needs {p.peak / GIB:.1f} GiB in "
                                                          f"{p.peak_phase} > {device_bytes / GIB:.0f} GiB")
        if any(w.startswith("roles.rollout") for w in est.warnings):
            return Planned(auto.cfg, plan, peaks, dropped="memory: " + next(
                w for w in est.warnings if w.startswith("roles.rollout")))
        return Planned(auto.cfg, plan, peaks, estimate_reshard(auto.cfg, plan, shape), shape=shape,
                       log_prob_cost=log_prob_cost)

    return planner


def advise(config: str | Path, overrides: Sequence[str], cluster: ClusterSpec, profile: CostProfile,
           planner: Planner, rollout_tp: bool = True, registry: Any = None) -> list[Ranked]:
    """Every candidate map of the config at ``config`` (with the user's ``overrides``) on ``cluster``, the kept
    ones ranked by predicted samples/s (best first), then the dropped ones with their reason. ``rollout_tp``:
    whether the rollout backend splits an engine over ranks (capability ``tensor_parallel``). With ``registry``
    the maps place the roles the algorithm adds (a PPO config's critic, unwritten in its YAML), and each
    candidate is planned as its run would resolve it (``run.preflight.resolve_roles``: a map in flight
    oversamples, so its KV cache holds more sequences; an asynchronous one corrects with importance sampling,
    so its rollout returns log-probs). A measured profile without a rate for a phase the config runs (its run
    had no critic, say) is a ``ProfileError``: that phase would be predicted free."""
    def resolved(cfg: RunConfig) -> RunConfig:
        if registry is None:
            return cfg
        from hybridrl.run.preflight import with_algorithm_roles

        return with_algorithm_roles(cfg, registry)[0]

    base = resolved(load_config(config, list(overrides)))
    roles = base.role_configs()
    kl = base.algorithm.kl is not None and base.algorithm.kl.coef > 0
    uncovered = uncovered_roles(profile, "ref" in roles and kl, "critic" in roles, "reward" in roles,
                                old_log_probs_needed(base, kl_in_reward(base)))
    if uncovered:
        raise ProfileError(f"{profile.source} has no rates for {' or '.join(uncovered)}, which this config runs "
                           f"(its run had none, so they would be predicted free); {PROFILE_THIS}")
    kept: list[Ranked] = []
    dropped: list[Ranked] = []
    for candidate in candidate_maps(base, cluster.nodes, cluster.devices_per_node, rollout_tp):
        try:
            cfg = resolved(load_config(config, [*overrides, *candidate.overrides]))
        except ConfigError as exc:
            dropped.append(Ranked(candidate, Planned(dropped=f"config: {exc}"), why=f"config: {exc}"))
            continue
        planned = planner(cfg, candidate)
        if planned.dropped is not None or planned.cfg is None:
            dropped.append(Ranked(candidate, planned, why=planned.dropped or "not planned"))
            continue
        kept.append(Ranked(candidate, planned, predict(candidate, planned.cfg, planned.plan, profile,
                                                       planned.reshard, planned.shape, planned.log_prob_cost)))
    kept.sort(key=rank_key)
    for r in kept[1:]:
        r.why = why_it_loses(r, kept[0])
    return kept + dropped


#: the order of the kinds of map among those equally fast: on-policy before pipelined, fewer pools first
KIND_ORDER = {"colocated": 0, "in_flight": 1, "split": 2, "pipelined": 3, "fractional": 4}
#: maps within this share of the best's samples/s tie with it
TIE = 0.01


def rank_key(r: Ranked) -> tuple[float, int, int, int]:
    """Faster first; among maps equally fast (to 6 digits) the on-policy, fewer-pool, lower-tp one."""
    speed = r.prediction.samples_per_s if r.prediction else 0.0
    return (-round(speed, 6), KIND_ORDER.get(r.candidate.kind, len(KIND_ORDER)), len(r.candidate.pools),
            r.candidate.tp)


def model_error(r: Ranked, best: Ranked) -> float | None:
    """The error band of the fitted one-GPU model (``Prediction.error_band``: fractional on GPUs, in flight) that
    predicted ``r`` or ``best``, where ``r`` is predicted within it of ``best``: there the ranking between them is
    not known, only measured; None elsewhere."""
    if r.prediction is None or best.prediction is None or r is best:
        return None
    bands = [p.error_band for p in (r.prediction, best.prediction) if p.error_band is not None]
    if not bands or r.prediction.step > best.prediction.step * (1 + max(bands)):
        return None
    return max(bands)


def _measure_both(band: float) -> str:
    return f"within the one-GPU model's measured error (±{band:.0%}) of the best"


def why_it_loses(r: Ranked, best: Ranked) -> str:
    """The reasons a kept map is slower than the best, in the table's words."""
    p = r.prediction
    assert p is not None
    reasons = []
    if best.prediction and p.samples_per_s >= (1 - TIE) * best.prediction.samples_per_s:
        reasons.append("ties the best (a simpler map ranks first)")
    band = model_error(r, best)
    if band is not None:
        reasons.append(f"{_measure_both(band)}: measure both")
    if p.bound == "time-sliced":
        reasons.append("rollout and trainers time-slice their devices")
    elif p.bound == "shared cores":
        reasons.append("rollout and trainers share their cores: nothing overlaps")
    elif r.candidate.kind not in ("colocated", "in_flight"):
        if p.bound == "gen":
            reasons.append("gen-bound")
        elif p.bound == "train":
            reasons.append("train-bound")
    else:
        reasons.append("phases take turns")
    if best.prediction and p.bound != "train" and p.log_prob_factor > best.prediction.log_prob_factor:
        reasons.append(f"its rollout returns log-probs (importance sampling): gen x{p.log_prob_factor:.2f}")
    if r.candidate.kind == "in_flight":
        reasons.append("rounds in flight cut no tail in the cost model")
    for pool, share in p.busy.items():
        if share < IDLE:
            reasons.append(f"idle {pool} pool")
    if p.phases.get("reshard", 0.0) > 0.2 * p.step:
        reasons.append("reshard")
    best_gen = best.prediction.phases["gen"] / best.prediction.log_prob_factor if best.prediction else 0.0
    if r.candidate.tp != best.candidate.tp and p.bound != "train" and \
            p.phases["gen"] / p.log_prob_factor > 1.1 * best_gen:  # the log-probs' cost has its own reason
        reasons.append(f"tp{r.candidate.tp} generates slower")
    best_critic = best.prediction.critic if best.prediction else None
    if p.critic is not None and best_critic is not None and p.critic > 1.1 * best_critic and p.bound != "gen":
        reasons.append("critic on fewer devices")
    best_reward = best.prediction.phases.get("reward") if best.prediction else None
    if best_reward and p.phases.get("reward", 0.0) > 1.1 * best_reward and p.bound != "gen":
        reasons.append("reward model on fewer devices")
    return ", ".join(dict.fromkeys(reasons)) or "slower"


#: a profile's model this far from the planned one in size (either way) gets a note: its rates are another model's
SIZE_MISMATCH = 1.1


def profile_notes(ranked: list[Ranked], profile: CostProfile, cluster: ClusterSpec) -> list[str]:
    """What makes a measured profile's rates another setting's than the maps': a different device kind, backend or
    model size (the rates are used as they are), more CPU slots a node than the profile's cores."""
    notes = []
    if profile.device is not None and profile.device != cluster.device:
        notes.append(f"the profile ran on {profile.device}, these maps are for {cluster.device}: its rates are "
                     f"another device's; profile on the devices you plan for")
    cfg = next((r.planned.cfg for r in ranked if r.planned.cfg is not None), None)
    for role, backend in profile.backends.items():
        planned = getattr(cfg.roles, role).backend if cfg is not None else None
        if planned is not None and planned != backend:
            notes.append(f"the profile's {role} ran on '{backend}', this config's on '{planned}': its rates are "
                         "another backend's")
    shape = next((r.planned.shape for r in ranked if r.planned.shape is not None), None)
    if profile.active_params and shape is not None:
        ratio = shape.active_param_count() / profile.active_params
        if not 1 / SIZE_MISMATCH <= ratio <= SIZE_MISMATCH:
            notes.append(f"the profile's model has {profile.active_params / 1e9:.3g}B active parameters, this "
                         f"config's {shape.active_param_count() / 1e9:.3g}B: its rates are used as they are; "
                         "profile the model you plan for")
    if cluster.device == "cpu" and profile.node_cores and cluster.devices_per_node > profile.node_cores:
        notes.append(f"{cluster.devices_per_node} CPU slots a node, and the profile's node has {profile.node_cores} "
                     "cores: ranks beyond the cores take turns on them, which the cost model does not count, so "
                     "maps of more ranks than cores are predicted too fast (docs/advisor.md)")
    return notes


def render(ranked: list[Ranked], profile: CostProfile, cluster: ClusterSpec) -> str:
    """The ranked table ``hybridrl plan --advise`` prints."""
    critic = any(r.prediction is not None and r.prediction.critic is not None for r in ranked)
    header = ("#", "map", "step s", "samples/s", *(("critic s",) if critic else ()), "busy per pool", "peak GiB",
              "why it loses")
    rows: list[tuple[str, ...]] = [header]
    for i, r in enumerate(ranked, 1):
        p = r.prediction
        peak = ", ".join(f"{pool} {gib:.1f}" for pool, gib in r.planned.peak_gib.items()) or "-"
        if p is None:
            rows.append(("-", r.candidate.name, "-", "-", *(("-",) if critic else ()), "-", peak, r.why))
            continue
        busy = ", ".join(f"{pool} {share:.0%}" for pool, share in p.busy.items())
        critic_cell = (f"{p.critic:.2f}" if p.critic is not None else "-",) if critic else ()
        rows.append((str(i), r.candidate.name, f"{p.step:.2f}", f"{p.samples_per_s:.1f}", *critic_cell, busy, peak,
                     "best" if i == 1 else r.why))
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    lines = [f"device-map advice for {cluster.describe()}; costs: {profile.source}" +
             ("" if profile.profiled else " (unprofiled: a default throughput profile; give --profile RUN for "
                                          "measured rates)")]
    for n, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    best = next((r for r in ranked if r.prediction is not None), None)
    lines += [f"note: {note}" for note in profile_notes(ranked, profile, cluster)]
    if best is None:
        lines.append("no candidate map fits: see the reasons above")
    else:
        lines.append(f"best: {best.candidate.name}: {' '.join(best.candidate.overrides)}")
        close = {r.candidate.name: band for r in ranked[1:] if (band := model_error(r, best)) is not None}
        if close:
            lines.append(f"note: {', '.join(close)} {_measure_both(max(close.values()))}; which is faster depends "
                         f"on the host and the shape: measure both (benchmarks/advice_validation.py --maps)")
        if best.candidate.kind in ("pipelined", "fractional"):
            lines.append("note: pipelined trains on batches at most 1 update stale (trainer.max_staleness=1)")
        elif best.candidate.kind == "in_flight":
            lines.append("note: groups in flight train samples partly generated by the previous weights "
                         "(trainer.max_staleness bounds it)")
    return "\n".join(lines)


def ranked_json(ranked: list[Ranked], profile: CostProfile, cluster: ClusterSpec) -> dict[str, Any]:
    """The ranked table as data (``plan --advise --json``): every map, kept ones with their prediction, dropped ones
    with the reason; predictions, not measurements."""
    rows = []
    for i, r in enumerate(ranked, 1):
        p = r.prediction
        row: dict[str, Any] = {"map": r.candidate.name, "kind": r.candidate.kind,
                               "overrides": list(r.candidate.overrides),
                               "peak_gib": {k: round(v, 2) for k, v in r.planned.peak_gib.items()}}
        if p is None:
            row.update(rank=None, dropped=r.why)
        else:
            row.update(rank=i, predicted_step_s=round(p.step, 3), samples_per_s=round(p.samples_per_s, 3),
                       bound=p.bound, busy={k: round(v, 3) for k, v in p.busy.items()},
                       phases_s={k: round(v, 3) for k, v in p.phases.items()},
                       why_it_loses="best" if i == 1 else r.why)
        rows.append(row)
    return {"cluster": cluster.describe(), "costs": profile.source, "profiled": profile.profiled,
            "notes": profile_notes(ranked, profile, cluster), "rows": rows}


def write_config(config: str | Path, overrides: Sequence[str], candidate: Candidate, out: str | Path) -> Path:
    """The user's YAML (their keys, in their order) with their overrides and the candidate's applied; pools the
    map does not use are removed."""
    import yaml

    from hybridrl.config.loading import apply_overrides, load_yaml

    data = load_yaml(Path(config).read_text()) or {}
    data = apply_overrides(dict(data), [*overrides, *candidate.overrides])
    data["pools"] = {k: v for k, v in (data.get("pools") or {}).items() if v is not None}
    path = Path(out)
    head = f"# {Path(config).name} with the device map '{candidate.name}' (hybridrl plan --advise):\n" + \
        "".join(f"#   {o}\n" for o in candidate.overrides if not o.endswith("=null"))
    path.write_text(head + yaml.safe_dump(data, sort_keys=False))
    return path
