"""The groups in flight (``hybridrl.run.streaming``) without engines: which requests a round sends, how results
join their samples, which groups a step takes, the staleness bound, dropping without partial rollouts, the
state a checkpoint keeps, the forced lengths, and the pre-flight refusals."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hybridrl.config import load_config
from hybridrl.data.loading import PromptRow
from hybridrl.engines.batch import (
    FINISHED,
    GROUP_INDEX,
    MAX_NEW_TOKENS,
    PROMPT_IDS,
    PROMPT_MASK,
    RESPONSE_IDS,
    RESPONSE_MASK,
    ROLLOUT_LOG_PROBS,
    TOKEN_VERSIONS,
    Batch,
    cap_responses,
    complete_groups,
    groups_to_complete,
)
from hybridrl.engines.rollout_kit import GroupCompletion, running_groups
from hybridrl.run.streaming import GroupsInFlight, forced_lengths, streaming_problems

PAD = 0
QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"


def config(*overrides: str):
    return load_config(QUICKSTART, list(overrides))


def prompts(start: int = 0):
    counter = iter(range(start, 10_000))

    def draw() -> list[PromptRow]:
        return [PromptRow(f"p{i}", [10 + i, 20 + i], {"i": i}) for i in [next(counter), next(counter)]]

    return draw


def engine_round(requests: Batch, lengths: dict[int, int], width: int, steps: int) -> Batch:
    """A stand-in for one ``generate_until`` round: row r of group g has ``lengths[(g)]`` tokens to go in
    total; the round decodes ``steps`` tokens of each row (token = 100 + its position)."""
    n = len(requests)
    ids = torch.full((n, width), PAD)
    mask = torch.zeros((n, width), dtype=torch.long)
    finished = torch.zeros(n, dtype=torch.bool)
    for i in range(n):
        budget = int(requests[MAX_NEW_TOKENS][i])
        k = min(steps, budget)
        ids[i, :k] = 100 + torch.arange(k)
        mask[i, :k] = 1
        finished[i] = k == budget
    return Batch.from_tensors({RESPONSE_IDS: ids, RESPONSE_MASK: mask, ROLLOUT_LOG_PROBS: -mask.float(),
                               FINISHED: finished})


def test_batch_helpers():
    out = Batch.from_tensors({RESPONSE_IDS: torch.arange(12).reshape(2, 6),
                              RESPONSE_MASK: torch.ones(2, 6, dtype=torch.long), ROLLOUT_LOG_PROBS: torch.ones(2, 6)})
    capped = cap_responses(out, torch.tensor([2, 6]))
    assert capped[RESPONSE_MASK].sum(-1).tolist() == [2, 6] and capped[ROLLOUT_LOG_PROBS][0, 2:].abs().sum() == 0
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    assert complete_groups(groups, torch.tensor([True, True, True, False, True, True])) == 2
    assert groups_to_complete(groups, 0.5) == 2 and groups_to_complete(groups, 0.01) == 1
    assert groups_to_complete(groups, 1.0) == 3 and groups_to_complete(torch.zeros(0, dtype=torch.long), 0.5) == 0


def test_a_step_takes_the_first_complete_groups_and_resumes_the_rest():
    caps = {0: 2, 1: 9, 2: 3, 3: 9}  # group -> every sample's budget
    flight = GroupsInFlight(2, 2, 2.0, partial=True, max_staleness=1, max_new_tokens=10, pad_id=PAD,
                            response_cap=lambda gid, _: caps.get(gid, 4))
    draw = prompts()
    flight.begin_step(train_version=0, next_prompts=draw)
    assert [g.gid for g in flight] == [0, 1, 2, 3] and flight.share_to_complete() == 0.5
    requests, rows = flight.requests()
    assert requests[MAX_NEW_TOKENS].tolist() == [2, 2, 9, 9, 3, 3, 9, 9]
    assert requests[GROUP_INDEX].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    flight.absorb(rows, engine_round(requests, caps, 10, steps=3), version=0)
    assert not flight.needs_more
    taken = flight.take(2)
    assert [g.gid for g in taken] == [0, 2]
    batch = flight.batch(taken)
    assert batch[GROUP_INDEX].tolist() == [0, 0, 1, 1] and batch[RESPONSE_MASK].sum(-1).tolist() == [2, 2, 3, 3]
    assert batch[RESPONSE_IDS].shape == (4, 10) and batch[TOKEN_VERSIONS].max() == 0
    flight.end_step()
    assert flight.step.carried_groups == 2
    # the next step resumes groups 1 and 3 as prompt + their 3 tokens, with 6 tokens of budget left
    flight.begin_step(train_version=1, next_prompts=draw)
    requests, rows = flight.requests()
    first = requests[PROMPT_IDS][0][requests[PROMPT_MASK][0].bool()].tolist()
    assert first == [11, 21, 100, 101, 102] and requests[MAX_NEW_TOKENS][0] == 6
    flight.absorb(rows, engine_round(requests, caps, 10, steps=10), version=1)
    taken = flight.take(2)
    assert [g.gid for g in taken] == [1, 3]  # the oldest first
    batch = flight.batch(taken)
    assert batch[TOKEN_VERSIONS][0, :9].tolist() == [0, 0, 0] + [1] * 6
    metrics = flight.metrics(batch, actor_version=1)
    assert metrics["async/version_lag_max"] == 1 and metrics["rollout/partial_share"] == 1.0
    assert metrics["async/version_lag_mean"] == pytest.approx(3 / 9)


def refill_round(requests: Batch, width: int, share: float, running: float = 1.0) -> Batch:
    """A stand-in for an engine with ``refill``: every decoding row gains one token a step (token = 100 + its
    position) until its budget ends; ``GroupCompletion`` decides which rows decode and when the round stops."""
    index = requests[GROUP_INDEX]
    schedule = GroupCompletion(index.tolist(), groups_to_complete(index, share), running_groups(index, running))
    budgets = requests[MAX_NEW_TOKENS].tolist()
    decoding, counts = set(schedule.begin()), [0] * len(budgets)
    while decoding and not schedule.done:
        for row in sorted(decoding):
            counts[row] += 1
            if counts[row] == budgets[row]:
                decoding.discard(row)
                decoding.update(schedule.finish(row))
    n = len(budgets)
    mask = (torch.arange(width)[None, :] < torch.tensor(counts)[:, None]).long()
    ids = torch.where(mask.bool(), 100 + torch.arange(width)[None, :].expand(n, width), PAD)
    return Batch.from_tensors({RESPONSE_IDS: ids, RESPONSE_MASK: mask, ROLLOUT_LOG_PROBS: -mask.float(),
                               FINISHED: torch.tensor(schedule.finished)})


def test_refill_keeps_the_target_decoding_and_starts_waiting_groups_as_groups_complete():
    caps = {0: 9, 1: 2, 2: 9, 3: 2, 4: 2}  # group -> every sample's budget; later groups: 4
    flight = GroupsInFlight(2, 2, 1.5, partial=True, max_staleness=1, max_new_tokens=10, pad_id=PAD,
                            response_cap=lambda gid, _: caps.get(gid, 4), refill=True)
    draw = prompts()
    flight.begin_step(train_version=0, next_prompts=draw)
    assert [g.gid for g in flight] == [0, 1, 2, 3, 4]  # the target (3 groups) and a step's worth (2) waiting
    requests, rows = flight.requests()
    share, running = flight.until_args()
    assert (share, running) == (pytest.approx(2 / 5), pytest.approx(3 / 5))
    flight.absorb(rows, refill_round(requests, 10, share, running), version=0)
    # groups 0, 1, 2 decode; 1 completes after 2 tokens and group 3 starts, which completes 2 tokens later
    assert [g.gid for g in flight.take(2)] == [1, 3]
    assert [len(flight.groups[i].samples[0].tokens) for i in range(3)] == [4, 4, 0]  # group 4 never started
    flight.end_step()
    assert flight.step.carried_groups == 2
    # next step: the groups holding tokens decode first, the fresh ones wait (oldest first in each part)
    flight.begin_step(train_version=1, next_prompts=draw)
    requests, _ = flight.requests()
    order = list(dict.fromkeys(requests[GROUP_INDEX].tolist()))
    assert order == [0, 2, 4, 5, 6]
    assert flight.until_args()[1] == pytest.approx(3 / 5)


def test_without_refill_a_round_has_no_waiting_groups():
    flight = GroupsInFlight(2, 2, 1.5, partial=True, max_staleness=1, max_new_tokens=10, pad_id=PAD)
    flight.begin_step(train_version=0, next_prompts=prompts())
    assert len(flight.groups) == 3 and flight.until_args() == (pytest.approx(2 / 3),)


def test_tokens_older_than_the_bound_are_thrown_away_and_regenerated():
    flight = GroupsInFlight(1, 1, 2.0, partial=True, max_staleness=1, max_new_tokens=8, pad_id=PAD,
                            response_cap=lambda gid, _: 8)
    flight.begin_step(0, prompts())
    requests, rows = flight.requests()
    flight.absorb(rows, engine_round(requests, {}, 8, steps=2), version=0)
    flight.begin_step(1, prompts())  # one update later: within the bound
    assert flight.step.thrown_tokens == 0 and len(flight.groups[0].samples[0].tokens) == 2
    flight.begin_step(2, prompts())  # two updates later: past it
    assert flight.step.thrown_tokens == 4 and all(not s.tokens for g in flight for s in g.samples)


def test_without_partial_rollouts_unfinished_groups_are_dropped():
    flight = GroupsInFlight(1, 2, 2.0, partial=False, max_staleness=1, max_new_tokens=8, pad_id=PAD,
                            response_cap=lambda gid, _: 2 if gid == 0 else 8)
    flight.begin_step(0, prompts())
    requests, rows = flight.requests()
    flight.absorb(rows, engine_round(requests, {}, 8, steps=2), version=0)
    assert [g.gid for g in flight.take(1)] == [0]
    flight.end_step()
    assert flight.groups == [] and flight.step.dropped_groups == 1 and flight.step.thrown_tokens == 4


def test_the_groups_in_flight_survive_a_checkpoint_as_plain_data():
    flight = GroupsInFlight(1, 2, 2.0, partial=True, max_staleness=1, max_new_tokens=8, pad_id=PAD)
    flight.begin_step(0, prompts())
    requests, rows = flight.requests()
    flight.absorb(rows, engine_round(requests, {}, 8, steps=3), version=0)
    buffer = io.BytesIO()
    torch.save(flight.state_dict(), buffer)
    buffer.seek(0)
    again = GroupsInFlight(1, 2, 2.0, partial=True, max_staleness=1, max_new_tokens=8, pad_id=PAD)
    again.load_state_dict(torch.load(buffer, weights_only=True))
    assert again.state_dict() == flight.state_dict() and again.next_gid == 2


def test_forced_lengths_are_seeded_and_capped():
    cfg = config("roles.rollout.max_new_tokens=64", "roles.rollout.ignore_eos=true",
                 "roles.rollout.response_lengths={median: 16, sigma: 1.0}")
    length = forced_lengths(cfg)
    draws = [length(g, s) for g in range(50) for s in range(8)]
    assert draws == [forced_lengths(cfg)(g, s) for g in range(50) for s in range(8)]
    assert min(draws) >= 1 and max(draws) == 64 and len(set(draws)) > 20
    assert 10 <= sorted(draws)[len(draws) // 2] <= 24  # the median
    assert forced_lengths(config()) is None


def problems(*overrides: str, can_partial: bool = True, multi_turn: bool = False,
             can_refill: bool = False) -> list[tuple[str, str]]:
    return streaming_problems(config(*overrides), can_partial, "eng", multi_turn, can_refill)


def test_pre_flight_refusals_name_the_key():
    assert problems() == [] and problems("roles.rollout.oversample=1.25") == []
    assert problems("roles.rollout.oversample=1.25", can_partial=False)[0][0] == "roles.rollout.oversample"
    assert "`partial` capability" in problems("roles.rollout.partial=true", can_partial=False)[0][1]
    assert problems("roles.rollout.oversample=2", "trainer.pipelined=true") == []  # split pools: async
    assert "multi-turn" in problems("roles.rollout.oversample=2", multi_turn=True)[0][1]
    assert problems("roles.rollout.response_lengths={median: 8}")[0][0] == "roles.rollout.response_lengths"
    assert problems("roles.rollout.oversample=2", "roles.rollout.refill=true")[0][0] == "roles.rollout.refill"
    assert problems("roles.rollout.oversample=2", "roles.rollout.refill=true", can_refill=True) == []
    with pytest.raises(ValueError, match="roles.rollout.oversample"):
        config("roles.rollout.oversample=0.5")


def test_partial_rollouts_follow_the_groups_left_in_flight():
    from hybridrl.run.streaming import partial_rollouts, refills, streams

    assert not partial_rollouts(config(), True) and not streams(config())
    assert partial_rollouts(config("roles.rollout.oversample=1.25"), True)
    assert not partial_rollouts(config("roles.rollout.oversample=1.25"), False)  # the backend cannot stop early
    # refill at oversample 1 still leaves running groups unfinished when a step has its own: they resume
    refilled = config("roles.rollout.refill=true")
    assert streams(refilled) and partial_rollouts(refilled, True) and refills(refilled, True)
    assert not partial_rollouts(config("roles.rollout.refill=true", "roles.rollout.partial=false"), True)
    assert not refills(config("roles.rollout.oversample=2"), True)  # off by default
    assert refills(config("roles.rollout.oversample=2", "roles.rollout.refill=auto"), True)
    assert not refills(config("roles.rollout.oversample=2", "roles.rollout.refill=auto"), False)


def test_unused_namespace_is_not_a_config():
    # streams() reads only the rollout's keys: a plain namespace is enough for tools that build one
    from hybridrl.run.streaming import streams

    rollout = SimpleNamespace(oversample=1.0, partial="auto")
    assert not streams(SimpleNamespace(roles=SimpleNamespace(rollout=rollout)))
