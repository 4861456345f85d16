"""The training objectives handed to the train engines, assembled from registered components.

The engine does forward passes and micro-batching; an objective turns per-token outputs into the scalar loss
share of one micro-batch: for the actor, policy loss + KL-to-reference loss - entropy bonus; for the critic,
the clipped value loss. Also: resolving an algorithm preset into the effective settings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import ValidationError

from hybridrl.algorithms.advantages import estimator_needs
from hybridrl.algorithms.losses import PolicyLossSettings, clipped_value_loss, masked_mean, truncated_is_weights
from hybridrl.config import AlgorithmConfig
from hybridrl.engines import LossScale
from hybridrl.engines.batch import (
    ADVANTAGES,
    BASELINE_SCORES,
    ENTROPY,
    LOG_PROBS,
    OLD_LOG_PROBS,
    REF_LOG_PROBS,
    RESPONSE_MASK,
    RETURNS,
    ROLLOUT_LOG_PROBS,
    VALUES,
    Batch,
)
from hybridrl.plugins.registry import Registry, RegistryError

#: preset keys that describe the algorithm rather than set an ``AlgorithmConfig`` field.
PRESET_META_KEYS = frozenset({"uses_ref", "uses_critic", "description"})


@dataclass(frozen=True)
class ResolvedAlgorithm:
    """The algorithm preset merged with the user's explicit choices."""

    advantage: str
    policy_loss: str
    loss_agg: str
    uses_ref: bool
    uses_critic: bool
    greedy_baseline: bool = False  # the estimator needs one greedy response per prompt (ReMax)
    config: AlgorithmConfig | None = None  # the effective algorithm config (preset defaults filled in)


def apply_preset(cfg: AlgorithmConfig, registry: Registry) -> AlgorithmConfig:
    """``cfg`` with the defaults of its preset (``registry.add_algorithm(name, defaults)``) filled in for every
    field the user did not set. A preset may set any ``algorithm.*`` key (``advantage``, ``norm_adv_by_std``,
    ``clip_low`` ...); what the user wrote always wins. Idempotent: the result has every field set."""
    preset: dict[str, Any] = registry.get("algorithm", cfg.name)
    unknown = set(preset) - set(AlgorithmConfig.model_fields) - PRESET_META_KEYS
    if unknown:
        raise RegistryError(f"algorithm preset '{cfg.name}' sets unknown keys {sorted(unknown)}")
    data = cfg.model_dump(by_alias=True)
    for key, value in preset.items():
        if key in AlgorithmConfig.model_fields and key not in cfg.model_fields_set:
            data[key] = value
    for key, default in (("advantage", "grpo"), ("policy_loss", "ppo_clip"), ("loss_agg", "token-mean")):
        if data.get(key) is None:
            data[key] = default
    try:
        return AlgorithmConfig.model_validate(data)
    except ValidationError as exc:
        raise RegistryError(f"algorithm preset '{cfg.name}' gives invalid settings: {exc}") from None


def resolve_algorithm(cfg: AlgorithmConfig, registry: Registry) -> ResolvedAlgorithm:
    """Effective config and what the algorithm needs (a reference, a critic, a greedy baseline)."""
    preset: dict[str, Any] = registry.get("algorithm", cfg.name)
    eff = apply_preset(cfg, registry)
    try:
        wanted = estimator_needs(registry.get("advantage", eff.advantage))
    except RegistryError:  # reported under algorithm.advantage by the pre-flight checks
        wanted = ()
    return ResolvedAlgorithm(
        advantage=eff.advantage,
        policy_loss=eff.policy_loss,
        loss_agg=eff.loss_agg,
        uses_ref=bool(preset.get("uses_ref", True)) and eff.kl is not None and eff.kl.coef > 0,
        uses_critic=bool(preset.get("uses_critic", False)) or VALUES in wanted,
        greedy_baseline=BASELINE_SCORES in wanted,
        config=eff,
    )


class PolicyObjective:
    """Callable objective for ``TrainEngine.update`` (see ``hybridrl.engines.Objective``)."""

    def __init__(self, cfg: AlgorithmConfig, registry: Registry, resolved: ResolvedAlgorithm | None = None) -> None:
        algo = resolved if resolved is not None else resolve_algorithm(cfg, registry)
        cfg = self.cfg = algo.config
        self.policy_loss: Callable = registry.get("policy_loss", algo.policy_loss)
        self.aggregate: Callable = registry.get("loss_aggregation", algo.loss_agg)
        self.kl_as_loss = cfg.kl is not None and cfg.kl.apply_as == "loss" and cfg.kl.coef > 0
        self.kl_estimator: Callable | None = registry.get("kl_estimator", cfg.kl.estimator) if self.kl_as_loss else None
        self.settings = PolicyLossSettings(cfg.clip_low, cfg.clip_high, cfg.dual_clip)
        self.needs: tuple[str, ...] = (LOG_PROBS, ENTROPY)

    def __call__(self, outputs: dict[str, torch.Tensor], micro_batch: Batch, scale: LossScale
                 ) -> tuple[torch.Tensor, dict[str, float]]:
        log_probs = outputs[LOG_PROBS]
        mask = micro_batch[RESPONSE_MASK].to(log_probs.dtype)
        # Without recomputed old log-probs (one update per batch: they would equal these), the ratio is 1 with
        # the right gradient: pi / stopgrad(pi).
        old = micro_batch[OLD_LOG_PROBS] if OLD_LOG_PROBS in micro_batch else log_probs.detach()
        token_loss, metrics = self.policy_loss(log_probs, old, micro_batch[ADVANTAGES], mask, self.settings)
        if self.cfg.tis_cap is not None:  # the batch was sampled by the rollout's policy, not pi_old
            weights, tis = truncated_is_weights(old, micro_batch[ROLLOUT_LOG_PROBS].to(log_probs.dtype), mask,
                                                self.cfg.tis_cap)
            token_loss = token_loss * weights
            metrics = {**metrics, **tis}
        report = {"actor/pg_loss": masked_mean(token_loss, mask)}
        if ROLLOUT_LOG_PROBS in micro_batch:  # how far the rollout engine's numbers are from the trainer's
            report["rollout/logp_diff"] = masked_mean((log_probs.detach() - micro_batch[ROLLOUT_LOG_PROBS]).abs(), mask)
        if self.kl_as_loss:
            kl = self.kl_estimator(log_probs, micro_batch[REF_LOG_PROBS])
            token_loss = token_loss + self.cfg.kl.coef * kl
            report["actor/kl_loss"] = masked_mean(kl, mask)
        entropy = outputs.get(ENTROPY)
        if entropy is not None:
            report["actor/entropy"] = masked_mean(entropy, mask)
            if self.cfg.entropy_coef:
                token_loss = token_loss - self.cfg.entropy_coef * entropy
        loss = self.aggregate(token_loss, mask, scale)
        report.update({f"actor/{k}": v for k, v in metrics.items()})
        return loss, {k: float(v.detach()) for k, v in report.items()}


class ValueObjective:
    """The critic's objective for ``TrainEngine.update``: PPO's clipped value loss against the returns.

    Built in the driver and sent with the call (it holds only numbers and an importable function), so the
    worker needs no knowledge of it. The micro-batch carries ``values`` (the critic's values before this
    update, the clip's anchor) and ``returns``."""

    needs: tuple[str, ...] = (VALUES,)

    def __init__(self, cliprange_value: float | None, aggregate: Callable) -> None:
        self.cliprange_value = cliprange_value
        self.aggregate = aggregate

    def __call__(self, outputs: dict[str, torch.Tensor], micro_batch: Batch, scale: LossScale
                 ) -> tuple[torch.Tensor, dict[str, float]]:
        values = outputs[VALUES]
        mask = micro_batch[RESPONSE_MASK].to(values.dtype)
        token_loss, clipped = clipped_value_loss(values, micro_batch[VALUES].to(values.dtype),
                                                 micro_batch[RETURNS].to(values.dtype), self.cliprange_value)
        loss = self.aggregate(token_loss, mask, scale)
        report = {"critic/vf_loss": masked_mean(token_loss, mask), "critic/vf_clipfrac": masked_mean(clipped, mask),
                  "critic/vpred_mean": masked_mean(values, mask)}
        return loss, {k: float(v.detach()) for k, v in report.items()}


def old_log_probs_needed(cfg: Any, kl_in_reward: bool) -> bool:
    """Whether the actor's log-probs before the update need a pass of their own. With one optimizer step per
    batch they equal the update's own log-probs (same weights, same tokens), which the objective then uses
    under a stop-gradient: the pass is skipped. KL folded into the reward reads them before the update."""
    algo = cfg.algorithm
    mini = cfg.roles.actor.mini_batch
    one_step = algo.epochs == 1 and (mini is None or mini >= cfg.data.prompts_per_step * algo.n_samples)
    return algo.old_log_probs == "recompute" or not one_step or kl_in_reward


def kl_in_reward(cfg: Any) -> bool:
    """Whether the run folds its KL to the reference into the reward (``algorithm.kl.as: reward``, coef above 0)."""
    kl = cfg.algorithm.kl
    return kl is not None and kl.coef > 0 and kl.apply_as == "reward"
