"""GRPO advantages, the clipped policy loss, KL estimators and loss aggregation, each checked against a
plain-Python computation on small hand-made inputs (ragged masks, groups)."""

from __future__ import annotations

import math

import pytest
import torch

from hybridrl.algorithms.advantages import AdvantageInputs, grpo
from hybridrl.algorithms.kl import k1, k2, k3
from hybridrl.algorithms.losses import PolicyLossSettings, ppo_clip, seq_mean_token_mean, seq_mean_token_sum, token_mean
from hybridrl.algorithms.objective import PolicyObjective
from hybridrl.batch import ADVANTAGES, OLD_LOG_PROBS, REF_LOG_PROBS, RESPONSE_MASK, Batch
from hybridrl.config import AlgorithmConfig
from hybridrl.engines import LossScale
from hybridrl.plugins import get_registry

MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.float32)
SCORES = [1.0, 0.0, 0.5, 0.25, 0.75]
GROUPS = [0, 0, 0, 1, 1]


def token_rewards() -> torch.Tensor:
    r = torch.zeros_like(MASK)
    for i, s in enumerate(SCORES):
        r[i, int(MASK[i].sum()) - 1] = s
    return r


def py_std(xs):
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_advantages_match_group_statistics(norm):
    adv, _ = grpo(AdvantageInputs(token_rewards(), MASK, torch.tensor(GROUPS), norm_by_std=norm))
    for i, s in enumerate(SCORES):
        group = [SCORES[j] for j in range(len(SCORES)) if GROUPS[j] == GROUPS[i]]
        expected = s - sum(group) / len(group)
        if norm:
            expected /= py_std(group) + 1e-6
        for t in range(4):
            assert adv[i, t].item() == pytest.approx(expected if MASK[i, t] else 0.0, abs=1e-5)


def test_grpo_single_sample_group_keeps_its_score():
    adv, _ = grpo(AdvantageInputs(torch.tensor([[0.0, 0.7]]), torch.ones(1, 2), torch.tensor([3])))
    assert adv[0].tolist() == pytest.approx([0.7, 0.7])


def test_ppo_clip_against_scalar_formula():
    logp = torch.tensor([[-1.0, -0.5, -2.0], [-0.1, -3.0, -1.0]])
    old = torch.tensor([[-1.5, -0.5, -1.0], [-0.6, -2.0, -1.0]])
    adv = torch.tensor([[1.0, -2.0, 0.5], [-1.0, 3.0, -0.5]])
    settings = PolicyLossSettings(clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    loss, metrics = ppo_clip(logp, old, adv, torch.ones_like(logp), settings)
    clipped_count = 0
    for i in range(2):
        for t in range(3):
            r = math.exp(logp[i, t] - old[i, t])
            a = adv[i, t].item()
            clipped = -a * min(max(r, 0.8), 1.28)
            value = max(-a * r, clipped)
            clipped_count += clipped > -a * r
            if a < 0:
                value = min(value, -a * 3.0)
            assert loss[i, t].item() == pytest.approx(value, rel=1e-5)
    assert metrics["clipfrac"].item() == pytest.approx(clipped_count / 6)


def test_dual_clip_bounds_negative_advantages():
    logp, old = torch.tensor([[2.0]]), torch.tensor([[0.0]])  # ratio e^2 ~ 7.4
    adv = torch.tensor([[-1.0]])
    plain, _ = ppo_clip(logp, old, adv, torch.ones(1, 1), PolicyLossSettings())
    dual, _ = ppo_clip(logp, old, adv, torch.ones(1, 1), PolicyLossSettings(dual_clip=3.0))
    assert plain.item() == pytest.approx(math.exp(2.0), rel=1e-5)
    assert dual.item() == pytest.approx(3.0)


def test_kl_estimators_against_formulas():
    p = torch.tensor([-0.3, -2.0, -1.0])
    q = torch.tensor([-0.5, -1.0, -1.0])
    for i in range(3):
        d = p[i].item() - q[i].item()
        assert k1(p, q)[i].item() == pytest.approx(d)
        assert k2(p, q)[i].item() == pytest.approx(0.5 * d * d)
        assert k3(p, q)[i].item() == pytest.approx(math.exp(-d) + d - 1, rel=1e-5)
    assert k3(p, q)[2].item() == 0.0 and (k3(p, q) >= 0).all()


def test_loss_aggregations_against_python():
    loss = torch.arange(20, dtype=torch.float32).reshape(5, 4) / 10
    scale = LossScale(total_tokens=float(MASK.sum()), total_sequences=5.0, dp_size=1)
    tokens = [(loss[i, t].item(), MASK[i, t].item()) for i in range(5) for t in range(4)]
    assert token_mean(loss, MASK, scale).item() == pytest.approx(sum(l * m for l, m in tokens) / MASK.sum().item())
    seq_sums = [sum(loss[i, t].item() for t in range(4) if MASK[i, t]) for i in range(5)]
    seq_means = [seq_sums[i] / MASK[i].sum().item() for i in range(5)]
    assert seq_mean_token_sum(loss, MASK, scale).item() == pytest.approx(sum(seq_sums) / 5)
    assert seq_mean_token_mean(loss, MASK, scale).item() == pytest.approx(sum(seq_means) / 5)


def test_micro_batch_shares_add_up_to_the_global_loss():
    """Shares over micro-batches and ranks (mean of rank gradients) equal the loss of the whole batch."""
    loss = torch.rand(5, 4)
    whole = token_mean(loss, MASK, LossScale(float(MASK.sum()), 5.0, 1))
    scale = LossScale(float(MASK.sum()), 5.0, dp_size=2)
    rank0 = token_mean(loss[:2], MASK[:2], scale) + token_mean(loss[2:3], MASK[2:3], scale)
    rank1 = token_mean(loss[3:], MASK[3:], scale)
    assert ((rank0 + rank1) / 2).item() == pytest.approx(whole.item(), rel=1e-6)


def test_policy_objective_combines_pg_kl_and_entropy():
    cfg = AlgorithmConfig(clip_low=0.2, clip_high=0.2, entropy_coef=0.01, kl={"coef": 0.1, "estimator": "k1"})
    objective = PolicyObjective(cfg, get_registry())
    logp = torch.tensor([[-1.0, -0.5], [-2.0, -0.1]])
    batch = Batch.from_tensors({OLD_LOG_PROBS: logp.clone(), REF_LOG_PROBS: logp - 0.2,
                                ADVANTAGES: torch.tensor([[1.0, 1.0], [-0.5, -0.5]]),
                                RESPONSE_MASK: torch.tensor([[1, 1], [1, 0]])})
    entropy = torch.full((2, 2), 0.5)
    loss, metrics = objective({"log_probs": logp, "entropy": entropy}, batch, LossScale(3.0, 2.0, 1))
    # ratio 1 everywhere: pg = -A; kl k1 = 0.2 per token; entropy bonus 0.01 * 0.5
    expected = ((-1.0 - 1.0 + 0.5) + 3 * (0.1 * 0.2) - 3 * 0.005) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert metrics["actor/kl_loss"] == pytest.approx(0.2, rel=1e-5)
    assert metrics["actor/entropy"] == pytest.approx(0.5)
