"""Rule rewards that raise, hang, die or return no finite number: each scores 0, is counted, is logged, and only
stops the run when most of a batch fails (naming the key and the first failure); weights, dispatch by
data_source, calling conventions; the pool and the inline runner."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from hybridrl.config import RewardConfig
from hybridrl.engines.batch import RESPONSE_IDS, RESPONSE_MASK, Batch
from hybridrl.model.tokenizer import build_char_tokenizer
from hybridrl.plugins.discovery import get_registry
from hybridrl.rewards.calling import RewardError
from hybridrl.rewards.checks import probe_problems, runner_problems
from hybridrl.rewards.rules import Rules, RuleSpec, Term, build_spec
from hybridrl.rewards.runner import InlineRunner, ProcessRunner
from hybridrl.rewards.scorer import RewardScorer, choose_runner

FLAKY = RuleSpec((Term("_reward_helpers:flaky", "_reward_helpers:flaky"),))
FAILURES = {
    "raise": "roles.reward.fn '_reward_helpers:flaky' raised KeyError: 'missing'",
    "text": "roles.reward.fn '_reward_helpers:flaky' returned str '1.0', not a number",
    "nan": "roles.reward.fn '_reward_helpers:flaky' returned nan, not a finite number",
    "inf": "roles.reward.fn '_reward_helpers:flaky' returned -inf, not a finite number",
    "none": "roles.reward.fn '_reward_helpers:flaky' returned NoneType None, not a number",
}


def items(responses, **fields):
    return [("p", r, dict(fields)) for r in responses]


@pytest.fixture(scope="module")
def pool():
    runner = ProcessRunner(FLAKY, workers=2, timeout_s=1.0).start()
    yield runner
    runner.close()


# --- runners ------------------------------------------------------------------------------------

@pytest.mark.parametrize("runner_kind", ["inline", "process"])
def test_each_failure_scores_zero_with_its_reason(runner_kind, pool):
    runner = pool if runner_kind == "process" else InlineRunner(FLAKY)
    responses = ["ab", *FAILURES, "abcd"]
    outcomes = runner.run(items(responses))
    assert [o.score for o in outcomes] == [2.0, 0, 0, 0, 0, 0, 4.0]
    assert [o.error for o in outcomes] == [None, *FAILURES.values(), None]
    assert not any(o.timeout for o in outcomes)


def test_a_hanging_reward_times_out_and_the_rest_is_scored(pool):
    start = time.monotonic()
    outcomes = pool.run(items(["a", "hang", "bb", "ccc", "hang", "dddd"]))
    took = time.monotonic() - start
    assert [o.score for o in outcomes] == [1.0, 0.0, 2.0, 3.0, 0.0, 4.0]
    assert [o.timeout for o in outcomes] == [False, True, False, False, True, False]
    assert outcomes[1].error == "timed out after 1s (roles.reward.timeout_s)"
    assert took < 30  # two timeouts of 1 s each (plus restarts), not the 600 s the calls would sleep
    assert [o.score for o in pool.run(items(["xyz"] * 8))] == [3.0] * 8  # the pool still works


def test_a_dying_reward_process_is_replaced(pool):
    restarts = pool.restarts
    outcomes = pool.run(items(["a", "die", "bb"]))
    assert [o.score for o in outcomes] == [1.0, 0.0, 2.0]
    assert outcomes[1].error == "the reward process died (exit code 3) scoring this response"
    assert pool.restarts == restarts + 1
    assert pool.run(items(["abc"]))[0].score == 3.0


def test_pool_and_inline_agree_on_many_items(pool):
    batch = items(["x" * (i % 7) for i in range(300)])
    assert [o.score for o in pool.run(batch)] == [o.score for o in InlineRunner(FLAKY).run(batch)]


def test_a_pool_that_cannot_load_the_rewards_says_so():
    from hybridrl.rewards.runner import RewardPoolError

    with pytest.raises(RewardPoolError, match="cannot load the rule rewards: ModuleNotFoundError"):
        ProcessRunner(RuleSpec((Term("x", "no_such_module_anywhere:fn"),)), 1, 1.0).start()


# --- rules: weights, dispatch, calling conventions ----------------------------------------------

def _spec(**reward):
    spec, problems = build_spec(RewardConfig(**reward), get_registry())
    assert problems == []
    return spec


def test_weights_compose_and_sources_dispatch():
    spec = _spec(fn=[{"fn": "gsm8k"}, {"fn": "format", "weight": 0.5, "args": {"pattern": "####"}}],
                 by_source={"b": "_reward_helpers:verl_style"})
    rules = Rules(spec)
    assert rules.score("q", "#### 7", {"ground_truth": "7"}) == 1.5
    assert rules.score("q", "so 7", {"ground_truth": "7"}) == 1.0
    assert rules.score("q", " 7 ", {"ground_truth": "7", "data_source": "b"}) == 1.5  # verl's signature
    assert rules.score("q", "8", {"ground_truth": "7", "data_source": "other"}) == 0.0  # not in by_source: fn
    assert spec.describe() == "gsm8k + 0.5*format"


def test_by_source_alone_leaves_other_sources_without_a_reward():
    spec = _spec(by_source={"a": "gsm8k"})
    assert spec.default is None
    from hybridrl.rewards.calling import RewardFailure

    with pytest.raises(RewardFailure, match="no rule reward for data_source 'z'"):
        Rules(spec).score("q", "1", {"data_source": "z", "ground_truth": "1"})


def test_a_function_gets_only_the_fields_it_names():
    rules = Rules(_spec(fn="_reward_helpers:strict_signature"))
    assert rules.score("q", "21", {"answer": "21", "ground_truth": "21", "extra": 1}) == 1.0


def test_bad_terms_are_named_with_their_key():
    _, problems = build_spec(RewardConfig(fn=["gsm8k", {"fn": "nope"}], by_source={"s": "mod_nowhere:f"}),
                             get_registry())
    found = dict(problems)
    assert "unknown reward 'nope'" in found["roles.reward.fn[1]"]
    assert "cannot import reward function 'mod_nowhere:f'" in found["roles.reward.by_source.s"]


def test_the_probe_names_the_term_whose_args_are_wrong():
    spec = _spec(fn=["gsm8k", {"fn": "format", "args": {"patern": "x"}}])
    [(key, reason)] = probe_problems(spec, {None: ("q", {"ground_truth": "1"})})
    assert key == "roles.reward.fn[1]" and "'format' raised ValueError: format needs args.pattern" in reason


def test_runner_choice():
    assert choose_runner(_spec(fn="reverse"), "auto") == "inline"  # marked inline_safe
    assert choose_runner(_spec(fn=["gsm8k", "reverse"]), "auto") == "inline"
    assert choose_runner(_spec(fn="math"), "auto") == "process"
    assert choose_runner(_spec(fn="_reward_helpers:flaky"), "auto") == "process"
    assert choose_runner(_spec(fn="reverse"), "process") == "process"
    unpicklable = RuleSpec((Term("lambda", lambda p, r, **k: 1.0),))
    assert choose_runner(unpicklable, "auto") == "inline"
    assert "cannot be sent to a process" in runner_problems(unpicklable, "process")[0][1]


# --- the scorer: counts, log samples, the bound -------------------------------------------------

def _batch(responses, meta=None):
    tok = build_char_tokenizer()
    ids = [tok.encode(r) + [tok.eos_token_id] for r in responses]
    width = max(len(i) for i in ids)
    tensor = torch.zeros(len(ids), width, dtype=torch.long)
    mask = torch.zeros(len(ids), width, dtype=torch.long)
    for row, seq in enumerate(ids):
        tensor[row, :len(seq)] = torch.tensor(seq)
        mask[row, :len(seq)] = 1
    return Batch.from_tensors({RESPONSE_IDS: tensor, RESPONSE_MASK: mask},
                              {"prompt": ["p"] * len(ids), "meta": meta or [{} for _ in ids]})


def _scorer(fn, runner="inline", **cfg):
    scorer = RewardScorer(build_char_tokenizer(), _spec(fn=fn),
                          reward_cfg=RewardConfig(fn=fn, runner=runner, **cfg))
    scorer.start()
    return scorer


def test_failures_are_counted_logged_and_not_fatal_below_the_bound(caplog):
    scorer = _scorer("_reward_helpers:flaky")
    with caplog.at_level(logging.WARNING, logger="hybridrl.rewards.scorer"):
        scored = scorer(_batch(["ab", "raise", "nan", "abc", "abcd", "x"]))
    assert scored.scores.tolist() == [2.0, 0.0, 0.0, 3.0, 4.0, 1.0]
    assert scored.metrics["reward/errors"] == 2 and scored.metrics["reward/timeouts"] == 0
    [record] = caplog.records
    assert "2 of 6 responses failed to score (2 errors, 0 timeouts; scored 0)" in record.message
    assert "raised KeyError: 'missing' on response 'raise'" in record.message


def test_most_of_a_batch_failing_stops_the_run_naming_the_key():
    scorer = _scorer("_reward_helpers:flaky")
    with pytest.raises(RewardError) as err:
        scorer(_batch(["text", "raise", "ab", "nan"]))
    message = str(err.value)
    assert "3 of 4 rewards of the batch failed (more than roles.reward.max_failed_fraction=0.5)" in message
    assert "the first: roles.reward.fn '_reward_helpers:flaky' returned str '1.0', not a number" in message


def test_the_bound_is_configurable():
    scorer = _scorer("_reward_helpers:flaky", max_failed_fraction=1.0)
    scored = scorer(_batch(["text", "raise", "nan", "none"]))
    assert scored.scores.tolist() == [0.0] * 4 and scored.metrics["reward/errors"] == 4


def test_timeouts_are_counted_through_the_pool():
    scorer = _scorer("_reward_helpers:flaky", runner="process", timeout_s=1.0, workers=1)
    try:
        scored = scorer(_batch(["ab", "hang", "abc"]))
    finally:
        scorer.close()
    assert scored.scores.tolist() == [2.0, 0.0, 3.0]
    assert scored.metrics == {"reward/errors": 0.0, "reward/timeouts": 1.0}


@pytest.mark.parametrize("runner", ["inline", "process"])
def test_a_reward_that_passes_the_probe_and_fails_later_stops_naming_the_key(runner):
    """Issue 21's case: the first-prompt probe (empty response) passes; later responses raise or return a
    string. The run must not crash with a bare traceback: it stops with the key and the first error."""
    spec = _spec(fn="_reward_helpers:late_failure")
    assert probe_problems(spec, {None: ("p", {})}) == []
    scorer = _scorer("_reward_helpers:late_failure", runner=runner)
    try:
        with pytest.raises(RewardError) as err:
            scorer(_batch(["ab", "abc", "abcd", "a"]))
    finally:
        scorer.close()
    message = str(err.value)
    assert "4 of 4 rewards of the batch failed" in message
    assert "roles.reward.fn '_reward_helpers:late_failure' raised ValueError: cannot parse the response" in message


def test_per_source_means_are_reported():
    scorer = _scorer("_reward_helpers:flaky")
    scored = scorer(_batch(["a", "abc", "ab"], [{"data_source": "x"}, {"data_source": "x"}, {"data_source": "y/z"}]))
    assert scored.metrics["reward/x/mean"] == 2.0 and scored.metrics["reward/y/z/mean"] == 2.0
