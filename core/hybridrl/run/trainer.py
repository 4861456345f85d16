"""The RL training loop (driver side): one GRPO/PPO-style step is a fixed sequence of timed phases.

gen [-> gen_baseline (ReMax)] -> reward -> ref -> old_log_prob [-> values (critic)] -> adv
[-> update_critic] -> update_actor -> reshard. ``generate_batch`` and ``train_on`` are the two halves that both
the synchronous step and the pipelined one (``hybridrl.run.pipeline``) are made of. Scoring lives in
``hybridrl.rewards.scorer``, the algorithm pieces in ``hybridrl.algorithms``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from hybridrl.algorithms.advantages import AdvantageInputs
from hybridrl.algorithms.kl_control import build_kl_controller
from hybridrl.algorithms.objective import ValueObjective, resolve_algorithm
from hybridrl.batch import (ADVANTAGES, OLD_LOG_PROBS, PROMPT_IDS, PROMPT_MASK, REF_LOG_PROBS, RESPONSE_IDS,
                            RESPONSE_MASK, RETURNS, ROLLOUT_LOG_PROBS, SCORES, TOKEN_REWARDS, Batch,
                            first_row_of_each_group, left_pad)
from hybridrl.weights.bridges import transport_for
from hybridrl.runtime.group import WorkerGroup, average_metrics
from hybridrl.engines import VALUES, SamplingParams
from hybridrl.observe.flops import step_perf_metrics
from hybridrl.runtime.launch import build_engines, start_worker_groups
from hybridrl.run.pipeline import GenerationJob, needs_sync, staleness_of
from hybridrl.run.preflight import RunSetup
from hybridrl.run.state import RunState
from hybridrl.rewards.scorer import RewardScorer, on_last_token
from hybridrl.weights.sync_check import GREEDY_MARGIN, SyncCheck
from hybridrl.observe.timing import PhaseTimer


SEQUENCE_KEYS = (PROMPT_IDS, PROMPT_MASK, RESPONSE_IDS, RESPONSE_MASK)


def value_metrics(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Explained variance of the returns by the values the advantages used, ``1 - Var(R - V) / Var(R)``
    over response tokens (1: perfect, 0: no better than a constant, < 0: worse), and their means."""
    m = mask.bool()
    v, r = values[m].double(), returns[m].double()
    var_r = r.var() if r.numel() > 1 else torch.zeros((), dtype=torch.float64)
    explained = 1.0 - float((r - v).var() / var_r) if r.numel() > 1 and var_r > 1e-12 else 0.0  # constant returns: 0
    return {"critic/explained_var": explained, "critic/values_mean": float(v.mean()) if v.numel() else 0.0,
            "critic/returns_mean": float(r.mean()) if r.numel() else 0.0}


def old_log_probs_needed(cfg: Any, kl_in_reward: bool) -> bool:
    """Whether the actor's log-probs before the update need a pass of their own. With one optimizer step per
    batch they equal the update's own log-probs (same weights, same tokens), which the objective then uses
    under a stop-gradient: the pass is skipped. KL folded into the reward reads them before the update."""
    algo = cfg.algorithm
    mini = cfg.roles.actor.mini_batch
    one_step = algo.epochs == 1 and (mini is None or mini >= cfg.data.prompts_per_step * algo.n_samples)
    return algo.old_log_probs == "recompute" or not one_step or kl_in_reward


@dataclass
class StepLog:
    """What one step records as it goes: wall time per phase, model compute time per phase, metrics."""

    timer: PhaseTimer = field(default_factory=PhaseTimer)
    compute: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


class Trainer:
    """Drives the worker groups through training steps and logs every phase."""

    def __init__(self, setup: RunSetup) -> None:
        from hybridrl.data.loading import PromptLoader

        self.setup = setup
        self.cfg = setup.cfg
        self.registry = setup.registry
        self.algo = resolve_algorithm(self.cfg.algorithm, self.registry)
        self.tokenizer = setup.tokenizer
        self.loader = PromptLoader(setup.prompts, self.cfg.data.prompts_per_step, self.cfg.trainer.seed,
                                   self.cfg.data.shuffle)
        self.advantage_fn = self.registry.get("advantage", self.algo.advantage)
        kl_cfg = self.cfg.algorithm.kl
        self.kl_fn = self.registry.get("kl_estimator", kl_cfg.estimator) if kl_cfg is not None and kl_cfg.coef > 0 else None
        self.kl_in_reward = self.kl_fn is not None and kl_cfg.apply_as == "reward"
        self.kl_ctrl = build_kl_controller(kl_cfg) if self.kl_in_reward else None
        self.scorer = RewardScorer(self.tokenizer, setup.reward_fn)
        r = self.cfg.roles.rollout
        self.sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                       max_new_tokens=r.max_new_tokens, min_new_tokens=r.min_new_tokens,
                                       ignore_eos=r.ignore_eos, logprobs=r.log_probs)
        self.recompute_old_log_probs = old_log_probs_needed(self.cfg, self.kl_in_reward)
        self.groups: dict[str, WorkerGroup] = {}
        self.placement_groups: list[Any] = []
        self.last_batch: Batch | None = None
        self.trackers: list[Any] = []
        self.step = 0
        self.run_state = RunState(self)  # checkpoints, resume, faults (hybridrl.run.state)
        self.actor_version = 0  # actor updates so far
        self.rollout_version = 0  # the actor version whose weights the rollout holds
        self.next_generation: GenerationJob | None = None  # pipelined: the batch being generated ahead
        self.sync_check = SyncCheck.for_dtype(self.cfg.trainer.sync_check_every, self.cfg.model.dtype)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.eos_id = self.tokenizer.eos_token_id

    # --- set-up ---------------------------------------------------------------------------------------
    def start(self) -> None:
        out = Path(self.cfg.trainer.out)
        out.mkdir(parents=True, exist_ok=True)
        resume_from = self.run_state.resume_point()
        if resume_from is None:
            (out / "samples.jsonl").write_text("")
        (out / "config.json").write_text(json.dumps(self.cfg.model_dump(mode="json", by_alias=True), indent=2))
        print(self.setup.plan.render(), flush=True)
        for note in self.setup.notes:
            print(f"note: {note}", flush=True)
        if self.setup.dropped_prompts:
            print(f"data: dropped {self.setup.dropped_prompts} prompt(s) longer than data.max_prompt_len", flush=True)
        print("starting workers ...", flush=True)
        t0 = time.perf_counter()
        self.groups, self.placement_groups = start_worker_groups(self.cfg, self.setup.plan)
        print(f"building engines from {self.setup.model_path} ...", flush=True)
        build_engines(self.cfg, self.setup.plan, self.groups, self.setup.model_path, self.setup.role_model_paths)
        if "reward" in self.groups:
            self.scorer.model_group = self.groups["reward"]
            self.scorer.model_coef = self.cfg.roles.reward.model.coef
        self.rollout_colocated = any(self.setup.plan.colocated("rollout", r) for r in self.groups if r != "rollout")
        plan = self.setup.plan
        transport = self.cfg.roles.rollout.weight_transport
        if transport == "auto":
            transport = transport_for(plan.same_process("actor", "rollout"), plan.colocated("actor", "rollout"),
                                      plan.cluster.device)
        actor_backend = self.setup.plan.group_of("actor").roles["actor"]
        rollout_backend = self.setup.plan.group_of("rollout").roles["rollout"]
        self.bridge = self.registry.bridge(actor_backend, rollout_backend, transport).target()
        self.bucket_bytes = int(self.cfg.roles.rollout.bucket_mb * 2**20)
        if resume_from is not None:
            self.run_state.restore(resume_from)
        self.sync_weights()  # the rollout starts from exactly the actor's weights
        if self.rollout_colocated:
            self.groups["rollout"].call_all("call", "rollout", "sleep")
        print(f"workers ready in {time.perf_counter() - t0:.1f}s", flush=True)
        self.trackers = self.run_state.make_trackers()

    def sync_weights(self) -> dict[str, float]:
        return self.bridge.sync(self.groups["actor"], "actor", self.groups["rollout"], "rollout", self.bucket_bytes)

    # --- one step -------------------------------------------------------------------------------------
    def prompt_batch(self) -> Batch:
        rows = next(self.loader)
        ids, mask = left_pad([r.token_ids for r in rows], self.pad_id)
        n = self.cfg.algorithm.n_samples
        batch = Batch.from_tensors({PROMPT_IDS: ids, PROMPT_MASK: mask},
                                   {"prompt": [r.prompt for r in rows], "meta": [r.meta for r in rows]})
        batch = batch.repeat_interleave(n)
        batch.set("group_index", torch.arange(len(rows)).repeat_interleave(n))
        batch.info["temperature"] = self.sampling.temperature if self.sampling.temperature > 0 else 1.0
        return batch

    def write_samples(self) -> None:
        """A few (prompt, response, score) triples of the last step, for reading what the policy does."""
        batch, n = self.last_batch, self.cfg.trainer.log_samples
        if batch is None or n == 0:
            return
        stride = max(1, len(batch) // n)
        with (Path(self.cfg.trainer.out) / "samples.jsonl").open("a") as f:
            for i in range(0, len(batch), stride)[:n]:
                f.write(json.dumps({"step": self.step, "prompt": batch["prompt"][i],
                                    "response": batch["response_text"][i], "score": float(batch[SCORES][i])}) + "\n")

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
                job = self.submit_generation(self.prompt_batch(), self.step)
        with log.timer.phase("gen_wait"):
            batch = self.collect_generation(job, log)
        log.timer.record("gen", log.compute["gen"])  # the rollout's own time; it overlapped the previous step
        staleness = staleness_of(job, self.actor_version, bound)
        stats = {"bytes": 0.0}
        if self.step + 1 < self.cfg.trainer.steps:
            if needs_sync(self.actor_version, self.rollout_version, bound):
                with log.timer.phase("reshard"):
                    stats = self.sync_weights()
                self.rollout_version = self.actor_version
            with log.timer.phase("data"):
                self.next_generation = self.submit_generation(self.prompt_batch(), self.step + 1)
        with log.timer.phase("reward"):
            log.metrics.update(self.score(batch))
            if "reward" in self.groups:
                log.compute["reward"] = self.scorer.compute_s
        self.train_on(batch, log)
        step_seconds = time.perf_counter() - step_start
        metrics = self.finish_step(batch, log, step_seconds, stats)
        serial = sum(v for k, v in log.timer.seconds.items() if k != "gen_wait")
        metrics["timing/overlap_saved"] = serial - step_seconds
        metrics["async/staleness"] = float(staleness)
        metrics["async/weights_version"] = float(job.version)
        return metrics

    # --- the pieces of a step -------------------------------------------------------------------------
    def submit_generation(self, batch: Batch, step: int) -> GenerationJob:
        """Dispatch the generation of ``batch`` (the prompts of ``step``) without waiting for it."""
        params = SamplingParams(**{**self.sampling.__dict__, "seed": self.cfg.trainer.seed * 100_003 + step})
        pending = self.groups["rollout"].submit("rollout", "generate", batch.select(PROMPT_IDS, PROMPT_MASK), params)
        return GenerationJob(batch, step, self.rollout_version, pending)

    def collect_generation(self, job: GenerationJob, log: StepLog) -> Batch:
        """Wait for a submitted generation; its responses join the prompt batch."""
        rollout = self.groups["rollout"]
        job.batch.update(rollout.gather(job.pending))
        log.compute["gen"] = rollout.last_compute_s
        return job.batch

    def generate_batch(self, log: StepLog) -> Batch:
        """Prompts -> responses (-> greedy baseline) -> scores, waiting for each phase (the synchronous step)."""
        timer, compute, metrics = log.timer, log.compute, log.metrics
        with timer.phase("data"):
            batch = self.prompt_batch()
        rollout = self.groups["rollout"]
        if self.rollout_colocated:
            with timer.phase("wake"):
                rollout.call_all("call", "rollout", "wake")
        if self.sync_check.due(self.step):
            with timer.phase("sync_check"):
                metrics.update(self.check_sync(batch))
        with timer.phase("gen"):
            batch = self.collect_generation(self.submit_generation(batch, self.step), log)
        if self.algo.greedy_baseline:
            with timer.phase("gen_baseline"):
                metrics.update(self.greedy_baseline(batch))
                compute["gen_baseline"] = rollout.last_compute_s
        if self.rollout_colocated:
            with timer.phase("sleep"):
                rollout.call_all("call", "rollout", "sleep")
        with timer.phase("reward"):
            metrics.update(self.score(batch))
            if "reward" in self.groups:
                compute["reward"] = self.scorer.compute_s
        return batch

    def train_on(self, batch: Batch, log: StepLog) -> bool:
        """Reference and old log-probs (values), advantages, critic and actor updates on a scored batch.
        Returns whether the actor was updated (not during the critic's warm-up); the reshard is the caller's."""
        timer, compute, metrics = log.timer, log.compute, log.metrics
        if "ref" in self.groups and self.algo.uses_ref:
            with timer.phase("ref"):
                ref = self.groups["ref"].run("ref", "compute_log_probs", batch.select(*SEQUENCE_KEYS))
                batch.set(REF_LOG_PROBS, ref["log_probs"])
                compute["ref"] = self.groups["ref"].last_compute_s
        actor = self.groups["actor"]
        if self.recompute_old_log_probs:
            with timer.phase("old_log_prob"):
                old = actor.run("actor", "compute_log_probs", batch.select(*SEQUENCE_KEYS))
                batch.set(OLD_LOG_PROBS, old["log_probs"])
                compute["old_log_prob"] = actor.last_compute_s
        critic = self.groups.get("critic")
        if critic is not None:
            with timer.phase("values"):
                batch.set(VALUES, critic.run("critic", "compute_values", batch.select(*SEQUENCE_KEYS))[VALUES])
                compute["values"] = critic.last_compute_s
        with timer.phase("adv"):
            metrics.update(self.advantages(batch))
        if critic is not None:
            with timer.phase("update_critic"):
                metrics.update(self.update_critic(batch))
                compute["update_critic"] = self.update_compute_s
        if critic is not None and self.step < self.cfg.algorithm.critic_warmup:  # the critic may learn alone at first
            return False
        with timer.phase("update_actor"):
            metrics.update(self.update_actor(batch))
            compute["update_actor"] = self.update_compute_s
        self.actor_version += 1
        return True

    def finish_step(self, batch: Batch, log: StepLog, step_seconds: float, reshard: dict[str, float]) -> dict[str, float]:
        """Close the step (counter, last batch) and derive its timing, throughput and performance metrics."""
        timer, compute, metrics = log.timer, log.compute, log.metrics
        self.step += 1
        self.last_batch = batch
        metrics.update(timer.metrics())
        metrics["timing/step"] = step_seconds
        metrics.update({f"compute/{k}": v for k, v in compute.items()})
        metrics["perf/overhead_fraction"] = max(0.0, 1.0 - sum(compute.values()) / step_seconds)
        metrics.update({f"reshard/{k}": float(v) for k, v in reshard.items()})
        resp_tokens = float(batch[RESPONSE_MASK].sum())
        all_tokens = resp_tokens + float(batch[PROMPT_MASK].sum())
        metrics["perf/gen_tokens_per_s"] = resp_tokens / max(timer.seconds["gen"], 1e-9)
        if "update_actor" in timer.seconds:
            metrics["perf/train_tokens_per_s"] = all_tokens / max(timer.seconds["update_actor"], 1e-9)
        if ROLLOUT_LOG_PROBS in batch and OLD_LOG_PROBS in batch:  # else the update reports it
            metrics["rollout/logp_diff"] = float(
                ((batch[ROLLOUT_LOG_PROBS] - batch[OLD_LOG_PROBS]).abs() * batch[RESPONSE_MASK]).sum()
                / max(resp_tokens, 1.0))
        metrics.update(step_perf_metrics(self, batch, metrics))  # MFU per phase, peak memory per role
        return metrics

    def _mini_batch_updates(self, role: str, batch: Batch, mini_batch: int | None,
                            call: Callable[[WorkerGroup, Batch], dict[str, float]]) -> dict[str, float]:
        """``algorithm.epochs`` passes over the batch in mini-batches of ``mini_batch`` sequences (default:
        the whole batch), one optimizer step each; metrics averaged over the steps, prefixed ``<role>/``."""
        group = self.groups[role]
        size = mini_batch or len(batch)
        rows: list[dict[str, float]] = []
        self.update_compute_s = 0.0
        generator = torch.Generator().manual_seed(self.cfg.trainer.seed * 7919 + self.step)
        for epoch in range(self.cfg.algorithm.epochs):
            order = torch.randperm(len(batch), generator=generator) if epoch > 0 else torch.arange(len(batch))
            for start in range(0, len(batch), size):
                rows.append(call(group, batch.index(order[start:start + size])))
                self.update_compute_s += group.last_compute_s
        averaged = average_metrics(rows)
        return {k if "/" in k else f"{role}/{k}": v for k, v in averaged.items()}

    def update_actor(self, batch: Batch) -> dict[str, float]:
        algo_cfg = self.cfg.algorithm.model_dump(by_alias=True)
        optional = [k for k in (OLD_LOG_PROBS, REF_LOG_PROBS, ROLLOUT_LOG_PROBS) if k in batch]
        batch = batch.select(*SEQUENCE_KEYS, ADVANTAGES, *optional)
        return self._mini_batch_updates(
            "actor", batch, self.cfg.roles.actor.mini_batch,
            lambda group, mini: group.run("actor", "update", mini, "policy", algo_cfg, worker_method="update",
                                          zero_pad_keys=(RESPONSE_MASK,)))

    def update_critic(self, batch: Batch) -> dict[str, float]:
        """The critic regresses its values on the returns (value clipping around the values it gave)."""
        critic_cfg = self.cfg.roles.critic
        objective = ValueObjective(critic_cfg.cliprange_value, self.registry.get("loss_aggregation", critic_cfg.loss_agg))
        metrics = self._mini_batch_updates(
            "critic", batch.select(*SEQUENCE_KEYS, VALUES, RETURNS), critic_cfg.mini_batch or self.cfg.roles.actor.mini_batch,
            lambda group, mini: group.run("critic", "update", mini, objective, zero_pad_keys=(RESPONSE_MASK,)))
        metrics.update(value_metrics(batch[VALUES], batch[RETURNS], batch[RESPONSE_MASK]))
        return metrics

    def check_sync(self, batch: Batch) -> dict[str, float]:
        """The rollout's greedy tokens on a few of ``batch``'s prompts against the actor's argmax
        (``hybridrl.weights.sync_check``); warns when a token is off by more than a near-tie."""
        prompts = self.sync_check.prompts(batch)
        generated = self.groups["rollout"].run("rollout", "generate", prompts, self.sync_check.params(self.sampling))
        prompts.update(generated)
        prompts.info["temperature"] = 1.0
        try:
            margins = self.groups["actor"].run("actor", "compute_greedy_margins", prompts.select(*SEQUENCE_KEYS))
        except Exception as exc:  # noqa: BLE001 - an engine without margins: say so once and stop checking
            if "greedy margins" not in str(exc):
                raise
            print("note: trainer.sync_check_every is off: the actor's engine does not score greedy margins", flush=True)
            self.sync_check.every = 0
            return {}
        metrics = self.sync_check.metrics(generated, margins[GREEDY_MARGIN])
        if metrics["sync_check/off_argmax"] > 0:
            print(f"warning: step {self.step + 1}: after the weight sync {int(metrics['sync_check/off_argmax'])} of "
                  f"{int(metrics['sync_check/tokens'])} greedy rollout tokens are not the actor's argmax (largest "
                  f"logit gap {metrics['sync_check/max_gap']:.3f}): the rollout may not hold the actor's weights",
                  flush=True)
        return metrics

    def greedy_baseline(self, batch: Batch) -> dict[str, float]:
        """ReMax: one greedy response per prompt, scored like the samples; its reward is the baseline of
        every sample of that prompt (``baseline_scores``, (B,))."""
        groups = batch["group_index"].tolist()
        first = first_row_of_each_group(groups)
        prompts = batch.index(list(first.values())).select(PROMPT_IDS, PROMPT_MASK, "prompt", "meta")
        greedy = SamplingParams(**{**self.sampling.__dict__, "temperature": 0.0, "seed": None})
        prompts.update(self.groups["rollout"].run("rollout", "generate", prompts.select(PROMPT_IDS, PROMPT_MASK), greedy))
        scores, _, _ = self.scorer(prompts)
        by_group = dict(zip(first, scores.tolist()))
        batch.set("baseline_scores", torch.tensor([by_group[g] for g in groups], dtype=torch.float32))
        return {"reward/greedy_baseline_mean": float(scores.mean())}

    def score(self, batch: Batch) -> dict[str, float]:
        """Rule rewards and/or the reward model; the score sits on each response's last token."""
        scores, texts, parts = self.scorer(batch)
        mask = batch[RESPONSE_MASK]
        batch.set("response_text", texts)
        batch.set(SCORES, scores)
        batch.set(TOKEN_REWARDS, on_last_token(scores, mask))
        lengths = mask.sum(-1)
        max_len = self.sampling.max_new_tokens
        finished = ((batch[RESPONSE_IDS] == self.eos_id) & mask.bool() if self.eos_id is not None
                    else torch.zeros_like(mask).bool())
        clipped = (lengths >= max_len) & ~finished.any(-1)
        metrics = {"reward/mean": scores.mean().item(), "reward/max": scores.max().item(),
                   "reward/min": scores.min().item(), "reward/std": scores.std().item() if len(scores) > 1 else 0.0,
                   "response_length/mean": lengths.float().mean().item(), "response_length/max": lengths.max().item(),
                   "response_length/clip_ratio": clipped.float().mean().item()}
        if "model" in parts:
            metrics.update({f"reward/{name}_mean": part.mean().item() for name, part in parts.items()})
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
        inputs = AdvantageInputs(token_rewards=token_rewards, response_mask=mask, group_index=batch["group_index"],
                                 values=batch[VALUES] if VALUES in batch else None, norm_by_std=algo.norm_adv_by_std,
                                 options=algo.options, gamma=algo.gamma, lam=algo.lam,
                                 baseline_scores=batch["baseline_scores"] if "baseline_scores" in batch else None)
        adv, returns = self.advantage_fn(inputs)
        batch.set(ADVANTAGES, adv)
        batch.set(RETURNS, returns)
        out["adv/mean"] = float(adv[mask.bool()].mean()) if mask.any() else 0.0
        return out

    # --- loop -----------------------------------------------------------------------------------------
    def fit(self) -> list[dict[str, float]]:
        from tqdm import tqdm

        history = []
        bar = tqdm(total=self.cfg.trainer.steps, initial=self.step, desc="train", unit="step",
                   disable=not self.cfg.trainer.progress, dynamic_ncols=True)
        try:
            with self.run_state.guarding():  # Ctrl-C: stop cleanly; a dead worker: a clear error
                while self.step < self.cfg.trainer.steps:
                    metrics = self.train_step()
                    bad = self.run_state.observe(metrics)
                    metrics["perf/peak_mem_mb"] = max(
                        max(g.call_all("peak_memory_mb")) for g in {id(g): g for g in self.groups.values()}.values())
                    history.append(metrics)
                    if self.step % self.cfg.trainer.log_every == 0 or self.step == self.cfg.trainer.steps:
                        for tracker in self.trackers:
                            tracker.log(metrics, self.step)
                        self.write_samples()
                    bar.update(1)
                    bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", step_s=f"{metrics['timing/step']:.2f}")
                    if self.run_state.end_of_step(bad):  # save when due; Ctrl-C; too many bad steps
                        break
        finally:
            bar.close()
            for tracker in self.trackers:
                tracker.close()
        return history

    def shutdown(self) -> None:
        import ray

        from ray.util.placement_group import remove_placement_group

        for group in {id(g): g for g in self.groups.values()}.values():
            for w in group.workers:
                ray.kill(w)
        for pg in self.placement_groups:
            remove_placement_group(pg)
        self.groups, self.placement_groups = {}, []
