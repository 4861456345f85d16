"""Truncated importance sampling (``algorithm.tis_cap``): each token's policy loss is weighted by
``min(pi_old / pi_rollout, cap)``; checked against a plain-Python computation on small hand-made tensors."""

from __future__ import annotations

import math

import pytest
import torch

from hybridrl.algorithms.losses import truncated_is_weights
from hybridrl.algorithms.objective import PolicyObjective
from hybridrl.config import AlgorithmConfig
from hybridrl.engines import LossScale
from hybridrl.engines.batch import ADVANTAGES, OLD_LOG_PROBS, RESPONSE_MASK, ROLLOUT_LOG_PROBS, Batch
from hybridrl.plugins.discovery import get_registry

MASK = [[1, 1, 1], [1, 1, 0]]
NEW = [[-1.0, -0.4, -2.0], [-0.3, -1.5, -9.0]]  # the policy being trained
OLD = [[-1.1, -0.5, -1.0], [-0.2, -1.5, -9.0]]  # the actor's log-probs at train time (pi_old)
ROLLOUT = [[-0.6, -0.5, -2.5], [-0.2, -2.5, 0.0]]  # the rollout's (behaviour) log-probs
ADV = [[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]]
CLIP_LOW, CLIP_HIGH, CAP = 0.2, 0.28, 2.0


def hand_loss(tis: bool) -> tuple[float, list[float]]:
    """PPO clip per token (ratio pi/pi_old, bounds [0.8, 1.28]) times min(exp(old - rollout), cap), token mean."""
    total, count, ratios = 0.0, 0, []
    for i in range(2):
        for t in range(3):
            if not MASK[i][t]:
                continue
            r = math.exp(NEW[i][t] - OLD[i][t])
            a = ADV[i][t]
            pg = max(-a * r, -a * min(max(r, 1 - CLIP_LOW), 1 + CLIP_HIGH))
            w = math.exp(OLD[i][t] - ROLLOUT[i][t])
            ratios.append(w)
            total += pg * (min(w, CAP) if tis else 1.0)
            count += 1
    return total / count, ratios


def objective_loss(tis_cap: float | None) -> tuple[float, dict[str, float]]:
    cfg = AlgorithmConfig(clip_low=CLIP_LOW, clip_high=CLIP_HIGH, kl=None, tis_cap=tis_cap)
    objective = PolicyObjective(cfg, get_registry())
    batch = Batch.from_tensors({OLD_LOG_PROBS: torch.tensor(OLD), ROLLOUT_LOG_PROBS: torch.tensor(ROLLOUT),
                                ADVANTAGES: torch.tensor(ADV), RESPONSE_MASK: torch.tensor(MASK)})
    loss, metrics = objective({"log_probs": torch.tensor(NEW)}, batch, LossScale(5.0, 2.0, 1))
    return loss.item(), metrics


def test_tis_weights_against_python():
    mask = torch.tensor(MASK, dtype=torch.float32)
    weights, metrics = truncated_is_weights(torch.tensor(OLD), torch.tensor(ROLLOUT), mask, CAP)
    _, ratios = hand_loss(True)
    masked = [float(weights[i, t]) for i in range(2) for t in range(3) if MASK[i][t]]
    assert masked == pytest.approx([min(r, CAP) for r in ratios], rel=1e-6)
    assert float(metrics["tis_ratio"]) == pytest.approx(sum(ratios) / len(ratios), rel=1e-6)
    assert float(metrics["tis_clipfrac"]) == pytest.approx(sum(r > CAP for r in ratios) / len(ratios))
    assert 0 < float(metrics["tis_clipfrac"]) < 1  # the inputs exercise both branches


def test_policy_objective_weights_the_pg_loss_by_the_truncated_ratio():
    loss, metrics = objective_loss(CAP)
    expected, ratios = hand_loss(True)
    assert loss == pytest.approx(expected, rel=1e-5)
    assert metrics["actor/tis_ratio"] == pytest.approx(sum(ratios) / len(ratios), rel=1e-5)
    assert metrics["actor/tis_weight"] == pytest.approx(sum(min(r, CAP) for r in ratios) / len(ratios), rel=1e-5)
    plain, plain_metrics = objective_loss(None)
    assert plain == pytest.approx(hand_loss(False)[0], rel=1e-5) and plain != pytest.approx(loss, rel=1e-3)
    assert not any("tis" in k for k in plain_metrics)


def test_tis_weight_carries_no_gradient():
    """The weight is a constant per token: d(loss)/d(log pi) is the plain PPO gradient times the weight."""
    cfg = AlgorithmConfig(clip_low=CLIP_LOW, clip_high=CLIP_HIGH, kl=None, tis_cap=CAP)
    old = torch.tensor(OLD, requires_grad=True)
    rollout = torch.tensor(ROLLOUT, requires_grad=True)
    new = torch.tensor(NEW, requires_grad=True)
    batch = Batch.from_tensors({OLD_LOG_PROBS: old, ROLLOUT_LOG_PROBS: rollout, ADVANTAGES: torch.tensor(ADV),
                                RESPONSE_MASK: torch.tensor(MASK)})
    loss, _ = PolicyObjective(cfg, get_registry())({"log_probs": new}, batch, LossScale(5.0, 2.0, 1))
    loss.backward()
    assert rollout.grad is None or not rollout.grad.any()
    assert new.grad is not None and new.grad.abs().sum() > 0
