"""A candidate map's predicted step: each phase's seconds from the cost model (``profile``), combined as the
trainer runs them.

* colocated: the phases take turns on every device: ``wake + gen + sleep + ref + old_log_prob + update + reshard``
  (``old_log_prob`` only where the trainer runs it: more than one optimizer step a batch, or KL in the reward).
* in flight (colocated, ``trainer.mode=async``): the same turns, the generation ``IN_FLIGHT_GEN`` times as long
  besides the log-probs' cost (below). The cost model's decode rounds count the mean response length, not the
  longest (a tail that costs the synchronous step rounds is not in the model); the factor is fitted from steps
  measured on single GPUs: what the rounds in flight cost besides their log-probs.
* split (sync): the train pool waits for the whole batch and the rollout for the new weights, so the step is
  still the sum (without wake and sleep); the split's gain is more devices per phase and no time-sharing of memory.
* pipelined (staleness 1): the rollout generates step k+1 while step k trains: ``max(gen, train) + reshard``.
* fractional (the rollout's pool on the trainers' devices, pipelined): both run at once on one GPU, which without
  MPS time-slices between the processes: the trainer slows while the engine decodes beside it, and only part of
  the generation stays in the step: ``max(gen, train, TIME_SLICED_GEN x gen + TIME_SLICED_TRAIN x train)``, the
  generation not charged the log-probs' cost below (measured, it hides beside the trainer). On
  CPU slots the node's cores, which either pool's phases keep busy alone (each slot gets ``cores // slots``
  threads), do both pools' work: nothing overlaps, ``gen + train``.

A map whose run asks the rollout for its sampled tokens' log-probs (the candidate's resolved
``roles.rollout.log_probs``: on with importance sampling, which every asynchronous map turns on) when the profile's
run did not has its generation ``log_prob_cost`` times as long (the backend's ``BackendSpec.log_prob_cost``,
measured by ``benchmarks/gen_profile.py``: the engine's bookkeeping of them each step), and the other way round
divided by it. The fractional map on GPUs is the exception (above).

Both one-GPU models are fitted from measured steps by ``benchmarks/fit_one_gpu_maps.py`` (benchmarks/README.md,
"the one-GPU maps against measured steps"); ``TIME_SLICED_ERROR`` and ``IN_FLIGHT_ERROR`` are the largest error
of a measured step predicted by the factors fitted without it: the band in which the advisor says "measure both".

A train phase is its tokens over the profiled rate x the pool's data-parallel devices (CPU slots capped by their
node's cores), plus, on an FSDP pool of several ranks, its collectives over the pool's link (``fsdp_seconds``: the
alpha-beta model of ``profile.LINK_LATENCY`` and ``LINK_BANDWIDTH``); a sharded trainer's reshard adds one gather
per parameter tensor. With a critic its ``values`` and ``update_critic`` join the train phases, on the critic's
pool: time-shared with the actor's phases when it shares their pool, and still in turn with them on a pool of its
own (the trainer waits for each call; a critic pool buys memory, not overlap). A reward model's ``reward`` is a
train-side phase on its pool the same way (the trainer scores the batch before the reference pass). Plus the
driver's fixed work every step. A pool's busy fraction is its phases' seconds over the step.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from hybridrl.algorithms.objective import kl_in_reward, old_log_probs_needed
from hybridrl.config import RunConfig
from hybridrl.placement.advice.candidates import Candidate
from hybridrl.placement.advice.profile import DEFAULT_CONCURRENCY, CostProfile
from hybridrl.placement.memory import DTYPE_BYTES

#: a fractional step: max(gen, train, TIME_SLICED_GEN x gen + TIME_SLICED_TRAIN x train) (see the docstring)
TIME_SLICED_GEN = 0.27
TIME_SLICED_TRAIN = 1.94
#: how far a measured fractional step fell from the factors' prediction, out of sample (see the docstring)
TIME_SLICED_ERROR = 0.30
#: an in-flight step's generation over the synchronous one's, its log-probs' cost aside (see the docstring)
IN_FLIGHT_GEN = 0.96
#: how far a measured in-flight step fell from that factor's prediction, out of sample
IN_FLIGHT_ERROR = 0.20
#: the phases on the train side of a step (after the batch is generated, before the reshard)
TRAIN_PHASES = ("reward", "ref", "old_log_prob", "values", "update_critic", "update_actor")
#: the train backend whose collectives ``fsdp_collectives`` counts (``hybridrl_fsdp``)
FSDP = "fsdp"
#: the scalar all-reduces of an FSDP engine call besides its gathers (``hybridrl_fsdp.engine``): a forward's check
#: that the ranks agree on their micro-batches; each optimizer step's loss scale, gradient norm and loss
FORWARD_ALL_REDUCES = 1
UPDATE_ALL_REDUCES = 3
#: bytes of a gradient element in the reduce-scatter (FSDP reduces in fp32 on GPUs and CPU slots alike)
GRAD_BYTES = 4


@dataclass
class Prediction:
    step: float  # seconds
    samples_per_s: float
    phases: dict[str, float]  # phase -> seconds
    busy: dict[str, float]  # pool -> share of the step
    bound: str  # the phase group that sets the step: "gen", "train" or "serial"
    notes: list[str] = field(default_factory=list)
    log_prob_factor: float = 1.0  # what the rollout's log-probs did to the generation (``log_prob_factor``)
    error_band: float | None = None  # the fitted one-GPU model's measured error (``*_ERROR``); None: not fitted

    @property
    def critic(self) -> float | None:
        """Seconds of the critic's phases (``values`` + ``update_critic``), None without a critic."""
        if "values" not in self.phases and "update_critic" not in self.phases:
            return None
        return self.phases.get("values", 0.0) + self.phases.get("update_critic", 0.0)


def fsdp_collectives(layers: int, micro_batches: int, backward: bool, optimizer_steps: int = 1) -> int:
    """The collectives each rank of an FSDP engine runs in one call. The model is sharded as one unit per decoder
    layer plus the root (embeddings, final norm, head: ``hybridrl_fsdp.engine._shard_model``); a micro-batch's
    forward all-gathers every unit, its backward all-gathers each again and reduce-scatters its gradients; then
    the scalar all-reduces of the forward, or of each optimizer step."""
    units = layers + 1
    gathers = micro_batches * units * (3 if backward else 1)
    return gathers + (optimizer_steps * UPDATE_ALL_REDUCES if backward else FORWARD_ALL_REDUCES)


def fsdp_bytes(params: int, dtype_bytes: int, ranks: int, micro_batches: int, backward: bool) -> float:
    """Bytes each rank receives in one FSDP call: the ``(n-1)/n`` of the weights it does not hold per gather (in
    the compute dtype), and of the fp32 gradients per reduce-scatter."""
    share = (ranks - 1) / ranks
    gathered = params * dtype_bytes * share * (2 if backward else 1)
    return micro_batches * (gathered + (params * GRAD_BYTES * share if backward else 0.0))


def pool_link(plan: Any, pool: str) -> str:
    """The link a pool's collectives cross: gloo between CPU slots, the network between nodes, else NVLink."""
    if plan.cluster.device != "cuda":
        return "tcp"
    return "net" if len({d.node for d in plan.pools[pool]}) > 1 else "nvlink"


def data_parallel_devices(profile: CostProfile, plan: Any, role: str) -> float:
    """The devices a data-parallel phase of ``role`` divides its tokens by: its pool's ranks, CPU slots capped by
    the cores of their node (``CostProfile.data_parallel_speedup``)."""
    nodes = Counter(d.node for d in plan.pools[plan.role_pool[role]])
    return profile.data_parallel_speedup(list(nodes.values()), plan.cluster.device)


def _micro_batches(cfg: RunConfig, role: str, sequences: float, tokens: float) -> int:
    """Micro-batches of one rank's ``sequences`` (``tokens``): by the role's token budget, else its rows (unset
    keys are the actor's)."""
    own, actor = getattr(cfg.roles, role), cfg.roles.actor
    budget = getattr(own, "max_tokens_per_micro_batch", None) or actor.max_tokens_per_micro_batch
    if budget:
        return max(1, math.ceil(tokens / budget))
    return max(1, math.ceil(sequences / (getattr(own, "micro_batch", None) or actor.micro_batch)))


def fsdp_seconds(profile: CostProfile, cfg: RunConfig, plan: Any, shape: Any, role: str, sequences: int,
                 tokens: float, backward: bool, compute: float = 0.0) -> float:
    """What the ranks' collectives add to one FSDP phase of ``role`` (a forward, or with ``backward`` an update)
    on a pool of several ranks: ``fsdp_collectives`` x the link's latency + the gathered weights and the
    reduce-scattered gradients over its bandwidth. On GPUs FSDP moves the bytes on a stream of its own while
    the previous unit computes, so there they add only what exceeds the phase's ``compute`` seconds; gloo on
    CPU slots shares the cores with the compute. A one-rank pool (the engine shards nothing), another train
    backend or an unknown model shape adds nothing."""
    group = plan.group_of(role)
    n = group.world_size
    if n <= 1 or shape is None or group.roles.get(role) != FSDP:
        return 0.0
    steps = 1
    if backward:
        mini = getattr(cfg.roles, role).mini_batch or cfg.roles.actor.mini_batch or sequences
        steps = cfg.algorithm.epochs * max(1, math.ceil(sequences / mini))
    micro = steps * _micro_batches(cfg, role, sequences / steps / n, tokens / steps / n)
    dtype = cfg.model.dtype if plan.cluster.device == "cuda" else "float32"  # CPU slots compute in fp32
    count = fsdp_collectives(shape.num_layers, micro, backward, steps)
    link = pool_link(plan, plan.role_pool[role])
    moved = profile.collective_seconds(0, fsdp_bytes(shape.param_count(), DTYPE_BYTES[dtype], n, micro, backward),
                                       link)
    if plan.cluster.device == "cuda":
        moved = max(0.0, moved - compute)
    return profile.collective_seconds(count, 0.0, link) + moved


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
    gather_link = "net" if reshard.gather_remote_bytes else intra  # a gather waits for its slowest link
    seconds += profile.collective_seconds(reshard.gather_collectives, 0.0, gather_link)
    return (profile.reshard_fixed + seconds) * reshard.syncs_per_step


def time_sliced(gen: float, train: float, gen_factor: float = TIME_SLICED_GEN,
                train_factor: float = TIME_SLICED_TRAIN) -> float:
    """The seconds of ``gen`` and ``train`` run at once on the same GPUs (a fractional map; see the docstring);
    the factors are given only by the benchmark that fits them."""
    return max(gen, train, gen_factor * gen + train_factor * train)


def log_prob_factor(cfg: RunConfig, profile: CostProfile, log_prob_cost: float) -> float:
    """What the sampled tokens' log-probs do to the generation of ``cfg`` against the profile's (see the
    docstring): ``log_prob_cost`` where only the candidate asks for them, its inverse where only the profile did."""
    asks = cfg.roles.rollout.log_probs is True
    if asks == profile.log_probs:
        return 1.0
    return log_prob_cost if asks else 1.0 / log_prob_cost


def predict(candidate: Candidate, cfg: RunConfig, plan: Any, profile: CostProfile, reshard: Any = None,
            shape: Any = None, log_prob_cost: float = 1.0) -> Prediction:
    """The step of ``cfg`` (the candidate's config, resolved as its run resolves it) placed by ``plan`` (its
    ``PlacementPlan``); ``shape`` (the model's ``ModelShape``) counts the collectives of train pools of several
    ranks (None: none counted); ``log_prob_cost`` is the rollout backend's (1: none declared)."""
    sequences = cfg.data.prompts_per_step * cfg.algorithm.n_samples
    length = profile.response_length if profile.response_length is not None else cfg.roles.rollout.max_new_tokens
    prompt = profile.prompt_length if profile.prompt_length is not None else cfg.data.max_prompt_len / 2
    tokens = sequences * (prompt + length)
    epochs = cfg.algorithm.epochs
    gen_devices = len(plan.pools[plan.role_pool["rollout"]])
    tp = max(1, cfg.roles.rollout.tensor_parallel)
    replicas = max(1, gen_devices // tp)
    concurrency = int((cfg.roles.rollout.options or {}).get("max_num_seqs") or DEFAULT_CONCURRENCY)
    time_sliced_map = candidate.kind == "fractional" and plan.cluster.device != "cpu"
    log_probs = 1.0 if time_sliced_map else log_prob_factor(cfg, profile, log_prob_cost)  # see the docstring
    phases = {"gen": profile.gen_seconds(math.ceil(sequences / replicas), length, concurrency, tp) * log_probs}
    if candidate.kind == "in_flight":
        phases["gen"] *= IN_FLIGHT_GEN

    def train_phase(role: str, tps: float, backward: bool) -> float:
        work = tokens * (epochs if backward else 1) / (tps * data_parallel_devices(profile, plan, role))
        return work + fsdp_seconds(profile, cfg, plan, shape, role, sequences, tokens, backward, work)

    if "reward" in plan.role_pool:  # a reward model (rule rewards alone run in the driver: fixed work)
        phases["reward"] = train_phase("reward", profile.reward_tps, False)
    if "ref" in plan.role_pool and cfg.algorithm.kl is not None and cfg.algorithm.kl.coef > 0:
        phases["ref"] = train_phase("ref", profile.ref_tps, False)
    if old_log_probs_needed(cfg, kl_in_reward(cfg)):  # else the update's own log-probs serve (one optimizer step)
        phases["old_log_prob"] = train_phase("actor", profile.actor_forward_tps, False)
    phases["update_actor"] = train_phase("actor", profile.train_tps, True)
    if "critic" in plan.role_pool:
        phases["values"] = train_phase("critic", profile.values_tps, False)
        phases["update_critic"] = train_phase("critic", profile.critic_train_tps, True)
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
    elif time_sliced_map:
        step = time_sliced(gen, train) + phases["reshard"] + profile.fixed
        bound = "time-sliced"
    elif candidate.kind == "fractional":  # on CPU slots
        step = gen + train + phases["reshard"] + profile.fixed
        bound = "shared cores"
    else:
        step = gen + train + phases["reshard"] + profile.fixed
        bound = "serial" if candidate.kind in ("colocated", "in_flight") else ("gen" if gen >= train else "train")
    work: dict[str, float] = {}
    for phase, roles in (("gen", ("rollout",)), ("wake", ("rollout",)), ("sleep", ("rollout",)),
                         ("reward", ("reward",)), ("ref", ("ref",)),
                         ("old_log_prob", ("actor",)), ("update_actor", ("actor",)), ("values", ("critic",)),
                         ("update_critic", ("critic",)),
                         ("reshard", ("actor", "rollout"))):
        if phase in phases:
            for pool in {plan.role_pool[r] for r in roles if r in plan.role_pool}:
                work[pool] = work.get(pool, 0.0) + phases[phase]
    busy = {pool: min(1.0, work.get(pool, 0.0) / step) for pool in plan.pools}
    band = TIME_SLICED_ERROR if bound == "time-sliced" else IN_FLIGHT_ERROR if candidate.kind == "in_flight" else None
    return Prediction(step, sequences / step, phases, busy, bound, log_prob_factor=log_probs, error_band=band)
