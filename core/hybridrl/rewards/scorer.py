"""Scoring responses: rule rewards (``hybridrl.rewards.rules``, run inline or in a process pool by
``hybridrl.rewards.runner``), a reward service (``roles.reward.url``, ``hybridrl.rewards.http``) and a reward
model (``AutoModelForSequenceClassification`` with one label, run by the ``reward`` role on its pool), alone or
added together (``score = rule + http.coef * service + roles.reward.model.coef * model``).

A rule or service reward that raises, hangs or returns no finite number scores 0 and is counted
(``reward/errors``, ``reward/timeouts``), with a few samples logged; when more than
``roles.reward.max_failed_fraction`` of a batch fails, the run stops with a ``RewardError`` naming the key and
the first failure; ``roles.reward.max_consecutive_failures`` failures of one kind in a row stop it at once
(``hybridrl.rewards.streak``), without waiting for the batch's end.

Also builds the tiny random reward model the tests and examples use (no download).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hybridrl.engines.batch import (
    META,
    PROMPT_TEXT,
    RESPONSE_IDS,
    SCORES,
    Batch,
    last_positions,
    response_attention_mask,
    sequence_keys,
)
from hybridrl.rewards.calling import RewardError
from hybridrl.rewards.rules import RuleSpec, Term
from hybridrl.rewards.runner import InlineRunner, Item, Outcome, ProcessRunner, default_workers
from hybridrl.rewards.streak import FailureStreak
from hybridrl.run.atomic_dir import replaced_atomically

log = logging.getLogger(__name__)

#: marks a folder built by ``build_tiny_reward_model`` and records its config.
REWARD_MARKER = "hybridrl_tiny_reward.json"
#: failures logged per step (the rest are only counted).
LOGGED_FAILURES = 3


def decode_responses(tokenizer: Any, batch: Batch) -> list[str]:
    """Each row's response text: every real token after the prompt (a multi-turn row's observations too)."""
    lengths = response_attention_mask(batch).sum(-1).tolist()
    ids = batch[RESPONSE_IDS]
    return [tokenizer.decode(ids[i, : int(n)].tolist(), skip_special_tokens=True) for i, n in enumerate(lengths)]


def on_last_token(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, R) token rewards holding each row's score on its last trained token (``mask``: the response mask;
    in a multi-turn row the model's last token, wherever the observations before it put it)."""
    token_rewards = torch.zeros(mask.shape, dtype=torch.float32)
    token_rewards[torch.arange(len(scores)), last_positions(mask)] = scores.float()
    return token_rewards * mask


@dataclass(frozen=True)
class Scored:
    """A scored batch: ``scores`` (B,), the decoded ``texts``, the ``parts`` (``rule``, ``http`` and/or ``model``
    scores), the reward model's compute seconds (None without a model) and ``metrics``: the failure counts
    (``reward/errors``, ``reward/timeouts``) and per-source means (``reward/<data_source>/mean``)."""

    scores: torch.Tensor
    texts: list[str]
    parts: dict[str, torch.Tensor]
    model_compute_s: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)


def as_spec(rules: RuleSpec | Callable[..., Any] | None) -> RuleSpec | None:
    """A ``RuleSpec``, or a bare function made one (tests, benchmarks)."""
    if rules is None or isinstance(rules, RuleSpec):
        return rules
    name = getattr(rules, "__qualname__", type(rules).__name__)
    return RuleSpec((Term(name, rules),))


def choose_runner(spec: RuleSpec, runner: str) -> str:
    """``inline`` or ``process`` for ``roles.reward.runner``: ``auto`` runs inline only when every function is
    marked ``inline_safe`` (the bundled rewards whose time is bounded by the response length: a pool would
    only add its hop, see benchmarks/bench_reward.py), or cannot be sent to a process."""
    if runner != "auto":
        return runner
    from hybridrl.plugins.registry import load_object

    if all(getattr(load_object(t.target), "inline_safe", False) for t in spec.all_terms()):
        return "inline"
    return "process" if spec.picklable() else "inline"


def fail_summary(outcomes: Sequence[Outcome]) -> dict[str, float]:
    timeouts = sum(o.timeout for o in outcomes)
    return {"reward/errors": float(sum(o.failed for o in outcomes) - timeouts), "reward/timeouts": float(timeouts)}


class RewardScorer:
    """Scores batches that hold ``prompt``, ``meta``, prompt and response tensors.

    ``rules``: the rule rewards (a ``RuleSpec``, or one function); ``reward_cfg``: ``roles.reward`` (runner,
    pool, bound on failures, service); ``model_group``: the worker group of the reward role (None without a
    reward model)."""

    def __init__(self, tokenizer: Any, rules: RuleSpec | Callable[..., Any] | None, model_group: Any = None,
                 model_coef: float = 1.0, reward_cfg: Any = None) -> None:
        self.tokenizer = tokenizer
        self.spec = as_spec(rules)
        self.cfg = reward_cfg
        self.model_group = model_group
        self.model_coef = model_coef
        self.runner: InlineRunner | ProcessRunner | None = None
        self.service: Any = None
        #: failures of one kind in a row stop the run (kept across batches and runner restarts)
        self.streak = FailureStreak(reward_cfg.max_consecutive_failures) if reward_cfg is not None else None

    # --- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the runner (a process pool waits here until its workers have loaded the rewards)."""
        cfg = self.cfg
        if self.spec is not None and self.runner is None:
            mode = choose_runner(self.spec, cfg.runner if cfg is not None else "inline")
            if mode == "process":
                workers = cfg.workers or default_workers()
                self.runner = ProcessRunner(self.spec, workers, cfg.timeout_s, streak=self.streak).start()
                log.info("rule rewards in a pool of %d processes (roles.reward.runner=%s)", workers, cfg.runner)
            else:  # user code inline gets a deadline per call (on a thread); hybridrl's own rewards need none
                timeout = cfg.timeout_s if cfg is not None and not self.spec.bundled() else None
                self.runner = InlineRunner(self.spec, timeout, self.streak)
        if cfg is not None and cfg.url is not None and self.service is None:
            from hybridrl.rewards.http import HttpRewardClient

            self.service = HttpRewardClient.from_config(cfg)

    def close(self) -> None:
        for part in (self.runner, self.service):
            if part is not None:
                part.close()
        self.runner = self.service = None

    # --- scoring ---------------------------------------------------------------------------------
    def items(self, batch: Batch, texts: list[str]) -> list[Item]:
        return [(batch[PROMPT_TEXT][i], text, batch[META][i]) for i, text in enumerate(texts)]

    def rule_scores(self, batch: Batch, texts: list[str]) -> tuple[torch.Tensor, list[Outcome]]:
        if self.runner is None:
            self.start()
        outcomes = self.runner.run(self.items(batch, texts))
        return torch.tensor([o.score for o in outcomes], dtype=torch.float32), outcomes

    def service_scores(self, batch: Batch, texts: list[str]) -> tuple[torch.Tensor, list[Outcome]]:
        outcomes = self.service.run(self.items(batch, texts))
        return torch.tensor([o.score for o in outcomes], dtype=torch.float32), outcomes

    def __call__(self, batch: Batch) -> Scored:
        if self.runner is None and self.service is None:
            self.start()
        texts = decode_responses(self.tokenizer, batch)
        parts: dict[str, torch.Tensor] = {}
        failures: list[Outcome] = []
        if self.spec is not None:
            parts["rule"], outcomes = self.rule_scores(batch, texts)
            failures += outcomes
        if self.service is not None:
            parts["http"], outcomes = self.service_scores(batch, texts)
            failures = _merge(failures, outcomes)
        model_compute_s = None
        if self.model_group is not None:
            result = self.model_group.call("reward", "compute_scores", batch.select(*sequence_keys(batch)))
            parts["model"] = result.value[SCORES].float()
            model_compute_s = result.compute_s
        total = torch.zeros(len(batch), dtype=torch.float32)
        for name, part in parts.items():
            weight = self.model_coef if name == "model" else self.cfg.http.coef if name == "http" else 1.0
            total = total + weight * part
        metrics = fail_summary(failures) if failures else {}
        metrics.update(source_means(batch, total))
        self._check_failures(batch, texts, failures, metrics)
        return Scored(total, texts, parts, model_compute_s, metrics)

    def _check_failures(self, batch: Batch, texts: list[str], outcomes: list[Outcome],
                        metrics: dict[str, float]) -> None:
        failed = [i for i, o in enumerate(outcomes) if o.failed]
        if not failed:
            return
        n = len(outcomes)
        samples = "; ".join(f"{outcomes[i].error} on response {texts[i][:60]!r}" for i in failed[:LOGGED_FAILURES])
        log.warning("reward: %d of %d responses failed to score (%d errors, %d timeouts; scored 0): %s",
                    len(failed), n, int(metrics["reward/errors"]), int(metrics["reward/timeouts"]), samples)
        bound = self.cfg.max_failed_fraction if self.cfg is not None else 0.5
        if len(failed) > bound * n:
            first = failed[0]
            raise RewardError(f"{len(failed)} of {n} rewards of the batch failed (more than "
                              f"roles.reward.max_failed_fraction={bound:g}); the first: {outcomes[first].error} on "
                              f"response {texts[first][:80]!r} to prompt {str(batch['prompt'][first])[:80]!r}")


def _merge(a: list[Outcome], b: list[Outcome]) -> list[Outcome]:
    """Per item, the first failure of either part (an item fails once, however many parts failed)."""
    if not a:
        return list(b)
    return [x if x.failed else y for x, y in zip(a, b)]


def source_means(batch: Batch, scores: torch.Tensor) -> dict[str, float]:
    """``reward/<data_source>/mean`` for each source in the batch (none when no row names one)."""
    by_source: dict[str, list[float]] = {}
    for meta, score in zip(batch[META], scores.tolist()):
        source = meta.get("data_source") if isinstance(meta, dict) else None
        if isinstance(source, str):
            by_source.setdefault(source, []).append(score)
    return {f"reward/{s}/mean": sum(v) / len(v) for s, v in by_source.items()}


def build_tiny_reward_model(cfg: Any, out_dir: str | Path) -> Path:
    """A small random ``Qwen2ForSequenceClassification`` (one label) with the tokenizer of ``cfg.tokenizer``
    (the bundled character one by default), built from a ``TinyModelConfig`` and saved as an HF checkpoint;
    reused when built from the same config. Random weights: it tests the plumbing, it does not judge answers."""
    from hybridrl.model.tiny import _check, tiny_tokenizer

    _check(cfg)
    out = Path(out_dir)
    spec = {"kind": "reward", "config": cfg.model_dump(mode="json", exclude={"num_experts", "experts_per_token",
                                                                            "moe_intermediate_size"})}
    try:
        if json.loads((out / REWARD_MARKER).read_text()) == spec:
            return out
    except (OSError, json.JSONDecodeError):
        if out.exists() and any(out.iterdir()):
            raise FileExistsError(f"'{out}' is not empty and was not built by build_tiny_reward_model") from None
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    tokenizer = tiny_tokenizer(cfg)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=cfg.hidden_size,
                         intermediate_size=cfg.intermediate_size,
                         num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                         num_key_value_heads=cfg.num_kv_heads, max_position_embeddings=cfg.max_position,
                         use_sliding_window=False, num_labels=1, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with replaced_atomically(out) as tmp:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            model = Qwen2ForSequenceClassification(config).to(torch.float32).eval()
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        (tmp / REWARD_MARKER).write_text(json.dumps(spec, indent=2, sort_keys=True) + "\n")
    return out
