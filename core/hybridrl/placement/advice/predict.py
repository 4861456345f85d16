"""A candidate map's predicted step: each phase's seconds from the cost model (``profile``), combined as the
trainer runs them.

* colocated: the phases take turns on every device: ``wake + gen + sleep + ref + old_log_prob + update + reshard``
  (``old_log_prob`` only where the trainer runs it: more than one optimizer step a batch, or KL in the reward).
* split (sync): the train pool waits for the whole batch and the rollout for the new weights, so the step is
  still the sum (without wake and sleep); the split's gain is more devices per phase and no time-sharing of memory.
* pipelined (staleness 1): the rollout generates step k+1 while step k trains: ``max(gen, train) + reshard``.
* fractional (the rollout's pool on the trainers' devices, pipelined): both run at once on one GPU, which without
  MPS time-slices between the processes, so the two sides barely overlap: ``(gen + train) x TIME_SLICED``, the
  ratio measured against the synchronous step (``benchmarks/results/long_tail_0.5b_fractional_80gib.json``).

With a critic its ``values`` and ``update_critic`` join the train phases, on the critic's pool: time-shared with
the actor's phases when it shares their pool, and still in turn with them on a pool of its own (the trainer waits
for each call; a critic pool buys memory, not overlap). Plus the driver's fixed work every step. A pool's busy
fraction is its phases' seconds over the step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from hybridrl.algorithms.objective import kl_in_reward, old_log_probs_needed
from hybridrl.config import RunConfig
from hybridrl.placement.advice.candidates import Candidate
from hybridrl.placement.advice.profile import DEFAULT_CONCURRENCY, CostProfile

#: a fractional step over the synchronous one's gen + train seconds, both measured on one GPU (see the docstring)
TIME_SLICED = 1.14
#: the phases on the train side of a step (after the batch is generated, before the reshard)
TRAIN_PHASES = ("ref", "old_log_prob", "values", "update_critic", "update_actor")


@dataclass
class Prediction:
    step: float  # seconds
    samples_per_s: float
    phases: dict[str, float]  # phase -> seconds
    busy: dict[str, float]  # pool -> share of the step
    bound: str  # the phase group that sets the step: "gen", "train" or "serial"
    notes: list[str] = field(default_factory=list)

    @property
    def critic(self) -> float | None:
        """Seconds of the critic's phases (``values`` + ``update_critic``), None without a critic."""
        if "values" not in self.phases and "update_critic" not in self.phases:
            return None
        return self.phases.get("values", 0.0) + self.phases.get("update_critic", 0.0)


def _link(plan: Any, reshard: Any) -> tuple[str, str]:
    """(link of the gather inside the trainer, link the sync crosses) by the plan's device kind and nodes."""
    cuda = plan.cluster.device == "cuda"
    intra = "nvlink" if cuda else "tcp"
    if reshard is None or reshard.transport == "in_process":
        return intra, "self"
    return intra, ("net" if reshard.remote_nodes else intra)


def reshard_seconds(profile: CostProfile, plan: Any, reshard: Any) -> float:
    """One step's weight sync: its set-up plus the gather and the copy over their links (``reshard`` is
    ``hybridrl.placement.reshard.ReshardEstimate``, None: no bytes known)."""
    if reshard is None:
        return profile.reshard_fixed
    intra, across = _link(plan, reshard)
    bw = profile.bandwidth
    gather_remote = reshard.gather_remote_bytes / bw["net"]
    seconds = (reshard.gather_bytes - reshard.gather_remote_bytes) / bw[intra] + gather_remote + \
        reshard.weight_bytes / bw[across]
    return (profile.reshard_fixed + seconds) * reshard.syncs_per_step


def predict(candidate: Candidate, cfg: RunConfig, plan: Any, profile: CostProfile, reshard: Any = None
            ) -> Prediction:
    """The step of ``cfg`` (the candidate's config) placed by ``plan`` (its ``PlacementPlan``)."""
    sequences = cfg.data.prompts_per_step * cfg.algorithm.n_samples
    length = profile.response_length if profile.response_length is not None else cfg.roles.rollout.max_new_tokens
    prompt = profile.prompt_length if profile.prompt_length is not None else cfg.data.max_prompt_len / 2
    tokens = sequences * (prompt + length)
    epochs = cfg.algorithm.epochs
    gen_devices = len(plan.pools[plan.role_pool["rollout"]])
    actor_devices = len(plan.pools[plan.role_pool["actor"]])
    tp = max(1, cfg.roles.rollout.tensor_parallel)
    replicas = max(1, gen_devices // tp)
    concurrency = int((cfg.roles.rollout.options or {}).get("max_num_seqs") or DEFAULT_CONCURRENCY)
    phases = {"gen": profile.gen_seconds(math.ceil(sequences / replicas), length, concurrency, tp)}
    if "ref" in plan.role_pool and cfg.algorithm.kl is not None and cfg.algorithm.kl.coef > 0:
        phases["ref"] = tokens / (profile.ref_tps * len(plan.pools[plan.role_pool["ref"]]))
    if old_log_probs_needed(cfg, kl_in_reward(cfg)):  # else the update's own log-probs serve (one optimizer step)
        phases["old_log_prob"] = tokens / (profile.old_log_prob_tps * actor_devices)
    phases["update_actor"] = tokens * epochs / (profile.train_tps * actor_devices)
    if "critic" in plan.role_pool:
        critic_devices = len(plan.pools[plan.role_pool["critic"]])
        phases["values"] = tokens / (profile.values_tps * critic_devices)
        phases["update_critic"] = tokens * epochs / (profile.critic_train_tps * critic_devices)
    shared = plan.colocated("rollout", "actor") or any(plan.colocated("rollout", r) for r in plan.role_pool
                                                       if r != "rollout")
    if shared:
        phases["wake"], phases["sleep"] = profile.wake, profile.sleep
    phases["reshard"] = reshard_seconds(profile, plan, reshard)
    phases["fixed"] = profile.fixed
    gen = phases["gen"] + phases.get("wake", 0.0) + phases.get("sleep", 0.0)
    train = sum(phases.get(p, 0.0) for p in TRAIN_PHASES)
    if candidate.kind == "pipelined":
        step = max(gen, train) + phases["reshard"] + profile.fixed
        bound = "gen" if gen >= train else "train"
    elif candidate.kind == "fractional":
        step = (gen + train) * TIME_SLICED + phases["reshard"] + profile.fixed
        bound = "time-sliced"
    else:
        step = gen + train + phases["reshard"] + profile.fixed
        bound = "serial" if candidate.kind == "colocated" else ("gen" if gen >= train else "train")
    work: dict[str, float] = {}
    for phase, roles in (("gen", ("rollout",)), ("wake", ("rollout",)), ("sleep", ("rollout",)), ("ref", ("ref",)),
                         ("old_log_prob", ("actor",)), ("update_actor", ("actor",)), ("values", ("critic",)),
                         ("update_critic", ("critic",)),
                         ("reshard", ("actor", "rollout"))):
        if phase in phases:
            for pool in {plan.role_pool[r] for r in roles if r in plan.role_pool}:
                work[pool] = work.get(pool, 0.0) + phases[phase]
    busy = {pool: min(1.0, work.get(pool, 0.0) / step) for pool in plan.pools}
    return Prediction(step, sequences / step, phases, busy, bound)
