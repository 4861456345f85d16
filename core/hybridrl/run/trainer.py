"""The RL training loop (driver side): one GRPO/PPO-style step is a fixed sequence of timed phases.

gen [-> gen_baseline (ReMax)] -> reward -> ref -> old_log_prob [-> values (critic)] -> adv
[-> update_critic] -> update_actor -> reshard. ``generate_batch`` and ``train_on`` are the two halves that both
the synchronous step and the pipelined one (``hybridrl.run.pipeline``) are made of. Scoring lives in
``hybridrl.rewards``, the algorithm pieces in ``hybridrl.algorithms``, checkpoints and fault handling in
``hybridrl.run.state``. The trainer is ``Stateful``: ``state_dict`` is what a checkpoint keeps of the driver.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hybridrl.algorithms.advantages import AdvantageInputs
from hybridrl.algorithms.kl_control import build_kl_controller
from hybridrl.algorithms.objective import (
    PolicyObjective,
    ValueObjective,
    old_log_probs_needed,
    resolve_algorithm,
)
from hybridrl.algorithms.overlong import soft_overlong_penalty, truncated_rows
from hybridrl.config.secrets import redacted
from hybridrl.engines import SamplingParams
from hybridrl.engines.batch import (
    ADVANTAGES,
    BASELINE_SCORES,
    GROUP_INDEX,
    LOG_PROBS,
    MAX_NEW_TOKENS,
    MESSAGES,
    META,
    OLD_LOG_PROBS,
    PROMPT_IDS,
    PROMPT_MASK,
    PROMPT_ROUTED_EXPERTS,
    PROMPT_TEXT,
    REF_LOG_PROBS,
    RESPONSE_IDS,
    RESPONSE_MASK,
    RESPONSE_TEXT,
    RETURNS,
    ROLLOUT_LOG_PROBS,
    ROUTED_EXPERTS,
    SCORES,
    TOKEN_REWARDS,
    TRUNCATED,
    VALUES,
    Batch,
    cap_responses,
    first_row_of_each_group,
    left_pad,
    response_attention_mask,
    sequence_keys,
)
from hybridrl.environments.driver import Episodes
from hybridrl.observe.flops import shared_prompt_roles, step_perf_metrics
from hybridrl.observe.gc_pauses import gc_pause_metrics
from hybridrl.observe.memory import peak_memory_metrics
from hybridrl.observe.spans import SpanLog
from hybridrl.observe.timing import PhaseTimer
from hybridrl.observe.tracking import build_trackers
from hybridrl.rewards.scorer import RewardScorer, on_last_token
from hybridrl.roles import role_spec
from hybridrl.rollout.identical_groups import IdenticalGroupsWarning, identical_groups_metrics
from hybridrl.run import checkpoint as ckpt
from hybridrl.run.dynamic_sampling import GroupFilter, merge_batch_metrics
from hybridrl.run.faults import signal_name
from hybridrl.run.file_modes import open_private, private_dir, write_config, write_private
from hybridrl.run.pipeline import GenerationJob, needs_sync, staleness_of
from hybridrl.run.preflight import RunSetup
from hybridrl.run.routing_replay import returns_routing
from hybridrl.run.state import Checkpointer, StepGuard, trained_roles
from hybridrl.run.streaming import GroupsInFlight, forced_lengths, partial_rollouts, refills, streams
from hybridrl.run.validation import Validator
from hybridrl.runtime.deadline import CallDeadline
from hybridrl.runtime.group import Result, WorkerGroup, average_metrics, unique_groups
from hybridrl.runtime.launch import build_engines, role_options, start_worker_groups
from hybridrl.weights.bridges import resolve_transport
from hybridrl.weights.sync_check import GREEDY_MARGIN, SyncCheck

log = logging.getLogger(__name__)



def value_metrics(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Explained variance of the returns by the values the advantages used, ``1 - Var(R - V) / Var(R)``
    over response tokens (1: perfect, 0: no better than a constant, < 0: worse), and their means."""
    m = mask.bool()
    v, r = values[m].double(), returns[m].double()
    var_r = r.var() if r.numel() > 1 else torch.zeros((), dtype=torch.float64)
    explained = 1.0 - float((r - v).var() / var_r) if r.numel() > 1 and var_r > 1e-12 else 0.0  # constant returns: 0
    return {"critic/explained_var": explained, "critic/values_mean": float(v.mean()) if v.numel() else 0.0,
            "critic/returns_mean": float(r.mean()) if r.numel() else 0.0}


@dataclass
class StepLog:
    """What one step records as it goes: wall time per phase, model compute time per phase, metrics."""

    timer: PhaseTimer = field(default_factory=PhaseTimer)
    compute: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)

    def took(self, phase: str, result: Result) -> Any:
        """Record ``result``'s compute seconds under ``phase`` (added up over several calls) and return its value."""
        self.compute[phase] = self.compute.get(phase, 0.0) + result.compute_s
        return result.value


class Trainer:
    """Drives the worker groups through training steps and logs every phase."""

    def __init__(self, setup: RunSetup) -> None:
        from hybridrl.data.loading import PromptLoader

        self.setup = setup
        self.cfg = cfg = setup.cfg
        self.registry = setup.registry
        plan = setup.run_plan  # resolved once by pre-flight; a setup built by hand resolves here
        self.algo = plan.algorithm if plan is not None else resolve_algorithm(cfg.algorithm, self.registry)
        self.tokenizer = setup.tokenizer
        self.loader = PromptLoader(setup.prompts, cfg.data.prompts_per_step, cfg.trainer.seed, cfg.data.shuffle)
        self.advantage_fn = self.registry.get("advantage", self.algo.advantage)
        kl_cfg = cfg.algorithm.kl
        kl_on = kl_cfg is not None and kl_cfg.coef > 0
        self.kl_fn = self.registry.get("kl_estimator", kl_cfg.estimator) if kl_on else None
        self.kl_in_reward = self.kl_fn is not None and kl_cfg.apply_as == "reward"
        self.kl_ctrl = build_kl_controller(kl_cfg) if self.kl_in_reward else None
        self.policy_objective = PolicyObjective(cfg.algorithm, self.registry, self.algo)
        self.scorer = RewardScorer(self.tokenizer, setup.rules, reward_cfg=cfg.roles.reward)
        self.episodes = Episodes.for_run(cfg, self.registry)  # None: single-turn generation
        r = cfg.roles.rollout
        self.sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                       max_new_tokens=r.max_new_tokens, min_new_tokens=r.min_new_tokens,
                                       ignore_eos=r.ignore_eos, logprobs=r.log_probs,
                                       return_routing=returns_routing(cfg))
        self.recompute_old_log_probs = old_log_probs_needed(cfg, self.kl_in_reward)
        self.groups: dict[str, WorkerGroup] = {}
        self.placement_groups: list[Any] = []
        self.last_batch: Batch | None = None
        self.trackers: list[Any] = []
        self.step = 0
        self.actor_version = 0  # actor updates so far
        self.rollout_version = 0  # the actor version whose weights the rollout holds
        self.next_generation: GenerationJob | None = None  # pipelined: the batch being generated ahead
        self.interrupted = False  # stopped by Ctrl-C (after saving)
        self.sync_check = SyncCheck.for_dtype(cfg.trainer.sync_check_every, cfg.model.dtype)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.eos_id = self.tokenizer.eos_token_id
        trained = {role: setup.plan.group_of(role).roles[role] for role in setup.plan.role_pool
                   if role_spec(role).trainable}
        self.checkpointer = Checkpointer(cfg.trainer.out, cfg.trainer.keep_checkpoints, {
            "roles": trained, "model_path": str(Path(setup.model_path).resolve()), "dtype": cfg.model.dtype,
            "actor_options": role_options(cfg, "actor"), "actor_backend_options": dict(cfg.roles.actor.options),
            "seed": cfg.trainer.seed,
            "model_signatures": setup.model_signatures, "data_rows": self.loader.num_rows},
            every=cfg.trainer.save_every, last=cfg.trainer.steps, allow_unverified=cfg.trainer.resume_unverified)
        self.guard = StepGuard(cfg.trainer.max_bad_steps, setup.plan, self.checkpointer)
        self.deadline = CallDeadline(cfg.trainer.step_timeout_s)  # the waits on workers (trainer.step_timeout_s)
        #: roles whose engine computes each distinct prompt once (their FLOPs count it once: observe.flops)
        self.shared_prompt_roles = shared_prompt_roles(cfg, setup.plan, self.registry)
        self.validator: Validator | None = None  # data.val: built by start, with the rollout it uses
        self.identical_groups = IdenticalGroupsWarning()  # a rollout that does not sample (rollout/identical_groups)
        self.response_cap = forced_lengths(cfg)  # benchmarks: roles.rollout.response_lengths
        self.groups_drawn = 0  # prompt groups taken from the loader so far (their ids for forced lengths)
        #: roles.rollout.oversample / partial: the groups in flight across steps (hybridrl.run.streaming)
        self.in_flight = GroupsInFlight(
            cfg.data.prompts_per_step, cfg.algorithm.n_samples, r.oversample,
            partial_rollouts(cfg, setup.backends["rollout"].can("partial")), cfg.trainer.max_staleness,
            r.max_new_tokens, self.pad_id, self.response_cap,
            refills(cfg, setup.backends["rollout"].can("refill"))) if streams(cfg) else None
        #: each step's phases as spans on the plan's devices (spans.jsonl) and device/<pool>.<rank>/busy
        self.span_log = SpanLog.for_plan(setup.plan, cfg.trainer.out, cfg.algorithm.epochs)

    # --- Stateful: what a checkpoint keeps of the driver ------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "loader": self.loader.state_dict(),
                "kl_ctrl": dataclasses.asdict(self.kl_ctrl) if self.kl_ctrl is not None else None,
                "bad_steps_in_row": self.guard.bad.in_row, "rng": ckpt.rng_state(), "groups_drawn": self.groups_drawn,
                "in_flight": self.in_flight.state_dict() if self.in_flight is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.loader.load_state_dict(state["loader"])
        if self.kl_ctrl is not None and state.get("kl_ctrl") is not None:
            for key, value in state["kl_ctrl"].items():
                setattr(self.kl_ctrl, key, value)
        self.guard.bad.in_row = int(state.get("bad_steps_in_row", 0))
        self.groups_drawn = int(state.get("groups_drawn", 0))
        if self.in_flight is not None and state.get("in_flight") is not None:
            self.in_flight.load_state_dict(state["in_flight"])
        ckpt.set_rng_state(state["rng"])

    # --- set-up ---------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the workers and engines, restore a checkpoint when resuming, and give the rollout the
        actor's weights."""
        out = private_dir(self.cfg.trainer.out)  # 0700: the run's files are its owner's (hybridrl.run.file_modes)
        resume_from = self.setup.resume_from  # chosen, verified and fitted to this run by the pre-flight
        if resume_from is None:
            write_private(out / "samples.jsonl", "")
        write_config(out / "config.json", self.cfg.model_dump(mode="json", by_alias=True))  # secrets redacted
        if self.setup.run_plan is not None:
            write_config(out / "run_plan.json", self.setup.run_plan.record())
        log.info("%s", self.setup.plan.render())
        for note in self.setup.notes:
            log.info("note: %s", note)
        if self.setup.dropped_prompts:
            log.info("data: dropped %d prompt(s) longer than data.max_prompt_len", self.setup.dropped_prompts)
        log.info("starting workers ...")
        t0 = time.perf_counter()
        self.groups, self.placement_groups = start_worker_groups(self.cfg, self.setup.plan, self.deadline)
        log.info("building engines from %s ...", self.setup.model_path)
        build_engines(self.cfg, self.setup.plan, self.groups, self.setup.model_path, self.setup.role_model_paths)
        if "reward" in self.groups:
            self.scorer.model_group = self.groups["reward"]
            self.scorer.model_coef = self.cfg.roles.reward.model.coef
        self.scorer.start()  # a reward pool loads its functions while the engines come up
        plan = self.setup.plan
        self.rollout_colocated = any(plan.colocated("rollout", r) for r in self.groups if r != "rollout")
        # a colocated engine that declares it can release its memory sleeps while the trainers work
        self.rollout_sleeps = self.rollout_colocated and self.setup.backends["rollout"].can("sleep")
        transport = resolve_transport(self.cfg.roles.rollout.weight_transport, plan)
        self.bridge = self.registry.bridge(plan.group_of("actor").roles["actor"],
                                           plan.group_of("rollout").roles["rollout"], transport).target()
        self.bucket_bytes = int(self.cfg.roles.rollout.bucket_mb * 2**20)
        if resume_from is not None:
            self.checkpointer.restore(resume_from, self, self.groups)
            if self.step >= self.cfg.trainer.steps:
                log.info("the run is already at trainer.steps=%d: raise it to train on", self.cfg.trainer.steps)
        self.sync_weights()  # the rollout starts from exactly the actor's weights
        if self.rollout_sleeps:
            self.groups["rollout"].broadcast("rollout", "sleep")
        log.info("workers ready in %.1fs", time.perf_counter() - t0)
        if self.setup.val_prompts:
            self.validator = Validator(self.cfg, self.setup.val_prompts, self.pad_id, self.sampling,
                                       self.groups["rollout"], self.scorer, self.episodes, self.rollout_sleeps,
                                       self.save_copy)
        resumed = self.checkpointer.resumed_from is not None
        self.trackers = build_trackers(self.registry, self.cfg.trainer.trackers, self.cfg.trainer.out,
                                       redacted(self.cfg.model_dump(mode="json")), resume=resumed)

    def sync_weights(self) -> dict[str, float]:
        return self.bridge.sync(self.groups["actor"], "actor", self.groups["rollout"], "rollout", self.bucket_bytes)

    # --- one step -------------------------------------------------------------------------------------
    def next_prompts(self) -> list[Any]:
        """The loader's next ``data.prompts_per_step`` prompt rows."""
        rows = next(self.loader)
        self.groups_drawn += len(rows)
        return rows

    def prompt_batch(self) -> Batch:
        first = self.groups_drawn
        rows = self.next_prompts()
        ids, mask = left_pad([r.token_ids for r in rows], self.pad_id)
        n = self.cfg.algorithm.n_samples
        fields = {PROMPT_TEXT: [r.prompt for r in rows], META: [r.meta for r in rows]}
        if self.episodes is not None:
            fields[MESSAGES] = [r.messages for r in rows]
        batch = Batch.from_tensors({PROMPT_IDS: ids, PROMPT_MASK: mask}, fields)
        batch = batch.repeat_interleave(n)
        batch.set(GROUP_INDEX, torch.arange(len(rows)).repeat_interleave(n))
        if self.response_cap is not None:  # benchmarks: the same forced lengths as the groups in flight get
            batch.set(MAX_NEW_TOKENS, torch.tensor([self.response_cap(first + g, i) for g in range(len(rows))
                                                    for i in range(n)], dtype=torch.long))
        batch.info["temperature"] = self.temperature
        return batch

    @property
    def temperature(self) -> float:
        """What the trainers divide the logits by, to compare with the rollout's log-probs."""
        return self.sampling.temperature if self.sampling.temperature > 0 else 1.0

    def write_samples(self) -> None:
        """A few (prompt, response, score) triples of the last step, for reading what the policy does."""
        batch, n = self.last_batch, self.cfg.trainer.log_samples
        if batch is None or n == 0:
            return
        stride = max(1, len(batch) // n)
        with open_private(Path(self.cfg.trainer.out) / "samples.jsonl") as f:
            for i in range(0, len(batch), stride)[:n]:
                f.write(json.dumps({"step": self.step, "prompt": batch[PROMPT_TEXT][i],
                                    "response": batch[RESPONSE_TEXT][i], "score": float(batch[SCORES][i])}) + "\n")

    def train_step(self) -> dict[str, float]:
        """One step: synchronous (generate, then train, then reshard), or pipelined (``trainer.pipelined``:
        the next batch is generated while this one trains, see ``hybridrl.run.pipeline``)."""
        if self.cfg.trainer.pipelined:
            return self.pipelined_step()
        log, step_start = StepLog(), time.perf_counter()
        batch = self.generate_batch(log)
        stats = {"bytes": 0.0}
        if self.train_on(batch, log):
            with log.timer.phase("reshard"):
                stats = self.sync_weights()
            self.rollout_version = self.actor_version
        return self.finish_step(batch, log, time.perf_counter() - step_start, stats)

    def pipelined_step(self) -> dict[str, float]:
        """Train on the batch generated during the previous step while the rollout generates the next one.
        The order (collect, sync if needed, submit next, train) is explained in ``hybridrl.run.pipeline``."""
        assert not self.rollout_colocated, "pre-flight refuses trainer.pipelined with a colocated rollout"
        log, step_start = StepLog(), time.perf_counter()
        bound = self.cfg.trainer.max_staleness
        job, self.next_generation = self.next_generation, None
        if job is None:  # the first step (or one past trainer.steps): nothing was generated ahead
            with log.timer.phase("data"):
                job = self.submit_next(self.step, train_version=self.actor_version)
        with log.timer.phase("gen_wait"):
            batch = self.collect_generation(job, log) if job.rows is None else self.collect_in_flight(job, log)
        log.timer.record("gen", log.compute["gen"])  # the rollout's own time; it overlapped the previous step
        staleness = staleness_of(job, self.actor_version, bound)
        stats = {"bytes": 0.0}
        if self.step + 1 < self.cfg.trainer.steps:
            if needs_sync(self.actor_version, self.rollout_version, bound, self.cfg.trainer.sync_every):
                with log.timer.phase("reshard"):
                    stats = self.sync_weights()
                self.rollout_version = self.actor_version
            with log.timer.phase("data"):
                self.next_generation = self.submit_next(self.step + 1, train_version=self.actor_version + 1)
        with log.timer.phase("reward"):
            log.metrics.update(self.score(batch, log))
        self.train_on(batch, log)
        step_seconds = time.perf_counter() - step_start
        metrics = self.finish_step(batch, log, step_seconds, stats)
        serial = sum(v for k, v in log.timer.seconds.items() if k != "gen_wait")
        metrics["timing/overlap_saved"] = serial - step_seconds
        metrics["async/staleness"] = float(staleness)
        metrics["async/weights_version"] = float(job.version)
        return metrics

    def submit_next(self, step: int, train_version: int) -> GenerationJob:
        """The pipelined step's next generation: a prompt batch, or with groups in flight one
        ``generate_until`` round over them (trained against actor version ``train_version``)."""
        flight = self.in_flight
        if flight is None:
            return self.submit_generation(self.prompt_batch(), step)
        flight.begin_step(train_version, self.next_prompts)
        requests, rows = flight.requests()
        params = dataclasses.replace(self.sampling, seed=self.cfg.trainer.seed * 100_003 + step)
        pending = self.groups["rollout"].submit("rollout", "generate_until", requests, params, *flight.until_args())
        return GenerationJob(requests, step, self.rollout_version, pending, rows=rows)

    def collect_in_flight(self, job: GenerationJob, log: StepLog) -> Batch:
        """A submitted round's samples join the groups in flight; a step still short of complete groups (a
        replica stopped at its own share) runs further rounds, waited for, on the same weights."""
        flight = self.in_flight
        assert flight is not None and job.rows is not None
        flight.absorb(job.rows, log.took("gen", self.groups["rollout"].wait(job.pending)), job.version)
        while flight.needs_more:
            requests, rows = flight.requests()
            params = dataclasses.replace(self.sampling, seed=self.cfg.trainer.seed * 100_003 + job.step
                                         + 7_919 * flight.step.rounds)
            out = log.took("gen", self.groups["rollout"].call("rollout", "generate_until", requests, params,
                                                              *flight.until_args()))
            flight.absorb(rows, out, job.version)
        batch = flight.batch(flight.take(self.cfg.data.prompts_per_step))
        flight.end_step()
        batch.info["temperature"] = self.temperature
        log.metrics.update(flight.metrics(batch, self.actor_version))
        return batch

    # --- the pieces of a step -------------------------------------------------------------------------
    def submit_generation(self, batch: Batch, step: int, salt: int = 0) -> GenerationJob:
        """Dispatch the generation of ``batch`` (the prompts of ``step``; ``salt`` numbers a step's further
        batches) without waiting for it."""
        params = dataclasses.replace(self.sampling, seed=self.cfg.trainer.seed * 100_003 + step + 7_919 * salt)
        rollout = self.groups["rollout"]
        if self.episodes is not None:  # multi-turn: one episode per row, played next to the engine
            pending = self.episodes.submit(rollout, batch, params)
        else:
            keys = (PROMPT_IDS, PROMPT_MASK) + ((MAX_NEW_TOKENS,) if MAX_NEW_TOKENS in batch else ())
            pending = rollout.submit("rollout", "generate", batch.select(*keys), params)
        return GenerationJob(batch, step, self.rollout_version, pending)

    def collect_generation(self, job: GenerationJob, log: StepLog) -> Batch:
        """Wait for a submitted generation; its responses join the prompt batch (cut to the rows' forced
        lengths, for an engine that does not stop a row at its own cap)."""
        out = log.took("gen", self.groups["rollout"].wait(job.pending))
        if MAX_NEW_TOKENS in job.batch and RESPONSE_MASK in out:
            out = cap_responses(out, job.batch[MAX_NEW_TOKENS])
        job.batch.update(out)
        return job.batch

    def generate_batch(self, log: StepLog) -> Batch:
        """Prompts -> responses (-> greedy baseline) -> scores, waiting for each phase (the synchronous step)."""
        if self.in_flight is not None:
            return self.generate_streamed(log)
        timer, metrics = log.timer, log.metrics
        with timer.phase("data"):
            batch = self.prompt_batch()
        rollout = self.groups["rollout"]
        if self.rollout_sleeps:
            with timer.phase("wake"):
                rollout.broadcast("rollout", "wake")
        if self.sync_check.due(self.step):
            with timer.phase("sync_check"):
                metrics.update(self.check_sync(batch))
        with timer.phase("gen"):
            batch = self.collect_generation(self.submit_generation(batch, self.step), log)
        if self.algo.greedy_baseline:
            with timer.phase("gen_baseline"):
                metrics.update(self.greedy_baseline(batch, log))
        if self.cfg.algorithm.filter_groups:  # scored while the engine is awake: a refill may follow
            batch = self.fill_with_informative_groups(batch, log)
        if self.rollout_sleeps:
            with timer.phase("sleep"):
                rollout.broadcast("rollout", "sleep")
        if not self.cfg.algorithm.filter_groups:
            with timer.phase("reward"):
                metrics.update(self.score(batch, log))
        return batch

    def generate_streamed(self, log: StepLog) -> Batch:
        """The step's groups from the groups in flight (``hybridrl.run.streaming``): rounds of ``generate_until``
        until ``data.prompts_per_step`` groups are complete (scored, and with ``algorithm.filter_groups`` kept
        only where their samples differ), the rest left in flight for the next step."""
        timer, flight = log.timer, self.in_flight
        assert flight is not None
        rollout = self.groups["rollout"]
        if self.rollout_sleeps:
            with timer.phase("wake"):
                rollout.broadcast("rollout", "wake")
        need = self.cfg.data.prompts_per_step
        groups = GroupFilter(need, self.cfg.algorithm.max_refills, self.pad_id)
        scored: list[dict[str, float]] = []
        with timer.phase("data"):
            flight.begin_step(self.actor_version, self.next_prompts)
        taken: list[Batch] = []
        while True:
            while flight.needs_more:
                with timer.phase("gen"):
                    requests, rows = flight.requests()
                    salt = flight.step.rounds + 101 * groups.batches
                    params = dataclasses.replace(self.sampling,
                                                 seed=self.cfg.trainer.seed * 100_003 + self.step + 7_919 * salt)
                    out = log.took("gen", rollout.call("rollout", "generate_until", requests, params,
                                                       *flight.until_args()))
                    flight.absorb(rows, out, self.rollout_version)
            batch = flight.batch(flight.take(groups.groups_needed - groups.kept_groups))
            batch.info["temperature"] = self.temperature
            if self.algo.greedy_baseline:
                with timer.phase("gen_baseline"):
                    log.metrics.update(self.greedy_baseline(batch, log))
            with timer.phase("reward"):
                scored.append(self.score(batch, log))
            if not self.cfg.algorithm.filter_groups:
                taken.append(batch)
                break
            groups.add(batch)
            if groups.full:
                break
            groups.check_refill()
            with timer.phase("data"):
                flight.top_up(self.next_prompts)
        flight.end_step()
        if self.rollout_sleeps:
            with timer.phase("sleep"):
                rollout.broadcast("rollout", "sleep")
        log.metrics.update(merge_batch_metrics(scored))
        if self.cfg.algorithm.filter_groups:
            log.metrics.update(groups.metrics())
            batch = groups.batch()
        else:
            batch = taken[0]
        log.metrics.update(flight.metrics(batch, self.actor_version))
        return batch

    def fill_with_informative_groups(self, batch: Batch, log: StepLog) -> Batch:
        """Dynamic sampling: score, keep the groups whose samples disagree, and generate further prompt
        batches until the step holds ``data.prompts_per_step`` of them (``hybridrl.run.dynamic_sampling``).
        The step's metrics describe the groups it trains on."""
        timer = log.timer
        groups = GroupFilter(self.cfg.data.prompts_per_step, self.cfg.algorithm.max_refills, self.pad_id)
        refill, scored = 0, []
        while True:
            with timer.phase("reward"):
                scored.append(self.score(batch, log))
            groups.add(batch)
            if groups.full:
                break
            groups.check_refill()
            refill += 1
            with timer.phase("data"):
                batch = self.prompt_batch()
            with timer.phase("gen"):
                job = self.submit_generation(batch, self.step, salt=refill)
                batch = self.collect_generation(job, log)
        log.metrics.update(merge_batch_metrics(scored))  # every sample generated, the dropped groups' too
        log.metrics.update(groups.metrics())
        return groups.batch()

    def train_on(self, batch: Batch, log: StepLog) -> bool:
        """Reference and old log-probs (values), advantages, critic and actor updates on a scored batch.
        Returns whether the actor was updated (not during the critic's warm-up); the reshard is the caller's."""
        timer, metrics = log.timer, log.metrics
        if "ref" in self.groups and self.algo.uses_ref:
            with timer.phase("ref"):
                ref = log.took("ref", self.groups["ref"].call("ref", "compute_log_probs",
                                                              batch.select(*sequence_keys(batch))))
                batch.set(REF_LOG_PROBS, ref[LOG_PROBS])
        actor = self.groups["actor"]
        if self.recompute_old_log_probs:
            with timer.phase("old_log_prob"):
                old = log.took("old_log_prob", actor.call("actor", "compute_log_probs",
                                                          self.actor_view(batch, sequence_keys(batch))))
                batch.set(OLD_LOG_PROBS, old[LOG_PROBS])
        critic = self.groups.get("critic")
        if critic is not None:
            with timer.phase("values"):
                values = log.took("values", critic.call("critic", "compute_values",
                                                        batch.select(*sequence_keys(batch))))
                batch.set(VALUES, values[VALUES])
        with timer.phase("adv"):
            metrics.update(self.advantages(batch))
        if critic is not None:
            with timer.phase("update_critic"):
                metrics.update(self.update_critic(batch, log))
        if critic is not None and self.step < self.cfg.algorithm.critic_warmup:  # the critic may learn alone at first
            return False
        with timer.phase("update_actor"):
            metrics.update(self.update_actor(batch, log))
        self.actor_version += 1
        return True

    def finish_step(self, batch: Batch, log: StepLog, step_seconds: float,
                    reshard: dict[str, float]) -> dict[str, float]:
        """Close the step (counter, last batch) and derive its timing, throughput, performance and memory
        metrics."""
        timer, compute, metrics = log.timer, log.compute, log.metrics
        self.step += 1
        self.last_batch = batch
        metrics.update(timer.metrics())
        metrics["timing/step"] = step_seconds
        self.deadline.observe_step(step_seconds)
        metrics.update({f"compute/{k}": v for k, v in compute.items()})
        metrics["perf/overhead_fraction"] = max(0.0, 1.0 - sum(compute.values()) / step_seconds)
        metrics.update({f"reshard/{k}": float(v) for k, v in reshard.items()})
        resp_tokens = float(batch[RESPONSE_MASK].sum())
        all_tokens = float(response_attention_mask(batch).sum()) + float(batch[PROMPT_MASK].sum())
        if timer.seconds.get("gen"):  # (a step of groups completed in flight earlier generates nothing)
            metrics["perf/gen_tokens_per_s"] = resp_tokens / timer.seconds["gen"]
        if "update_actor" in timer.seconds:
            metrics["perf/train_tokens_per_s"] = all_tokens / max(timer.seconds["update_actor"], 1e-9)
        if ROLLOUT_LOG_PROBS in batch and OLD_LOG_PROBS in batch:  # else the update reports it
            metrics["rollout/logp_diff"] = float(
                ((batch[ROLLOUT_LOG_PROBS] - batch[OLD_LOG_PROBS]).abs() * batch[RESPONSE_MASK]).sum()
                / max(resp_tokens, 1.0))
        metrics.update(self.span_log.record_step(self.step, timer, step_seconds, int(resp_tokens), int(all_tokens),
                                                 groups=self.groups))
        metrics.update(step_perf_metrics(self.setup.model_path, self.setup.plan, self.cfg.model.dtype,
                                         self.cfg.algorithm.epochs, batch, metrics, self.shared_prompt_roles))
        metrics.update(peak_memory_metrics(self.groups))
        metrics.update(gc_pause_metrics(self.groups))
        return metrics

    def _mini_batch_updates(self, role: str, batch: Batch, mini_batch: int | None, log: StepLog,
                            update: Callable[[WorkerGroup, Batch], Result]) -> dict[str, float]:
        """``algorithm.epochs`` passes over the batch in mini-batches of ``mini_batch`` sequences (default:
        the whole batch), one optimizer step each; metrics averaged over the steps, prefixed ``<role>/``."""
        group = self.groups[role]
        size = mini_batch or len(batch)
        rows: list[dict[str, float]] = []
        generator = torch.Generator().manual_seed(self.cfg.trainer.seed * 7919 + self.step)
        for epoch in range(self.cfg.algorithm.epochs):
            order = torch.randperm(len(batch), generator=generator) if epoch > 0 else torch.arange(len(batch))
            for start in range(0, len(batch), size):
                rows.append(log.took(f"update_{role}", update(group, batch.index(order[start:start + size]))))
        averaged = average_metrics(rows)
        return {k if "/" in k else f"{role}/{k}": v for k, v in averaged.items()}

    def update_actor(self, batch: Batch, log: StepLog) -> dict[str, float]:
        optional = [k for k in (OLD_LOG_PROBS, REF_LOG_PROBS, ROLLOUT_LOG_PROBS, ROUTED_EXPERTS) if k in batch]
        masked: dict[str, float] = {}
        if self.cfg.algorithm.overlong.mode == "mask" and TRUNCATED in batch:
            # truncated rows leave the loss; their scores already served their groups' baselines
            kept = torch.nonzero(~batch[TRUNCATED]).flatten()
            masked["overlong/masked_share"] = 1.0 - len(kept) / max(len(batch), 1)
            if len(kept) == 0:
                return masked
            batch = batch.index(kept)
        batch = self.actor_view(batch, (*sequence_keys(batch), ADVANTAGES, *optional))
        return masked | self._mini_batch_updates(
            "actor", batch, self.cfg.roles.actor.mini_batch, log,
            lambda group, mini: group.call("actor", "update", mini, self.policy_objective,
                                           zero_pad_keys=(RESPONSE_MASK,)))

    def actor_view(self, batch: Batch, keys: tuple[str, ...]) -> Batch:
        """``keys`` of ``batch`` for the actor's forward: with the rollout's routing (``routed_experts``) when it
        returned it, and whether to replay it (``algorithm.routing_replay``) or only measure the mismatch."""
        routing = tuple(k for k in (ROUTED_EXPERTS, PROMPT_ROUTED_EXPERTS) if k in batch)
        view = batch.select(*dict.fromkeys((*keys, *routing)))
        if ROUTED_EXPERTS in batch:
            view.info["routing_replay"] = self.cfg.algorithm.routing_replay
        return view

    def update_critic(self, batch: Batch, log: StepLog) -> dict[str, float]:
        """The critic regresses its values on the returns (value clipping around the values it gave)."""
        critic_cfg = self.cfg.roles.critic
        aggregation = self.registry.get("loss_aggregation", critic_cfg.loss_agg)
        objective = ValueObjective(critic_cfg.cliprange_value, aggregation)
        mini_batch = critic_cfg.mini_batch or self.cfg.roles.actor.mini_batch
        metrics = self._mini_batch_updates(
            "critic", batch.select(*sequence_keys(batch), VALUES, RETURNS), mini_batch,
            log, lambda group, mini: group.call("critic", "update", mini, objective, zero_pad_keys=(RESPONSE_MASK,)))
        metrics.update(value_metrics(batch[VALUES], batch[RETURNS], batch[RESPONSE_MASK]))
        return metrics

    def check_sync(self, batch: Batch) -> dict[str, float]:
        """The rollout's greedy tokens on a few of ``batch``'s prompts against the actor's argmax
        (``hybridrl.weights.sync_check``); warns when a token is off by more than a near-tie."""
        prompts = self.sync_check.prompts(batch)
        params = self.sync_check.params(self.sampling)
        generated = self.groups["rollout"].call("rollout", "generate", prompts, params).value
        prompts.update(generated)
        prompts.info["temperature"] = 1.0
        margins = self.groups["actor"].call("actor", "compute_greedy_margins",
                                            prompts.select(*sequence_keys(prompts))).value
        metrics = self.sync_check.metrics(generated, margins[GREEDY_MARGIN])
        if metrics["sync_check/off_argmax"] > 0:
            log.warning("step %d: after the weight sync %d of %d greedy rollout tokens are not the actor's argmax "
                        "(largest logit gap %.3f): the rollout may not hold the actor's weights", self.step + 1,
                        int(metrics["sync_check/off_argmax"]), int(metrics["sync_check/tokens"]),
                        metrics["sync_check/max_gap"])
        return metrics

    def greedy_baseline(self, batch: Batch, log: StepLog) -> dict[str, float]:
        """ReMax: one greedy response per prompt, scored like the samples; its reward is the baseline of
        every sample of that prompt (``baseline_scores``, (B,))."""
        groups = batch[GROUP_INDEX].tolist()
        first = first_row_of_each_group(groups)
        prompts = batch.index(list(first.values())).select(PROMPT_IDS, PROMPT_MASK, PROMPT_TEXT, META)
        greedy = dataclasses.replace(self.sampling, temperature=0.0, seed=None)
        prompts.update(log.took("gen_baseline", self.groups["rollout"].call(
            "rollout", "generate", prompts.select(PROMPT_IDS, PROMPT_MASK), greedy)))
        scored = self.scorer(prompts)
        by_group = dict(zip(first, scored.scores.tolist()))
        batch.set(BASELINE_SCORES, torch.tensor([by_group[g] for g in groups], dtype=torch.float32))
        return {"reward/greedy_baseline_mean": float(scored.scores.mean())}

    def score(self, batch: Batch, log: StepLog) -> dict[str, float]:
        """Rule rewards and/or the reward model; the score sits on each response's last token."""
        scored = self.scorer(batch)
        if scored.model_compute_s is not None:
            log.compute["reward"] = scored.model_compute_s
        scores, mask = scored.scores + Episodes.reward(batch), batch[RESPONSE_MASK]
        batch.set(RESPONSE_TEXT, scored.texts)
        batch.set(SCORES, scores)
        batch.set(TOKEN_REWARDS, on_last_token(scores, mask))
        lengths = response_attention_mask(batch).sum(-1)  # a multi-turn row's observations included
        clipped = truncated_rows(batch[RESPONSE_IDS], mask, lengths, self.eos_id)
        batch.set(TRUNCATED, clipped)
        overlong = self.cfg.algorithm.overlong
        if overlong.mode == "penalty":
            penalty = soft_overlong_penalty(lengths, self.sampling.max_new_tokens, overlong.buffer,
                                            overlong.max_penalty)
            scores = scores + penalty
            batch.set(SCORES, scores)
            batch.set(TOKEN_REWARDS, on_last_token(scores, mask))
        metrics = {"reward/mean": scores.mean().item(), "reward/max": scores.max().item(),
                   "reward/min": scores.min().item(), "reward/std": scores.std().item() if len(scores) > 1 else 0.0,
                   "response_length/mean": lengths.float().mean().item(), "response_length/max": lengths.max().item(),
                   "response_length/clip_ratio": clipped.float().mean().item()}
        if overlong.mode == "penalty":
            metrics["overlong/penalty_mean"] = penalty.mean().item()
        if "model" in scored.parts or len(scored.parts) > 1:
            metrics.update({f"reward/{name}_mean": part.mean().item() for name, part in scored.parts.items()})
        metrics.update(scored.metrics)  # reward/errors, reward/timeouts, reward/<data_source>/mean
        metrics.update(identical_groups_metrics(batch, self.identical_groups, self.cfg.roles.rollout.temperature,
                                                self.cfg.algorithm.n_samples))
        metrics.update(Episodes.metrics(batch, self.groups["rollout"].dp_size("rollout")))  # turns, tools, timing/env
        return metrics

    def advantages(self, batch: Batch) -> dict[str, float]:
        token_rewards = batch[TOKEN_REWARDS]
        mask = batch[RESPONSE_MASK]
        out: dict[str, float] = {}
        if self.kl_in_reward and REF_LOG_PROBS in batch:
            kl = self.kl_fn(batch[OLD_LOG_PROBS], batch[REF_LOG_PROBS]) * mask
            token_rewards = token_rewards - self.kl_ctrl.coef * kl
            sequence_kl = float(kl.sum(-1).mean())
            out.update({"kl/reward_penalty": float(kl.sum() / mask.sum().clamp(min=1)), "kl/sequence_kl": sequence_kl,
                        "kl/coef": self.kl_ctrl.coef})
            self.kl_ctrl.update(sequence_kl, len(batch))
        algo = self.cfg.algorithm
        inputs = AdvantageInputs(token_rewards=token_rewards, response_mask=mask, group_index=batch[GROUP_INDEX],
                                 values=batch[VALUES] if VALUES in batch else None, norm_by_std=algo.norm_adv_by_std,
                                 options=algo.options, gamma=algo.gamma, lam=algo.lam,
                                 baseline_scores=batch[BASELINE_SCORES] if BASELINE_SCORES in batch else None)
        adv, returns = self.advantage_fn(inputs)
        batch.set(ADVANTAGES, adv)
        batch.set(RETURNS, returns)
        out["adv/mean"] = float(adv[mask.bool()].mean()) if mask.any() else 0.0
        return out

    # --- loop -----------------------------------------------------------------------------------------
    def arm_profile(self) -> None:
        """Every worker profiles its next call of each ``trainer.profile_calls`` (``hybridrl.observe.profile``)."""
        out = str(Path(self.cfg.trainer.out) / "profile")
        for group in unique_groups(self.groups):
            group.call_all("arm_profile", list(self.cfg.trainer.profile_calls), out, self.step + 1)

    def fit(self) -> list[dict[str, float]]:
        """Train to ``trainer.steps``: log each step, save when due, stop cleanly on Ctrl-C (after saving) or
        after ``trainer.max_bad_steps`` bad steps in a row."""
        from hybridrl.observe.console import progress_bar

        tcfg = self.cfg.trainer
        history, finished = [], False
        bar = progress_bar(tcfg.steps, self.step, wanted=tcfg.progress)  # on a terminal only
        try:
            with self.guard.guarding(self.groups, lambda: self.step + 1):
                before = self.validator.maybe_run(0) if self.validator is not None and self.step == 0 else {}
                if before:  # logged as step 0
                    for tracker in self.trackers:
                        tracker.log(before, 0)
                while self.step < tcfg.steps:
                    if self.step + 1 == tcfg.profile_step:
                        self.arm_profile()
                    metrics = self.train_step()
                    if self.validator is not None:
                        metrics.update(self.validator.maybe_run(self.step))
                    bad = self.guard.observe(self.step, metrics)
                    history.append(metrics)
                    if self.step % tcfg.log_every == 0 or self.step == tcfg.steps:
                        for tracker in self.trackers:
                            tracker.log(metrics, self.step)
                        self.write_samples()
                    bar.update(1)
                    bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", step_s=f"{metrics['timing/step']:.2f}")
                    self.guard.check(self.step, bad)
                    self.checkpointer.maybe_save(self.step, self, self.groups)
                    if self.guard.stop_requested:
                        self.stop_on_interrupt()
                        break
            finished = True
        finally:
            bar.close()
            for tracker in self.trackers:
                try:
                    tracker.close()
                except OSError as exc:  # a full disk: the error in flight (if any) says so; do not mask it
                    if finished:
                        raise
                    log.warning("could not close the %s tracker: %s", type(tracker).__name__, exc)
        return history

    def save(self) -> Path:
        return self.checkpointer.save(self.step, self, self.groups)

    def save_copy(self, folder: Path, extra: dict[str, Any]) -> Path:
        """This step's checkpoint in a run folder of its own (its newest only), ``extra`` added to its summary:
        how validation keeps the best one (``trainer.keep_best``)."""
        return Checkpointer(folder, 1, {**self.checkpointer.summary, **extra}).save(self.step, self, self.groups)

    def stop_on_interrupt(self) -> None:
        """Ctrl-C: the step in flight has finished; save it (unless just saved) and stop."""
        self.interrupted = True
        if self.checkpointer.last_saved_step != self.step and trained_roles(self.groups):
            self.save()
        log.info("stopped at step %d on %s; rerun the same command to resume", self.step,
                 signal_name(self.guard.stop_signal))

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        self.scorer.close()
        for group in unique_groups(self.groups):
            for w in group.workers:
                ray.kill(w)
        for pg in self.placement_groups:
            remove_placement_group(pg)
        self.groups, self.placement_groups = {}, []
        from hybridrl.run.run_lock import release

        release(self.cfg.trainer.out)  # the run has ended: its folder's lock (hybridrl.run.run_lock) goes
