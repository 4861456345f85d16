"""Dynamic sampling (DAPO's group filter) and truncated responses: which groups a step keeps, how batches
generated apart are joined, the stop when a step cannot be filled, the soft overlong penalty, and the
pre-flight refusals of settings that cannot be honoured."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridrl.algorithms.overlong import soft_overlong_penalty, truncated_rows
from hybridrl.config import ConfigError, load_config
from hybridrl.engines.batch import GROUP_INDEX, PROMPT_IDS, PROMPT_MASK, RESPONSE_IDS, RESPONSE_MASK, SCORES, Batch
from hybridrl.placement.plan import ClusterSpec
from hybridrl.plugins.discovery import get_registry
from hybridrl.run.dynamic_sampling import (
    GroupFilter,
    GroupsNeverDiffer,
    concat_padded,
    informative_groups,
    merge_batch_metrics,
)
from hybridrl.run.preflight import prepare_run

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"


def scored_batch(scores: list[float], n: int, prompt_width: int = 3, response_width: int = 4) -> Batch:
    rows = len(scores)
    batch = Batch.from_tensors({
        PROMPT_IDS: torch.arange(rows * prompt_width).reshape(rows, prompt_width) + 1,
        PROMPT_MASK: torch.ones(rows, prompt_width, dtype=torch.long),
        RESPONSE_IDS: torch.full((rows, response_width), 7),
        RESPONSE_MASK: torch.ones(rows, response_width, dtype=torch.long),
        SCORES: torch.tensor(scores)}, {"prompt": [f"p{i // n}" for i in range(rows)]})
    batch.set(GROUP_INDEX, torch.arange(rows // n).repeat_interleave(n))
    return batch


def test_only_groups_whose_samples_disagree_are_informative():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5])
    assert informative_groups(scores, torch.tensor([0, 0, 1, 1, 2, 2])) == [1]


def test_a_step_is_filled_from_refills_and_renumbered():
    groups = GroupFilter(groups_needed=3, max_refills=4)
    groups.add(scored_batch([1, 1, 0, 1], n=2))  # group 1 informative
    assert not groups.full
    groups.add(scored_batch([0, 0, 1, 0, 0, 1], n=2, response_width=6))  # groups 1 and 2 informative
    assert groups.full
    batch = groups.batch()
    assert len(batch) == 6
    assert batch[GROUP_INDEX].tolist() == [0, 0, 1, 1, 2, 2]
    assert batch[RESPONSE_IDS].shape == (6, 6)
    assert batch[RESPONSE_MASK][:2, 4:].sum() == 0  # the narrower batch's rows are right-padded, masked
    assert batch["prompt"] == ["p1", "p1", "p1", "p1", "p2", "p2"]
    metrics = groups.metrics()
    assert metrics["filter/refills"] == 1.0
    assert metrics["filter/dropped_share"] == pytest.approx(1 - 3 / 5)


def test_a_full_step_takes_no_more_groups_than_it_needs():
    groups = GroupFilter(groups_needed=1, max_refills=0)
    groups.add(scored_batch([1, 0, 0, 1], n=2))
    assert groups.full and len(groups.batch()) == 2


def test_a_step_that_cannot_be_filled_stops_with_a_sentence():
    groups = GroupFilter(groups_needed=2, max_refills=1)
    groups.add(scored_batch([1, 1, 0, 0], n=2))
    groups.check_refill()  # one refill is allowed
    groups.add(scored_batch([1, 1, 1, 1], n=2))
    with pytest.raises(GroupsNeverDiffer, match=r"algorithm.filter_groups: 2 prompt batches \(4 groups\) gave 0"):
        groups.check_refill()


def test_prompts_of_different_widths_are_left_padded():
    a = scored_batch([1, 0], n=2, prompt_width=2)
    b = scored_batch([1, 0], n=2, prompt_width=5)
    joined = concat_padded([a, b], pad_id=9)
    assert joined[PROMPT_IDS].shape == (4, 5)
    assert joined[PROMPT_IDS][0, :3].tolist() == [9, 9, 9] and joined[PROMPT_MASK][0].tolist() == [0, 0, 0, 1, 1]


def test_metrics_of_several_batches_merge_by_kind():
    merged = merge_batch_metrics([{"reward/mean": 1.0, "reward/max": 2.0, "reward/min": 0.0},
                                  {"reward/mean": 3.0, "reward/max": 5.0, "reward/min": -1.0}])
    assert merged == {"reward/mean": 2.0, "reward/max": 5.0, "reward/min": -1.0}


def test_truncated_rows_reached_the_cap_without_stopping():
    eos = 2
    ids = torch.tensor([[5, 5, 5], [5, eos, 0], [5, 5, eos]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]])
    assert truncated_rows(ids, mask, mask.sum(-1), eos).tolist() == [True, False, False]


def test_soft_overlong_penalty_grows_over_the_buffer():
    penalty = soft_overlong_penalty(torch.tensor([10, 12, 14, 16]), max_len=16, buffer=4, max_penalty=0.5)
    assert penalty.tolist() == pytest.approx([0.0, 0.0, -0.25, -0.5])


def preflight_problems(tmp_path: Path, overrides: list[str]) -> dict[str, str]:
    cfg = load_config(QUICKSTART, [f"trainer.out={tmp_path / 'run'}", *overrides])
    with pytest.raises(ConfigError) as err:
        prepare_run(cfg, get_registry(tuple(cfg.plugins)), ClusterSpec(1, 2, "cpu"))
    found: dict[str, str] = {}
    for key, reason in err.value.problems:
        found[key] = found.get(key, "") + reason
    return found


@pytest.mark.parametrize("overrides, key, reason", [
    (["algorithm.filter_groups=true", "algorithm.name=reinforce_pp", "algorithm.n_samples=1"],
     "algorithm.filter_groups", "needs algorithm.n_samples >= 2"),
    (["algorithm.filter_groups=true", "algorithm.name=remax"], "algorithm.filter_groups", "greedy baseline"),
    (["algorithm.overlong=penalty"], "algorithm.overlong.buffer", "penalty needs a buffer"),
    (["algorithm.overlong={mode: penalty, buffer: 999}"], "algorithm.overlong.buffer", "got 999"),
])
def test_settings_that_cannot_be_honoured_are_refused(tmp_path, overrides, key, reason):
    found = preflight_problems(tmp_path, overrides)
    assert reason in found.get(key, ""), found


def test_an_unknown_overlong_mode_names_its_key():
    with pytest.raises(ConfigError) as err:
        load_config(QUICKSTART, ["algorithm.overlong=chop"])
    assert "algorithm.overlong.mode" in dict(err.value.problems)
