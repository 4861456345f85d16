"""``rollout/identical_groups``: the share of groups whose samples are token-identical (padding ignored), and
one warning naming ``roles.rollout`` once every group was identical for three steps in a row."""

from __future__ import annotations

import logging

import torch

from hybridrl.engines.batch import GROUP_INDEX, RESPONSE_IDS, RESPONSE_MASK, Batch
from hybridrl.rollout.identical_groups import IdenticalGroupsWarning, identical_group_share, identical_groups_metrics


def batch(responses: list[list[int]], group: list[int], width: int = 5) -> Batch:
    ids = torch.full((len(responses), width), 7)  # garbage past each row's end: ignored
    mask = torch.zeros(len(responses), width, dtype=torch.long)
    for i, r in enumerate(responses):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return Batch.from_tensors({RESPONSE_IDS: ids, RESPONSE_MASK: mask, GROUP_INDEX: torch.tensor(group)}, {})


def test_the_share_of_groups_whose_samples_are_all_the_same():
    b = batch([[1, 2], [1, 2], [1, 2], [3], [3, 4], [5, 6, 7], [5, 6, 7]], [0, 0, 0, 1, 1, 2, 2])
    share = identical_group_share(b[RESPONSE_IDS], b[RESPONSE_MASK], b[GROUP_INDEX])
    assert share == 2 / 3  # group 1 differs: [3] and [3, 4] (a prefix is not the same response)


def test_groups_interleaved_and_unordered_are_found():
    b = batch([[1], [2], [1], [2]], [5, 9, 5, 9])
    assert identical_group_share(b[RESPONSE_IDS], b[RESPONSE_MASK], b[GROUP_INDEX]) == 1.0
    b = batch([[1], [2], [1], [3]], [5, 9, 5, 9])
    assert identical_group_share(b[RESPONSE_IDS], b[RESPONSE_MASK], b[GROUP_INDEX]) == 0.5


def test_one_sample_per_prompt_has_no_share():
    b = batch([[1], [1]], [0, 1])
    assert identical_group_share(b[RESPONSE_IDS], b[RESPONSE_MASK], b[GROUP_INDEX]) is None
    assert identical_groups_metrics(b, IdenticalGroupsWarning(), 1.0, 1) == {}


def test_three_identical_steps_in_a_row_warn_once_naming_the_rollout(caplog):
    same, mixed = batch([[1, 2], [1, 2]], [0, 0]), batch([[1, 2], [2, 1]], [0, 0])
    warning = IdenticalGroupsWarning()
    with caplog.at_level(logging.WARNING, logger="hybridrl.rollout.identical_groups"):
        for b in (same, same, mixed, same, same):  # interrupted: never three in a row
            assert identical_groups_metrics(b, warning, 0.01, 2)["rollout/identical_groups"] in (0.0, 1.0)
        assert not caplog.records
        for _ in range(4):
            identical_groups_metrics(same, warning, 0.01, 2)
    [record] = caplog.records
    assert record.getMessage().startswith("roles.rollout: the 2 samples of every prompt came back token-identical "
                                          "for 3 steps in a row")
    assert "roles.rollout.temperature=0.01" in record.getMessage() and "seed" in record.getMessage()
