"""Advantage estimators (GAE, GRPO, RLOO, REINFORCE++, REINFORCE++-baseline, ReMax), policy losses (PPO clip,
GSPO), the value loss, KL estimators and controllers, and loss aggregation, each checked against a plain-Python
computation on small hand-made inputs (ragged masks, a mask with a hole, groups of different sizes)."""

from __future__ import annotations

import math

import pytest
import torch

from hybridrl.algorithms.advantages import AdvantageInputs, gae, grpo, reinforce_pp, reinforce_pp_baseline, remax, rloo
from hybridrl.algorithms.kl import k1, k2, k3
from hybridrl.algorithms.kl_control import AdaptiveKLController, FixedKLController
from hybridrl.algorithms.losses import (
    PolicyLossSettings,
    clipped_value_loss,
    gspo,
    ppo_clip,
    seq_mean_token_mean,
    seq_mean_token_sum,
    token_mean,
)
from hybridrl.algorithms.objective import PolicyObjective, ValueObjective
from hybridrl.config import AlgorithmConfig
from hybridrl.engines import LossScale
from hybridrl.engines.batch import (
    ADVANTAGES,
    OLD_LOG_PROBS,
    REF_LOG_PROBS,
    RESPONSE_MASK,
    RETURNS,
    ROLLOUT_LOG_PROBS,
    Batch,
)
from hybridrl.plugins.discovery import get_registry

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
    expected = sum(value * m for value, m in tokens) / MASK.sum().item()
    assert token_mean(loss, MASK, scale).item() == pytest.approx(expected)
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


def test_objective_without_old_log_probs_uses_the_current_ones_under_stop_gradient():
    """One update per batch skips the old-log-prob pass: loss and gradient must be those of old = logp."""
    cfg = AlgorithmConfig(clip_low=0.2, clip_high=0.28, kl={"coef": 0.05, "estimator": "k3"})
    objective = PolicyObjective(cfg, get_registry())
    base = torch.tensor([[-1.0, -0.5, -0.3], [-2.0, -0.1, -0.7]])
    tensors = {REF_LOG_PROBS: base - 0.3, ADVANTAGES: torch.tensor([[1.0, 1.0, 1.0], [-0.5, -0.5, -0.5]]),
               RESPONSE_MASK: torch.tensor([[1, 1, 0], [1, 1, 1]]), ROLLOUT_LOG_PROBS: base - 0.1}
    grads, losses = [], []
    for with_old in (True, False):
        logp = base.clone().requires_grad_(True)
        batch = Batch.from_tensors({**tensors, **({OLD_LOG_PROBS: base.clone()} if with_old else {})})
        loss, metrics = objective({"log_probs": logp, "entropy": torch.zeros(2, 3)}, batch, LossScale(5.0, 2.0, 1))
        loss.backward()
        grads.append(logp.grad)
        losses.append(loss.item())
        assert metrics["rollout/logp_diff"] == pytest.approx(0.1, rel=1e-5)  # |logp - rollout logp| on 5 tokens
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    torch.testing.assert_close(grads[0], grads[1])
    assert grads[1].abs().sum() > 0


@pytest.mark.parametrize("overrides,kl_in_reward,needed", [
    ({}, False, False),                                          # one optimizer step per batch: skip
    ({"algorithm.old_log_probs": "recompute"}, False, True),     # asked for
    ({"algorithm.epochs": 2}, False, True),                      # the second epoch sees moved weights
    ({"roles.actor.mini_batch": 64}, False, True),               # 256-row batch in 4 optimizer steps
    ({"roles.actor.mini_batch": 256}, False, False),             # one mini-batch = the batch
    ({}, True, True),                                            # KL in the reward reads them first
])
def test_old_log_prob_pass_is_skipped_only_where_it_equals_the_update(overrides, kl_in_reward, needed):
    from pathlib import Path

    from hybridrl.algorithms.objective import old_log_probs_needed
    from hybridrl.config import load_config

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(root / "examples" / "quickstart.yaml", [f"{k}={v}" for k, v in overrides.items()])
    assert cfg.data.prompts_per_step * cfg.algorithm.n_samples == 256
    assert old_log_probs_needed(cfg, kl_in_reward) is needed


# --- the other estimators -------------------------------------------------------------------------------
# Ragged rows, one with a hole in its mask (position 1 of row 5 is not a response token), groups of 3, 2 and 1.
MASK2 = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 1, 1]],
                     dtype=torch.float32)
GROUPS2 = [0, 0, 0, 1, 1, 2]
REWARDS2 = torch.tensor([[0.1, -0.2, 1.0, 0.0], [0.7, 0.0, 0.0, 0.0], [0.0, 0.3, 0.0, 0.0],
                         [-0.1, 0.0, 0.2, 0.5], [0.0, 0.9, 0.0, 0.0], [0.05, 0.0, -0.3, 0.4]]) * MASK2
VALUES2 = torch.tensor([[0.2, 0.4, 0.6, 0.0], [0.1, 0.0, 0.0, 0.0], [0.5, -0.2, 0.0, 0.0],
                        [0.3, 0.3, 0.1, 0.2], [0.0, 0.4, 0.0, 0.0], [0.2, 9.0, -0.1, 0.3]]) * MASK2


def positions(i: int) -> list[int]:
    return [t for t in range(MASK2.shape[1]) if MASK2[i, t]]


def py_whiten(per_token: dict[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    xs = list(per_token.values())
    mean = sum(xs) / len(xs)
    var = sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)
    return {k: (x - mean) / math.sqrt(var + 1e-8) for k, x in per_token.items()}


def inputs2(**kw) -> AdvantageInputs:
    return AdvantageInputs(REWARDS2.clone(), MASK2, torch.tensor(GROUPS2), **kw)


def assert_tokens(tensor: torch.Tensor, expected: dict[tuple[int, int], float], abs_tol: float = 1e-5) -> None:
    for i in range(tensor.shape[0]):
        for t in range(tensor.shape[1]):
            assert tensor[i, t].item() == pytest.approx(expected.get((i, t), 0.0), abs=abs_tol), (i, t)


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.9, 0.8)])
def test_gae_against_python_recursion(gamma, lam):
    adv, returns = gae(inputs2(values=VALUES2, gamma=gamma, lam=lam))
    raw, rets = {}, {}
    for i in range(MASK2.shape[0]):
        pos = positions(i)
        r = [REWARDS2[i, t].item() for t in pos]
        v = [VALUES2[i, t].item() for t in pos] + [0.0]  # terminal state after the last token
        running = 0.0
        for k in reversed(range(len(pos))):
            delta = r[k] + gamma * v[k + 1] - v[k]
            running = delta + gamma * lam * running
            raw[(i, pos[k])] = running
            rets[(i, pos[k])] = running + v[k]
    assert_tokens(returns, rets)
    assert_tokens(adv, py_whiten(raw))


def test_gae_with_lambda_one_and_gamma_one_is_return_minus_value():
    adv, returns = gae(inputs2(values=VALUES2))
    for i in range(MASK2.shape[0]):
        pos = positions(i)
        for k, t in enumerate(pos):
            assert returns[i, t].item() == pytest.approx(sum(REWARDS2[i, u].item() for u in pos[k:]), abs=1e-6)


def test_rloo_is_score_minus_mean_of_the_others():
    adv, _ = rloo(inputs2())
    scores = [REWARDS2[i].sum().item() for i in range(len(GROUPS2))]
    expected = {}
    for i, g in enumerate(GROUPS2):
        others = [scores[j] for j in range(len(GROUPS2)) if GROUPS2[j] == g and j != i]
        a = scores[i] - sum(others) / len(others) if others else scores[i]
        expected.update({(i, t): a for t in positions(i)})
    assert_tokens(adv, expected)


@pytest.mark.parametrize("gamma", [1.0, 0.5])
def test_reinforce_pp_whitens_discounted_returns(gamma):
    adv, returns = reinforce_pp(inputs2(gamma=gamma))
    rets = {}
    for i in range(MASK2.shape[0]):
        running = 0.0
        for t in reversed(positions(i)):
            running = REWARDS2[i, t].item() + gamma * running
            rets[(i, t)] = running
    assert_tokens(returns, rets)
    assert_tokens(adv, py_whiten(rets))


def test_reinforce_pp_baseline_subtracts_group_mean_then_whitens():
    adv, _ = reinforce_pp_baseline(inputs2())
    scores = [REWARDS2[i].sum().item() for i in range(len(GROUPS2))]
    centred = {}
    for i, g in enumerate(GROUPS2):
        group = [scores[j] for j in range(len(GROUPS2)) if GROUPS2[j] == g]
        mean = sum(group) / len(group) if len(group) > 1 else 0.0
        centred.update({(i, t): scores[i] - mean for t in positions(i)})
    assert_tokens(adv, py_whiten(centred))


def test_remax_subtracts_the_greedy_reward_from_the_return_to_go():
    baseline = torch.tensor([0.5, 0.5, 0.5, -0.25, -0.25, 1.0])
    adv, returns = remax(inputs2(baseline_scores=baseline))
    expected_adv, expected_ret = {}, {}
    for i in range(MASK2.shape[0]):
        pos = positions(i)
        for k, t in enumerate(pos):
            ret = sum(REWARDS2[i, u].item() for u in pos[k:])
            expected_ret[(i, t)] = ret
            expected_adv[(i, t)] = ret - baseline[i].item()
    assert_tokens(returns, expected_ret)
    assert_tokens(adv, expected_adv)
    with pytest.raises(ValueError, match="baseline"):
        remax(inputs2())


def test_estimators_declare_what_they_need():
    from hybridrl.algorithms.advantages import estimator_needs

    assert estimator_needs(gae) == ("values",)
    assert estimator_needs(remax) == ("baseline_scores",)
    assert estimator_needs(grpo) == estimator_needs(rloo) == ()


# --- GSPO and the value loss ------------------------------------------------------------------------------
def test_gspo_uses_the_length_normalised_sequence_ratio():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float32)
    old = torch.tensor([[-1.0, -0.5, -2.0], [-0.2, -1.0, 0.0]])
    logp = torch.tensor([[-0.9, -0.7, -1.5], [-0.3, -0.6, 0.0]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, 0.0]])
    settings = PolicyLossSettings(clip_low=0.05, clip_high=0.1)
    loss, metrics = gspo(logp, old, adv, mask, settings)
    (loss * mask).sum().backward()
    for i in range(2):
        n = int(mask[i].sum())
        s = math.exp(sum(logp[i, t].item() - old[i, t].item() for t in range(n)) / n)
        a = adv[i, 0].item()
        unclipped, clipped = -a * s, -a * min(max(s, 0.95), 1.1)
        for t in range(n):
            assert loss[i, t].item() == pytest.approx(max(unclipped, clipped), rel=1e-5)
            # GSPO-token gradient: s * dlogp for the unclipped branch, 0 when the clip is active
            grad = -a * s if unclipped >= clipped else 0.0
            assert logp.grad[i, t].item() == pytest.approx(grad, rel=1e-5, abs=1e-7)
    assert metrics["ratio"].item() == pytest.approx(
        (3 * math.exp((0.1 - 0.2 + 0.5) / 3) + 2 * math.exp((-0.1 + 0.4) / 2)) / 5, rel=1e-5)


def test_gspo_equals_ppo_clip_for_one_token_sequences():
    logp, old = torch.tensor([[-0.4], [-2.0]]), torch.tensor([[-1.0], [-1.5]])
    adv = torch.tensor([[0.7], [-1.2]])
    settings = PolicyLossSettings(clip_low=0.2, clip_high=0.28)
    a, _ = gspo(logp, old, adv, torch.ones(2, 1), settings)
    b, _ = ppo_clip(logp, old, adv, torch.ones(2, 1), settings)
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("cliprange", [None, 0.2])
def test_clipped_value_loss_against_python(cliprange):
    values = torch.tensor([[0.5, 1.2, -0.3], [0.0, 0.9, 0.1]])
    old = torch.tensor([[0.4, 0.7, -0.2], [0.3, 0.9, 0.0]])
    returns = torch.tensor([[1.0, 0.0, -1.0], [0.2, 2.0, 0.1]])
    loss, clipped = clipped_value_loss(values, old, returns, cliprange)
    for i in range(2):
        for t in range(3):
            v, o, r = values[i, t].item(), old[i, t].item(), returns[i, t].item()
            plain = (v - r) ** 2
            if cliprange is None:
                expected, was_clipped = 0.5 * plain, False
            else:
                vc = o + min(max(v - o, -cliprange), cliprange)
                expected, was_clipped = 0.5 * max(plain, (vc - r) ** 2), (vc - r) ** 2 > plain
            assert loss[i, t].item() == pytest.approx(expected, rel=1e-5)
            assert clipped[i, t].item() == float(was_clipped)


def test_value_objective_aggregates_the_value_loss():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    old = torch.tensor([[0.0, 0.5, 0.0], [1.0, 0.0, 0.0]])
    returns = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    values = torch.tensor([[0.2, 0.5, 7.0], [1.0, 3.0, 0.0]])
    batch = Batch.from_tensors({"values": old, RETURNS: returns, RESPONSE_MASK: mask})
    objective = ValueObjective(cliprange_value=0.1, aggregate=token_mean)
    assert objective.needs == ("values",)
    loss, metrics = objective({"values": values}, batch, LossScale(3.0, 2.0, 1))
    # tokens: (0.2 vs old 0 -> clipped 0.1; R=1): max(0.64, 0.81); (0.5, old .5, R=1): 0.25; (1.0, old 1, R=0): 1
    expected = 0.5 * (0.81 + 0.25 + 1.0) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert metrics["critic/vf_loss"] == pytest.approx(expected, rel=1e-5)
    assert metrics["critic/vf_clipfrac"] == pytest.approx(1 / 3)


# --- KL controllers -----------------------------------------------------------------------------------
def test_adaptive_kl_controller_follows_ziegler_update():
    ctrl = AdaptiveKLController(coef=0.1, target=2.0, horizon=1000)
    coef = 0.1
    for kl, n in [(4.0, 64), (2.5, 64), (1.0, 128), (0.1, 64)]:
        ctrl.update(kl, n)
        coef *= 1 + min(max(kl / 2.0 - 1, -0.2), 0.2) * n / 1000
        assert ctrl.coef == pytest.approx(coef, rel=1e-12)
    fixed = FixedKLController(0.3)
    fixed.update(100.0, 64)
    assert fixed.coef == 0.3
