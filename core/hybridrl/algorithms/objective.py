"""The actor's training objective, assembled from registered components and handed to the train engine.

The engine does forward passes and micro-batching; this object turns per-token log-probs (and entropy)
into the scalar loss share of one micro-batch: policy loss + KL-to-reference loss - entropy bonus.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from hybridrl.batch import ADVANTAGES, OLD_LOG_PROBS, REF_LOG_PROBS, RESPONSE_MASK, Batch
from hybridrl.config import AlgorithmConfig
from hybridrl.engines import LossScale
from hybridrl.algorithms.losses import PolicyLossSettings, masked_mean
from hybridrl.registry import Registry


@dataclass(frozen=True)
class ResolvedAlgorithm:
    """The algorithm preset merged with the user's explicit choices."""

    advantage: str
    policy_loss: str
    loss_agg: str
    uses_ref: bool
    uses_critic: bool


def resolve_algorithm(cfg: AlgorithmConfig, registry: Registry) -> ResolvedAlgorithm:
    preset: dict[str, Any] = registry.get("algorithm", cfg.name)
    return ResolvedAlgorithm(
        advantage=cfg.advantage or preset["advantage"],
        policy_loss=cfg.policy_loss or preset.get("policy_loss", "ppo_clip"),
        loss_agg=cfg.loss_agg or preset.get("loss_agg", "token-mean"),
        uses_ref=bool(preset.get("uses_ref", True)) and cfg.kl is not None and cfg.kl.coef > 0,
        uses_critic=bool(preset.get("uses_critic", False)),
    )


class PolicyObjective:
    """Callable objective for ``TrainEngine.update`` (see ``hybridrl.engines.Objective``)."""

    def __init__(self, cfg: AlgorithmConfig, registry: Registry) -> None:
        self.cfg = cfg
        algo = resolve_algorithm(cfg, registry)
        self.policy_loss: Callable = registry.get("policy_loss", algo.policy_loss)
        self.aggregate: Callable = registry.get("loss_aggregation", algo.loss_agg)
        self.kl_as_loss = cfg.kl is not None and cfg.kl.apply_as == "loss" and cfg.kl.coef > 0
        self.kl_estimator: Callable | None = registry.get("kl_estimator", cfg.kl.estimator) if self.kl_as_loss else None
        self.settings = PolicyLossSettings(cfg.clip_low, cfg.clip_high, cfg.dual_clip)
        self.needs: tuple[str, ...] = ("log_probs", "entropy")

    def __call__(self, outputs: dict[str, torch.Tensor], micro_batch: Batch, scale: LossScale
                 ) -> tuple[torch.Tensor, dict[str, float]]:
        log_probs = outputs["log_probs"]
        mask = micro_batch[RESPONSE_MASK].to(log_probs.dtype)
        token_loss, metrics = self.policy_loss(log_probs, micro_batch[OLD_LOG_PROBS], micro_batch[ADVANTAGES],
                                               mask, self.settings)
        report = {"actor/pg_loss": masked_mean(token_loss, mask)}
        if self.kl_as_loss:
            kl = self.kl_estimator(log_probs, micro_batch[REF_LOG_PROBS])
            token_loss = token_loss + self.cfg.kl.coef * kl
            report["actor/kl_loss"] = masked_mean(kl, mask)
        entropy = outputs.get("entropy")
        if entropy is not None:
            report["actor/entropy"] = masked_mean(entropy, mask)
            if self.cfg.entropy_coef:
                token_loss = token_loss - self.cfg.entropy_coef * entropy
        loss = self.aggregate(token_loss, mask, scale)
        report.update({f"actor/{k}": v for k, v in metrics.items()})
        return loss, {k: float(v.detach()) for k, v in report.items()}
