"""The cost model: how long each phase of a step takes, fitted from a profiled run folder or taken from a
documented default (``default_profile``) when there is none.

The forms, chosen to be fitted from the few steps of a short profiling run:

* **generation**, per rollout replica (``tensor_parallel`` devices): ``time = gen_fixed + gen_round * rounds /
  tp ** TP_EXPONENT`` with ``rounds = L * ceil(S / concurrency)``: ``L`` the mean response length, ``S`` the
  sequences a replica is given per step and ``concurrency`` the sequences it decodes at once
  (``roles.rollout.options.max_num_seqs``, else ``DEFAULT_CONCURRENCY``). Decoding is memory-bound: a round of
  ``concurrency`` sequences costs about what one sequence does. With fewer than two distinct ``rounds`` among the
  profiled steps the intercept cannot be told apart and is taken as 0.
* **train, reference and old log-probs**, a critic's **values** and **update_critic**, and a reward model's
  **reward** (the whole phase: its rule rewards, if any, with the model's forward): tokens per second per device,
  each on the devices of its own role's pool: linear in GPUs; CPU slots of a node share its cores, so
  they scale up to ``node_cores / slot_threads`` of the profile's slot (``CostProfile.data_parallel_speedup``).
  An FSDP pool of several ranks adds its collectives (``predict.fsdp_seconds``): count x the link's latency +
  bytes / its bandwidth (``collective_seconds``, the alpha-beta model; ``LINK_LATENCY``, ``LINK_BANDWIDTH``).
* **reshard**: ``reshard_fixed`` plus the bytes of one sync over the link between the pools
  (``LINK_BANDWIDTH``, overridable), and with several trainer ranks the gather's collectives (one per parameter
  tensor) x the link's latency.
* **wake and sleep** of a colocated rollout, and the driver's fixed per-step work (data, rule rewards without a
  reward model, advantages): seconds per step.

The profile also records whether its rollout returned the sampled tokens' log-probs (the run's resolved
``roles.rollout.log_probs``): a map whose run asks for them, or not, when the profile's did the other, has its
generation scaled by the rollout backend's ``log_prob_cost`` (``predict``).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridrl.errors import HybridRLError

#: bytes/s of the link kinds of ``hybridrl.placement.topology`` (and ``self``: a copy inside one process, ``tcp``:
#: gloo between CPU slots): NVLink 4 ~450 GB/s, PCIe 5 x16 ~64 GB/s, a 400 Gb/s InfiniBand NIC ~50 GB/s.
LINK_BANDWIDTH: dict[str, float] = {"self": 1000e9, "nvlink": 450e9, "nvswitch": 450e9, "pcie": 64e9, "net": 50e9,
                                    "tcp": 1.25e9}
#: seconds one collective costs besides its bytes (the alpha of ``CostProfile.collective_seconds``), by link kind.
#: GPUs: NCCL's own cost model of a ring of its Simple protocol (``src/graph/tuning.cc``: 8.4 us + 3.4 us per
#: NVLink hop, 5.7 per PCIe hop, 6.6-9.6 per network hop): one node's 8 ranks, two nodes for ``net``. ``tcp``:
#: gloo between two CPU slots of one node as the engine issues a gather (a DTensor ``full_tensor``): the intercept
#: of the line through the mean seconds at 4 B-512 KiB, ``benchmarks/gloo_latency.py`` (``results/gloo_latency.json``).
LINK_LATENCY: dict[str, float] = {"self": 0.0, "nvlink": 30e-6, "nvswitch": 30e-6, "pcie": 50e-6, "net": 80e-6,
                                  "tcp": 0.97e-3}
#: speed-up of a decode round with ``tp`` tensor-parallel ranks is ``tp ** TP_EXPONENT`` (all-reduces cost the rest)
TP_EXPONENT = 0.8
#: sequences a replica decodes at once when the rollout options do not say (``max_num_seqs``)
DEFAULT_CONCURRENCY = 256
#: the default (unprofiled) profile, by device kind. ``cuda``: fitted from the colocated GRPO steps measured on one
#: GPU at 0.5B-7B (``benchmarks/fit_default_costs.py``, ``results/default_costs_fit.json``, which a test holds these
#: to); ``cpu``: a few cores. Effective FLOP/s of a training and of a forward pass (at 6 and 2 FLOPs per parameter
#: and token); a decode round's fixed seconds, and the bytes/s at which it reads the weights besides
DEFAULT_TRAIN_FLOPS = {"cuda": 465e12, "cpu": 50e9}
DEFAULT_FORWARD_FLOPS = {"cuda": 537e12, "cpu": 50e9}
DEFAULT_ROUND_S = {"cuda": 0.00384, "cpu": 0.0}
DEFAULT_MEMORY_BW = {"cuda": 2.43e12, "cpu": 20e9}
#: the backends the default's rates were measured with (a config of others gets a note under the table)
DEFAULT_BACKENDS = {"cuda": {"actor": "fsdp", "rollout": "vllm"}, "cpu": {}}
#: the default profile's per-step seconds: a generate call's set-up, wake, sleep, the driver's work, a sync's set-up
DEFAULT_SECONDS = {"cuda": {"gen_fixed": 0.0, "wake": 0.02, "sleep": 0.04, "fixed": 0.32, "reshard_fixed": 0.1},
                   "cpu": {"gen_fixed": 0.1, "wake": 0.2, "sleep": 0.1, "fixed": 0.1, "reshard_fixed": 0.05}}
#: FLOPs per parameter and token of a training pass and of a forward pass, as the default profile counts them
TRAIN_FLOPS_PER_TOKEN, FORWARD_FLOPS_PER_TOKEN = 6, 2
#: parameters assumed by the default profile when the model's shape cannot be read
DEFAULT_PARAMS = 7e9

#: the phases the model predicts; the other ``timing/<phase>`` of a step (data, rule rewards, adv ...) are fixed
#: work, and so is ``reward`` unless a reward model scores it (``REWARD``)
MODELLED = ("gen", "wake", "sleep", "ref", "old_log_prob", "update_actor", "values", "update_critic", "reshard")
#: the phases a critic adds to the step (``roles.ROLES["critic"]``): its forward and its update
CRITIC_PHASES = ("values", "update_critic")
#: the phase a reward model adds (``roles.ROLES["reward"]``): modelled only in a run that has one
REWARD = "reward"
#: timings that are no phase of a steady step
NOT_FIXED = ("step", "sync_check", "val", "gen_baseline", "overlap_saved")
#: how to get a profile of the very config being planned
PROFILE_THIS = "profile the config itself: `hybridrl plan CONFIG --advise --profile-steps 3`"
PROFILE_HOWTO = ("record one with `hybridrl train CONFIG trainer.steps=3 trainer.out=RUN` (a run writes "
                 "spans.jsonl and metrics.jsonl into trainer.out)")


class ProfileError(HybridRLError, ValueError):
    """A profile run folder that lacks what the cost model is fitted from (the message says how to record it)."""

    exit_status = 2


@dataclass
class CostProfile:
    """The fitted (or default) costs. Rates are per device; seconds are per step."""

    gen_fixed: float  # s per generate call
    gen_round: float  # s per decode round of one replica at tensor_parallel 1
    train_tps: float  # update_actor tokens/s per device (tokens counted once per epoch)
    ref_tps: float  # reference forward tokens/s per device
    old_log_prob_tps: float  # actor forward tokens/s per device
    wake: float
    sleep: float
    fixed: float  # the driver's work per step
    reshard_fixed: float  # s per sync besides the bytes
    values_tps: float = math.inf  # critic forward tokens/s per device (inf: no critic was profiled)
    critic_train_tps: float = math.inf  # update_critic tokens/s per device (tokens counted once per epoch)
    reward_tps: float = math.inf  # reward-model phase tokens/s per device (inf: no reward model was profiled)
    response_length: float | None = None  # mean response tokens; None: the config's max_new_tokens
    prompt_length: float | None = None  # mean prompt tokens; None: half the config's max_prompt_len
    tp_exponent: float = TP_EXPONENT
    profiled: bool = False
    source: str = "default"
    bandwidth: dict[str, float] = field(default_factory=lambda: dict(LINK_BANDWIDTH))
    latency: dict[str, float] = field(default_factory=lambda: dict(LINK_LATENCY))
    slot_threads: int | None = None  # torch threads of the profile's CPU slot (device_map.json); None: unknown
    node_cores: int | None = None  # CPU cores of the profile's node; None: unknown
    log_probs: bool = False  # the profiled rollout returned its sampled tokens' log-probs (roles.rollout.log_probs)
    device: str | None = None  # "cuda" or "cpu": what the profiled run computed on (device_map.json); None: unknown
    active_params: int | None = None  # the profiled run's model, active parameters; None: not readable here
    backends: dict[str, str] = field(default_factory=dict)  # the profiled run's backend of the actor and rollout

    @property
    def actor_forward_tps(self) -> float:
        """The old log-probs' rate: as profiled, else (a run that skipped the pass) the reference's, the same
        model's forward."""
        return self.old_log_prob_tps if math.isfinite(self.old_log_prob_tps) else self.ref_tps

    def collective_seconds(self, collectives: float, nbytes: float, link: str) -> float:
        """The alpha-beta cost of ``collectives`` collectives moving ``nbytes`` in all over ``link``: each pays the
        link's latency whatever its size (small ones are all latency), the bytes its bandwidth."""
        return collectives * self.latency[link] + nbytes / self.bandwidth[link]

    def data_parallel_speedup(self, ranks_per_node: list[int], device: str) -> float:
        """How many times the profile's one device a data-parallel pool computes: its ranks on GPUs. CPU slots of
        one node share its cores (``hybridrl.runtime.launch`` gives each slot ``cores // slots`` torch threads), so
        a node's slots do at most ``node_cores / slot_threads`` times what the profile's slot did: nothing more
        where that slot already had every core; linear where the profile does not say (``device_map.json`` of an
        older run has no threads)."""
        if device != "cpu" or not self.slot_threads or not self.node_cores:
            return float(sum(ranks_per_node))
        cap = max(1.0, self.node_cores / self.slot_threads)
        return sum(min(float(r), cap) for r in ranks_per_node)

    def gen_seconds(self, sequences_per_replica: int, response_length: float, concurrency: int, tp: int) -> float:
        rounds = response_length * math.ceil(sequences_per_replica / max(1, concurrency))
        return self.gen_fixed + self.gen_round * rounds / max(1, tp) ** self.tp_exponent


def default_profile(device: str, active_params: float | None) -> CostProfile:
    """The unprofiled costs of a model of ``active_params`` on ``device`` (another kind than ``cpu`` is priced as
    ``cuda``): train at 6 FLOPs per parameter and token, forward at 2, a decode round a fixed cost plus the weights
    read once (bf16 on GPUs, fp32 on CPU slots)."""
    kind = "cpu" if device == "cpu" else "cuda"
    params = active_params or DEFAULT_PARAMS
    train = DEFAULT_TRAIN_FLOPS[kind] / (TRAIN_FLOPS_PER_TOKEN * params)
    forward = DEFAULT_FORWARD_FLOPS[kind] / (FORWARD_FLOPS_PER_TOKEN * params)
    weight_bytes = params * (2 if kind == "cuda" else 4)
    s = DEFAULT_SECONDS[kind]
    gen_round = DEFAULT_ROUND_S[kind] + weight_bytes / DEFAULT_MEMORY_BW[kind]
    return CostProfile(gen_fixed=s["gen_fixed"], gen_round=gen_round,
                       train_tps=train, ref_tps=forward, old_log_prob_tps=forward, wake=s["wake"], sleep=s["sleep"],
                       fixed=s["fixed"], reshard_fixed=s["reshard_fixed"], values_tps=forward,
                       critic_train_tps=train, reward_tps=forward, backends=dict(DEFAULT_BACKENDS[kind]),
                       source=f"default ({device}, {params / 1e9:.2g}B parameters)")


def uncovered_roles(profile: CostProfile, has_ref: bool, has_critic: bool, has_reward_model: bool,
                    has_old_log_prob: bool = False) -> list[str]:
    """What a config runs (a reference forward, a critic, a reward model, the actor's old log-probs) that a
    measured profile's run did not, so that the profile has no rate for it: those phases would be predicted free.
    The old log-probs are priced by the reference's rate where the profile skipped them (``actor_forward_tps``).
    Empty for the default profile, which prices every phase."""
    if not profile.profiled:
        return []
    wanted = (("a reference (ref)", has_ref, profile.ref_tps),
              ("old log-probs (old_log_prob)", has_old_log_prob, profile.actor_forward_tps),
              ("a critic (values, update_critic)", has_critic, min(profile.values_tps, profile.critic_train_tps)),
              ("a reward model (reward)", has_reward_model, profile.reward_tps))
    return [what for what, runs, rate in wanted if runs and math.isinf(rate)]


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares ``y = a + b x`` (``a >= 0``, ``b >= 0``); with fewer than two distinct ``x``, ``a = 0``.
    A negative set-up time or a negative slope is noise (lengths that barely differ: the quick start's responses
    are 2.9 to 3.0 tokens long, and one slow step tilts the line), so the line goes through the origin."""
    if len(set(round(x, 9) for x in xs)) < 2:
        return 0.0, sum(ys) / max(sum(xs), 1e-12)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    if a < 0 or b < 0:
        return 0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    return a, b


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError:
                raise ProfileError(f"{path}:{n} is not a JSON line; {PROFILE_HOWTO}") from None
    return rows


def _get(data: Mapping[str, Any], dotted: str, default: Any = None) -> Any:
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or node.get(part) is None:
            return default
        node = node[part]
    return node


def device_map_rows(folder: Path) -> list[dict[str, Any]]:
    """The ranks of the run's ``device_map.json`` (empty without the file, or where it cannot be read)."""
    from hybridrl.runtime.device_map import DEVICE_MAP_FILE

    try:
        rows = json.loads((folder / DEVICE_MAP_FILE).read_text())
    except (OSError, ValueError):
        return []
    return [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []


def slot_threads_and_cores(rows: list[dict[str, Any]]) -> tuple[int | None, int | None]:
    """The torch threads a rank of the run computed with and its node's CPU cores, from the device map's ``rows``
    (each rank's ``threads`` and ``cores``); None for what they do not say."""
    threads = [int(r["threads"]) for r in rows if r.get("threads")]
    cores = [int(r["cores"]) for r in rows if r.get("cores")]
    return (max(threads) if threads else None), (min(cores) if cores else None)


def profiled_device(rows: list[dict[str, Any]]) -> str | None:
    """"cuda" when a rank of the device map's ``rows`` held a GPU, "cpu" when none did, None without rows."""
    return None if not rows else "cuda" if any(r.get("gpu_ids") for r in rows) else "cpu"


def profiled_params(folder: Path) -> int | None:
    """The active parameters of the run's model (its ``config.json``), None where the model cannot be read here
    (a checkpoint on another machine, a config of an older version)."""
    from hybridrl.config import load_config
    from hybridrl.model.shape import model_shape

    try:
        return model_shape(load_config(folder / "config.json"), None, (folder, folder.parent))[0].active_param_count()
    except (HybridRLError, OSError, ValueError):
        return None


def fit_profile(run: str | Path, bandwidth: Mapping[str, float] | None = None,
                latency: Mapping[str, float] | None = None) -> CostProfile:
    """The cost model of the run folder ``run`` (its ``spans.jsonl``, ``metrics.jsonl`` and ``config.json``; the
    slots' threads and cores from ``device_map.json`` where it has them); the first step is left out (warm-up) when
    there are more. Raises ``ProfileError`` naming what is missing."""
    from hybridrl.observe.spans import SPANS_FILE, SpansError, load_spans

    folder = Path(run)
    if not folder.is_dir():
        raise ProfileError(f"--profile {run}: no such run folder; {PROFILE_HOWTO}")
    missing = [name for name in (SPANS_FILE, "metrics.jsonl", "config.json") if not (folder / name).is_file()]
    if missing:
        raise ProfileError(f"--profile {run}: the run folder has no {', '.join(missing)}; {PROFILE_HOWTO}")
    try:
        by_step = load_spans(folder / SPANS_FILE)
    except SpansError as exc:
        raise ProfileError(f"--profile {run}: {exc}; {PROFILE_HOWTO}") from None
    metrics = {int(r["step"]): r for r in _read_jsonl(folder / "metrics.jsonl") if "step" in r}
    try:
        config = json.loads((folder / "config.json").read_text())
    except ValueError:
        raise ProfileError(f"--profile {run}: config.json is not JSON; {PROFILE_HOWTO}") from None
    steps = sorted(s for s in by_step if s in metrics)
    if len(steps) > 1:
        steps = steps[1:]
    has_ref = _get(config, "roles.ref") is not None and (_get(config, "algorithm.kl.coef", 0) or 0) > 0
    has_critic = _get(config, "roles.critic") is not None
    has_reward_model = _get(config, "roles.reward.model") is not None
    needed = ["gen", "update_actor"] + (["ref"] if has_ref else []) + (list(CRITIC_PHASES) if has_critic else []) \
        + ([REWARD] if has_reward_model else [])
    seen = {s.phase for step in steps for s in by_step[step]}
    absent = [p for p in needed if p not in seen]
    if not steps or absent:
        what = ", ".join(absent) if steps else "any step with both spans and metrics"
        warmup = int(_get(config, "algorithm.critic_warmup", 0) or 0)
        hint = (f" (the critic trains alone for algorithm.critic_warmup={warmup} steps: profile more steps, or "
                "with algorithm.critic_warmup=0)" if has_critic and "update_actor" in absent and warmup else "")
        raise ProfileError(f"--profile {run}: the run recorded no spans of {what}{hint} (the cost model needs "
                           f"{', '.join(needed)}); {PROFILE_HOWTO}")
    sequences = int(_get(config, "data.prompts_per_step", 1)) * int(_get(config, "algorithm.n_samples", 1))
    tp = max(1, int(_get(config, "roles.rollout.tensor_parallel", 1)))
    concurrency = int(_get(config, "roles.rollout.options.max_num_seqs", DEFAULT_CONCURRENCY))
    xs, ys, lengths, prompt_lengths = [], [], [], []
    rates: dict[str, list[tuple[float, float]]] = {p: [] for p in ("update_actor", "ref", "old_log_prob",
                                                                    *CRITIC_PHASES, REWARD)}
    for step in steps:
        spans, row = by_step[step], metrics[step]
        length = float(row.get("response_length/mean") or 0.0)
        for span in spans:
            seconds = span.end - span.start
            if span.phase == "gen" and span.role == "rollout":
                replicas = max(1, len(span.ranks) // tp)
                per_replica = math.ceil(sequences / replicas)
                if not length and span.tokens:
                    length = span.tokens / sequences
                xs.append(length * math.ceil(per_replica / concurrency) / tp ** TP_EXPONENT)
                ys.append(seconds)
            elif span.phase in rates and span.tokens and span.ranks:
                rates[span.phase].append((float(span.tokens), seconds * len(span.ranks)))
                if span.phase in ("ref", "values"):  # prompts and responses
                    prompt_lengths.append(span.tokens / sequences - length)
        lengths.append(length)
    gen_fixed, gen_round = fit_line(xs, ys)

    def rate(phase: str) -> float:
        tokens, device_seconds = sum(t for t, _ in rates[phase]), sum(s for _, s in rates[phase])
        return tokens / device_seconds if device_seconds > 0 else math.inf

    def median(key: str) -> float:
        values = [float(metrics[s][key]) for s in steps if metrics[s].get(key) is not None]
        return statistics.median(values) if values else 0.0

    modelled = MODELLED + ((REWARD,) if has_reward_model else ())
    fixed = statistics.median(sum(float(v) for k, v in metrics[s].items() if k.startswith("timing/")
                                  and k.removeprefix("timing/") not in modelled + NOT_FIXED) for s in steps)
    links = {**LINK_BANDWIDTH, **(bandwidth or {})}
    colocated = _get(config, "roles.rollout.pool") == _get(config, "roles.actor.pool")
    moved = median("reshard/bytes") / links["self" if colocated else "net"]
    device_map = device_map_rows(folder)
    threads, cores = slot_threads_and_cores(device_map)
    return CostProfile(gen_fixed=gen_fixed, gen_round=gen_round, train_tps=rate("update_actor"), ref_tps=rate("ref"),
                       old_log_prob_tps=rate("old_log_prob"), values_tps=rate("values"),
                       critic_train_tps=rate("update_critic"), reward_tps=rate(REWARD), wake=median("timing/wake"),
                       sleep=median("timing/sleep"), fixed=fixed,
                       reshard_fixed=max(0.0, median("timing/reshard") - moved),
                       response_length=statistics.fmean(lengths) if lengths else None,
                       prompt_length=max(0.0, statistics.fmean(prompt_lengths)) if prompt_lengths else None,
                       profiled=True, source=f"profile {run} ({len(steps)} step(s))", bandwidth=links,
                       latency={**LINK_LATENCY, **(latency or {})}, slot_threads=threads, node_cores=cores,
                       log_probs=_get(config, "roles.rollout.log_probs") is True, device=profiled_device(device_map),
                       active_params=profiled_params(folder),
                       backends={role: str(name) for role in ("actor", "rollout")
                                 if (name := _get(config, f"roles.{role}.backend")) is not None})
