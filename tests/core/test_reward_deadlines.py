"""User rewards never run in the driver unguarded: the pre-flight probe runs in a child with
``roles.reward.timeout_s`` (a hang, ``sys.exit``, ``os._exit`` or a killed process is one problem under
``roles.reward.fn``); while training, a call past its deadline scores 0 and is counted, and a reward that fails
the same way ``roles.reward.max_consecutive_failures`` times in a row stops the run naming the key."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from hybridrl.config import ConfigError, RewardConfig, load_config
from hybridrl.engines.batch import RESPONSE_IDS, RESPONSE_MASK, Batch
from hybridrl.model.tokenizer import build_char_tokenizer
from hybridrl.placement.plan import ClusterSpec
from hybridrl.plugins.discovery import get_registry
from hybridrl.rewards.calling import RewardError
from hybridrl.rewards.rules import RuleSpec, Term
from hybridrl.rewards.runner import MAX_HUNG_THREADS, InlineRunner, Outcome, ProcessRunner, timed_out
from hybridrl.rewards.scorer import RewardScorer
from hybridrl.rewards.streak import ConsecutiveFailures, FailureStreak
from hybridrl.run.preflight import prepare_run

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"
CPU2 = ClusterSpec(1, 2, "cpu")


def preflight(tmp_path: Path, overrides: list[str]) -> dict[str, str]:
    cfg = load_config(QUICKSTART, [f"trainer.out={tmp_path / 'run'}", *overrides])
    with pytest.raises(ConfigError) as err:
        prepare_run(cfg, get_registry(tuple(cfg.plugins)), CPU2)
    return dict(err.value.problems)


# --- the pre-flight probe -----------------------------------------------------------------------

@pytest.mark.parametrize("fn, how", [
    ("hang", "timed out after 1s (roles.reward.timeout_s)"),
    ("exit_3", "called sys.exit(3)"),
    ("hard_exit", "ended its process with exit status 4"),
    ("kill_self", "was killed by signal 9 (SIGKILL)"),
])
def test_a_reward_that_hangs_or_ends_its_process_is_one_problem_at_preflight(tmp_path, fn, how):
    start = time.monotonic()
    found = preflight(tmp_path, [f"roles.reward.fn=_user_code_helpers:{fn}", "roles.reward.timeout_s=1"])
    took = time.monotonic() - start
    assert found["roles.reward.fn"].startswith(f"'_user_code_helpers:{fn}' {how} when probed on the first prompt")
    assert took < 1 + 2 + 5, took  # the deadline, the child's start, the rest of the pre-flight
    assert not (tmp_path / "run").exists()


# --- while training: deadlines and failures in a row ---------------------------------------------

FLAKY = RuleSpec((Term("_reward_helpers:flaky", "_reward_helpers:flaky"),))


def items(responses):
    return [("p", r, {}) for r in responses]


def test_a_streak_counts_failures_of_one_kind_in_a_row():
    streak = FailureStreak(3)
    error, timeout, ok = Outcome(0.0, "f raised KeyError"), timed_out(1.0), Outcome(1.0)
    for outcome in (error, error, ok, error, error, timeout, timeout, error, error):  # never 3 of a kind in a row
        streak.observe(outcome, "f")
    with pytest.raises(ConsecutiveFailures) as err:
        streak.observe(error, "roles.reward.fn 'f'")
    assert str(err.value).startswith("roles.reward.fn 'f' failed 3 times in a row the same way (the last: f raised "
                                     "KeyError); the run stops here (roles.reward.max_consecutive_failures=3)")
    FailureStreak(0).observe(error, "f")  # 0: never


def test_a_pool_stops_a_hanging_reward_after_its_limit_not_after_the_batch():
    runner = ProcessRunner(FLAKY, workers=2, timeout_s=1.0, streak=FailureStreak(3)).start()
    try:
        start = time.monotonic()
        with pytest.raises(ConsecutiveFailures) as err:
            runner.run(items(["hang"] * 40))  # without the limit each call sleeps 600 s
        took = time.monotonic() - start
    finally:
        runner.close()
    assert ("roles.reward.fn '_reward_helpers:flaky' failed 3 times in a row the same way (the last: timed out after "
            "1s (roles.reward.timeout_s))") in str(err.value)
    # two rounds of 1 s deadlines and the restarts of the killed processes: 3-10 s on 2 loaded cores; a minute
    # still tells a limit that stopped the batch from one that waited for a hanging call
    assert took < 60, took


def test_inline_a_user_reward_past_its_deadline_scores_zero_and_the_batch_goes_on():
    runner = InlineRunner(FLAKY, timeout_s=0.5)
    start = time.monotonic()
    outcomes = runner.run(items(["a", "hang", "bb", "raise", "ccc"]))
    took = time.monotonic() - start
    assert [o.score for o in outcomes] == [1.0, 0.0, 2.0, 0.0, 3.0]
    assert [o.kind for o in outcomes] == [None, "timeout", None, "error", None]
    assert outcomes[1].error == "timed out after 0.5s (roles.reward.timeout_s)"
    assert took < 0.5 + 1.0, took


def test_inline_hung_threads_are_bounded():
    runner = InlineRunner(FLAKY, timeout_s=0.2)
    with pytest.raises(RewardError) as err:
        for _ in range(MAX_HUNG_THREADS):
            runner.run(items(["a", "hang"]))
    assert f"{MAX_HUNG_THREADS} calls past roles.reward.timeout_s=0.2s are still running" in str(err.value)
    assert "roles.reward.runner=process" in str(err.value)


def test_the_scorer_counts_failures_in_a_row_across_batches():
    cfg = RewardConfig(fn="_reward_helpers:flaky", runner="inline", max_failed_fraction=1.0,
                       max_consecutive_failures=3)
    scorer = RewardScorer(build_char_tokenizer(), FLAKY, reward_cfg=cfg)
    scorer.start()
    scored = scorer(_batch(["ab", "raise", "raise"]))  # two in a row: scored 0 and counted
    assert scored.metrics["reward/errors"] == 2
    with pytest.raises(ConsecutiveFailures) as err:
        scorer(_batch(["raise", "ab"]))
    assert "roles.reward.fn '_reward_helpers:flaky' failed 3 times in a row the same way (the last: raised KeyError: " \
           "'missing')" in str(err.value)


def _batch(responses):
    tok = build_char_tokenizer()
    ids = [tok.encode(r) + [tok.eos_token_id] for r in responses]
    width = max(len(i) for i in ids)
    tensor = torch.zeros(len(ids), width, dtype=torch.long)
    mask = torch.zeros(len(ids), width, dtype=torch.long)
    for row, seq in enumerate(ids):
        tensor[row, :len(seq)] = torch.tensor(seq)
        mask[row, :len(seq)] = 1
    return Batch.from_tensors({RESPONSE_IDS: tensor, RESPONSE_MASK: mask},
                              {"prompt": ["p"] * len(ids), "meta": [{} for _ in ids]})
