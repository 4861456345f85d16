"""Validation on held-out prompts (``data.val``): generate, score with the run's rewards, report, keep the best.

When: before the first step (``trainer.val_before_train``), every ``trainer.val_every`` steps and after the
last one. How: ``trainer.val_n`` responses per prompt at ``trainer.val_temperature`` (one greedy response by
default), in batches of the training batch's size, with a fixed seed so that two validations of the same
weights give the same figures. The rollout generates with the weights it holds: after a synchronous step
those of the update just made; with ``trainer.pipelined``, weights up to ``trainer.max_staleness`` updates older.

Metrics (logged with the step's own, and shown by ``hybridrl report``):

- ``val/reward/mean``: the mean score of every response (mean@k);
- ``val/pass@k``: the share of prompts with at least one response scoring ``trainer.val_pass_threshold`` or more;
- ``val/best@k`` (k > 1): the mean over prompts of their best score;
- the same per data source: ``val/<data_source>/reward/mean``, ``val/<data_source>/pass@k``;
- ``val/response_length/mean``, ``timing/val``.

``trainer.keep_best: <metric>`` keeps a checkpoint of the weights that scored best on it (highest, or lowest
with ``trainer.keep_best_mode: min``) in ``<trainer.out>/best``: a run folder of its own that ``hybridrl export
RUN/best`` reads, with ``best.json`` naming the metric, its value and the step.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hybridrl.config import RunConfig
from hybridrl.engines import SamplingParams
from hybridrl.engines.batch import MESSAGES, META, PROMPT_IDS, PROMPT_MASK, PROMPT_TEXT, RESPONSE_MASK, Batch, left_pad
from hybridrl.environments.driver import Episodes
from hybridrl.runtime.group import WorkerGroup

#: ``save_copy(folder, extra)``: the run's state after the current step as a checkpoint under ``folder`` (its
#: newest only), ``extra`` added to the checkpoint's summary; returns the checkpoint's folder.
SaveCopy = Callable[[Path, dict[str, Any]], Path]

log = logging.getLogger(__name__)

BEST = "best"
BEST_RECORD = "best.json"
VAL_SAMPLES = "val_samples.jsonl"


def metric_names(k: int, sources: set[str]) -> list[str]:
    """Every metric a validation with ``k`` responses per prompt over ``sources`` reports."""
    names = ["val/reward/mean", f"val/pass@{k}", "val/response_length/mean"] + ([f"val/best@{k}"] if k > 1 else [])
    for source in sorted(sources):
        names += [f"val/{source}/reward/mean", f"val/{source}/pass@{k}"]
    return names


def validation_problems(cfg: Any, val_prompts: list[Any] | None, trained: dict[str, str], registry: Any
                        ) -> list[tuple[str, str]]:
    """The ``trainer.val_*`` and ``keep_best`` keys against the data and backends, before anything starts."""
    t, has_val = cfg.trainer, cfg.data.val is not None or cfg.data.val_dataset_args is not None
    problems: list[tuple[str, str]] = []
    if t.val_every and not has_val:
        problems.append(("trainer.val_every", "needs validation data: set data.val (a file) or "
                                              "data.val_dataset_args"))
    if t.val_n > 1 and t.val_temperature == 0:
        problems.append(("trainer.val_n", f"{t.val_n} greedy responses per prompt would all be the same: set "
                                          "trainer.val_temperature > 0, or trainer.val_n=1"))
    if t.keep_best is not None:
        if not has_val:
            problems.append(("trainer.keep_best", "needs validation data: set data.val (a file) or "
                                                  "data.val_dataset_args"))
        elif val_prompts is not None:
            sources = {p.meta["data_source"] for p in val_prompts if isinstance(p.meta.get("data_source"), str)}
            known = metric_names(t.val_n, sources)
            if t.keep_best not in known:
                problems.append(("trainer.keep_best", f"'{t.keep_best}' is not a validation metric of this run "
                                                      f"(known: {', '.join(known)})"))
        for role, backend in trained.items():
            try:
                entry = registry.backend("train", backend)
            except Exception:  # noqa: BLE001 - an unknown backend is reported by check_config
                continue
            if not entry.can("checkpoint"):
                problems.append(("trainer.keep_best", f"the '{backend}' backend of roles.{role} cannot save "
                                                      "checkpoints"))
    return problems


class Validator:
    """The validation of one run (see the module docstring); ``maybe_run(step)`` validates when it is due and
    returns the metrics (none when not). It is given what it uses of the run, not the trainer: the config,
    the prompts, the rollout's group and sampling, the scorer, the episodes of a multi-turn run, whether the
    rollout sleeps between uses, and ``save_copy`` to keep the best checkpoint."""

    def __init__(self, cfg: RunConfig, prompts: list[Any], pad_id: int, sampling: SamplingParams,
                 rollout: WorkerGroup | None = None, scorer: Callable[[Batch], Any] | None = None,
                 episodes: Episodes | None = None, rollout_sleeps: bool = False,
                 save_copy: SaveCopy | None = None) -> None:
        self.cfg = cfg
        self.tcfg = cfg.trainer
        self.prompts = prompts
        self.pad_id = pad_id
        self.rollout, self.scorer, self.episodes, self.rollout_sleeps = rollout, scorer, episodes, rollout_sleeps
        self.save_copy = save_copy
        self.k = self.tcfg.val_n
        self.batch_prompts = max(1, (cfg.data.prompts_per_step * cfg.algorithm.n_samples) // self.k)
        temperature = self.tcfg.val_temperature
        self.params = SamplingParams(temperature=temperature, top_p=sampling.top_p if temperature > 0 else 1.0,
                                     top_k=sampling.top_k if temperature > 0 else 0,
                                     max_new_tokens=sampling.max_new_tokens, min_new_tokens=sampling.min_new_tokens,
                                     ignore_eos=sampling.ignore_eos, logprobs=False)
        self.out = Path(self.tcfg.out)
        self.best_value: float | None = None
        self.best_step: int | None = None
        self.last_step: int | None = None  # the step of the last validation (none twice for one step)
        record = self.out / BEST / BEST_RECORD
        if self.tcfg.keep_best is not None and record.is_file():  # a resumed run keeps its best so far
            try:
                saved = json.loads(record.read_text())
                if saved.get("metric") == self.tcfg.keep_best:
                    self.best_value, self.best_step = float(saved["value"]), int(saved["step"])
            except (OSError, ValueError, KeyError):
                pass

    # --- when ------------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        """Whether to validate after ``step`` steps (0: before training)."""
        if step == self.last_step:
            return False
        if step == 0:
            return self.tcfg.val_before_train
        every = self.tcfg.val_every
        return step == self.tcfg.steps or (every > 0 and step % every == 0)

    def maybe_run(self, step: int) -> dict[str, float]:
        """``run(step)`` when validation is due after ``step`` steps, else no metrics."""
        return self.run(step) if self.due(step) else {}

    # --- what ------------------------------------------------------------------------------------
    def batches(self) -> list[Batch]:
        out = []
        for start in range(0, len(self.prompts), self.batch_prompts):
            rows = self.prompts[start:start + self.batch_prompts]
            ids, mask = left_pad([r.token_ids for r in rows], self.pad_id)
            batch = Batch.from_tensors({PROMPT_IDS: ids, PROMPT_MASK: mask},
                                       {PROMPT_TEXT: [r.prompt for r in rows], META: [r.meta for r in rows],
                                        MESSAGES: [r.messages for r in rows]})
            batch = batch.repeat_interleave(self.k)
            batch.set("prompt_index", torch.arange(start, start + len(rows)).repeat_interleave(self.k))
            out.append(batch)
        return out

    def run(self, step: int) -> dict[str, float]:
        """Generate and score every validation prompt with the rollout's current weights (after ``step``
        steps); log samples; keep the best checkpoint when asked. Returns the ``val/*`` metrics and
        ``timing/val``."""
        start = time.perf_counter()
        rollout, sleeps, episodes = self.rollout, self.rollout_sleeps, self.episodes
        assert rollout is not None and self.scorer is not None, "a Validator runs with the rollout and the scorer"
        if sleeps:
            rollout.broadcast("rollout", "wake")
        scores, lengths, index, texts, metas, prompts = [], [], [], [], [], []
        try:
            for i, batch in enumerate(self.batches()):
                params = SamplingParams(**{**self.params.__dict__, "seed": self.tcfg.seed * 7_777 + i})
                if episodes is not None:  # multi-turn: the episodes are played as in training, and reward too
                    batch.update(rollout.wait(episodes.submit(rollout, batch, params)).value)
                else:
                    batch.update(rollout.call("rollout", "generate", batch.select(PROMPT_IDS, PROMPT_MASK),
                                              params).value)
                scored = self.scorer(batch)
                scores += (scored.scores + Episodes.reward(batch)).tolist()
                lengths += batch[RESPONSE_MASK].sum(-1).tolist()
                index += batch["prompt_index"].tolist()
                texts += scored.texts
                metas += batch[META]
                prompts += batch[PROMPT_TEXT]
        finally:
            if sleeps:
                rollout.broadcast("rollout", "sleep")
        metrics = self.summarize(scores, index, metas, lengths)
        metrics["timing/val"] = time.perf_counter() - start
        self.last_step = step
        self.write_samples(step, prompts, texts, scores, metas)
        log.info("validation at step %d: %s", step,
                 "  ".join(f"{k}={v:.4g}" for k, v in metrics.items() if k.count("/") == 2 or "@" in k))
        if self.tcfg.keep_best is not None and step > 0:
            self.keep_if_best(step, metrics)
        return metrics

    def summarize(self, scores: list[float], index: list[int], metas: list[dict[str, Any]],
                  lengths: list[float]) -> dict[str, float]:
        k, threshold = self.k, self.tcfg.val_pass_threshold
        per_prompt: dict[int, list[float]] = {}
        source_of: dict[int, str | None] = {}
        for score, i, meta in zip(scores, index, metas):
            per_prompt.setdefault(i, []).append(score)
            source = meta.get("data_source")
            source_of[i] = source if isinstance(source, str) else None
        metrics = _group_metrics("val", scores, per_prompt, k, threshold)
        metrics["val/response_length/mean"] = sum(lengths) / max(len(lengths), 1)
        for source in sorted({s for s in source_of.values() if s is not None}):
            groups = {i: v for i, v in per_prompt.items() if source_of[i] == source}
            flat = [s for v in groups.values() for s in v]
            sub = _group_metrics(f"val/{source}", flat, groups, k, threshold)
            metrics.update({key: value for key, value in sub.items() if not key.endswith(f"best@{k}")})
        return metrics

    # --- records -------------------------------------------------------------------------------------
    def write_samples(self, step: int, prompts: list[str], texts: list[str], scores: list[float],
                      metas: list[dict[str, Any]]) -> None:
        n = self.tcfg.log_samples
        if n == 0 or not texts:
            return
        stride = max(1, len(texts) // n)
        with (self.out / VAL_SAMPLES).open("a") as f:
            for i in list(range(0, len(texts), stride))[:n]:
                f.write(json.dumps({"step": step, "prompt": prompts[i], "response": texts[i], "score": scores[i],
                                    "ground_truth": metas[i].get("ground_truth"),
                                    "data_source": metas[i].get("data_source")}, default=str) + "\n")

    def keep_if_best(self, step: int, metrics: dict[str, float]) -> None:
        name, value = self.tcfg.keep_best, metrics.get(self.tcfg.keep_best)
        if value is None:
            return
        better = self.best_value is None or (value < self.best_value if self.tcfg.keep_best_mode == "min"
                                             else value > self.best_value)
        if not better:
            return
        assert self.save_copy is not None, "trainer.keep_best needs save_copy"
        best = self.out / BEST
        from hybridrl.run.file_modes import write_config, write_private

        folder = self.save_copy(best, {"best": {"metric": name, "value": value}})
        write_config(best / "config.json", self.cfg.model_dump(mode="json", by_alias=True))
        write_private(best / BEST_RECORD, json.dumps({"metric": name, "value": value, "step": step,
                                                      "checkpoint": str(folder)}, indent=2) + "\n")
        previous = "" if self.best_value is None else f" (was {self.best_value:.4g} at step {self.best_step})"
        self.best_value, self.best_step = value, step
        log.info("trainer.keep_best: %s=%.4g at step %d is the best so far%s: kept in %s", name, value,
                 step, previous, folder)


def _group_metrics(prefix: str, scores: list[float], per_prompt: dict[int, list[float]], k: int,
                   threshold: float) -> dict[str, float]:
    out = {f"{prefix}/reward/mean": sum(scores) / max(len(scores), 1),
           f"{prefix}/pass@{k}": sum(max(v) >= threshold for v in per_prompt.values()) / max(len(per_prompt), 1)}
    if k > 1:
        out[f"{prefix}/best@{k}"] = sum(max(v) for v in per_prompt.values()) / max(len(per_prompt), 1)
    return out
