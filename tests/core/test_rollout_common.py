"""``hybridrl.engines.rollout_kit``: the engine-free pieces the rollout backends share (the vLLM and SGLang plugins'
own tests exercise them through their modules; these run with the core alone)."""

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from hybridrl.engines import rollout_kit as common
from hybridrl.engines.batch import (
    MAX_NEW_TOKENS,
    RESPONSE_IDS,
    RESPONSE_MASK,
    ROLLOUT_LOG_PROBS,
    Batch,
    complete_groups,
    left_pad,
)


def test_eos_and_pad_prefers_the_generation_config_and_falls_back_to_the_first_eos():
    gen = SimpleNamespace(eos_token_id=[5, 6], pad_token_id=None)
    cfg = SimpleNamespace(eos_token_id=2, pad_token_id=0)
    assert common.eos_and_pad(gen, cfg, "/m") == ([5, 6], 0)
    assert common.eos_and_pad(None, SimpleNamespace(eos_token_id=3), "/m") == ([3], 3)
    with pytest.raises(ValueError, match="model at '/m' names no eos_token_id"):
        common.eos_and_pad(None, SimpleNamespace(), "/m")


def test_special_ids_reads_the_saved_configs(tmp_path):
    from transformers import GenerationConfig, Qwen2Config

    Qwen2Config(eos_token_id=1, pad_token_id=None).save_pretrained(tmp_path)
    assert common.special_ids(str(tmp_path)) == ([1], 1)  # no generation config: the model config
    GenerationConfig(eos_token_id=[7, 1], pad_token_id=4).save_pretrained(tmp_path)
    assert common.special_ids(str(tmp_path)) == ([7, 1], 4)
    assert common.special_ids(str(tmp_path), cfg=SimpleNamespace()) == ([7, 1], 4)


def test_replica_layout_groups_consecutive_ranks():
    layouts = [common.ReplicaLayout(r, 6, 2) for r in range(6)]
    assert [lay.replica for lay in layouts] == [0, 0, 1, 1, 2, 2]
    assert [lay.leader for lay in layouts] == [True, False] * 3
    assert layouts[3].peers == [2, 3] and layouts[3].replicas == 3
    info = layouts[4].data_parallel()
    assert (info.dp_rank, info.dp_size, info.returns_output) == (2, 3, True)
    with pytest.raises(ValueError, match="outside a pool of 6"):
        common.ReplicaLayout(6, 6, 2)


def test_seeds_are_deterministic_and_distinct():
    assert common.mix_seed(1, 2) == common.mix_seed(1, 2) != common.mix_seed(2, 1)
    seeds = common.request_seeds(7, 0, 4)
    assert len(set(seeds)) == 4 and all(0 <= s < 2**63 for s in seeds)
    assert common.request_seeds(None, 0, 4) is None
    assert common.engine_seed(7, 0) != common.engine_seed(7, 1) and 0 <= common.engine_seed(7, 1) < 2**31 - 1


def test_unpad_check_and_pack():
    ids, mask = left_pad([[3, 4], [5]], pad_id=0)
    prompts = common.unpad_prompts(ids, mask)
    assert prompts == [[3, 4], [5]]
    common.check_context(prompts, 2, 4)
    with pytest.raises(ValueError, match="row 0: prompt of 2 tokens"):
        common.check_context(prompts, 3, 4)
    out = common.pack_responses([[1, 2], []], [[-0.5, -1.0], []], 3, pad_id=9)
    assert out[RESPONSE_IDS].tolist() == [[1, 2, 9], [9, 9, 9]]
    assert out[RESPONSE_MASK].tolist() == [[1, 1, 0], [0, 0, 0]]
    torch.testing.assert_close(out[ROLLOUT_LOG_PROBS], torch.tensor([[-0.5, -1.0, 0.0], [0.0, 0.0, 0.0]]))
    assert ROLLOUT_LOG_PROBS not in common.pack_responses([[1]], None, 2, pad_id=0)


@dataclass(frozen=True)
class _Opts:
    tensor_parallel: int = 1
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool | None = None
    seed_mode: str = "auto"
    extra: dict = field(default_factory=dict)


def test_row_caps_clamp_to_the_width_and_context_checks_each_rows_budget():
    batch = Batch.from_tensors({MAX_NEW_TOKENS: torch.tensor([3, 0, 12, -1])})
    assert common.row_caps(batch, 8) == [3, 0, 8, 0]
    assert common.row_caps(Batch.from_tensors({"x": torch.zeros(2)}), 8) is None
    # a resumed row (prompt + tokens so far) fits with the rest of its budget, not with the whole width
    common.check_context([[1] * 10, [1] * 4], [2, 8], context_length=12)
    with pytest.raises(ValueError, match="row 0: prompt of 10 tokens \\+ max_new_tokens=8"):
        common.check_context([[1] * 10, [1] * 4], 8, context_length=12)
    with pytest.raises(ValueError, match="row 1: prompt of 4 tokens \\+ max_new_tokens=9"):
        common.check_context([[1] * 10, [1] * 4], [2, 9], context_length=12)


def test_group_completion_counts_groups_as_their_last_row_ends():
    groups = [5, 5, 7, 9, 9, 9]
    done = common.GroupCompletion(groups, groups_needed=2)
    finished = torch.zeros(6, dtype=torch.bool)
    for row in (0, 3, 3, 4, 2):  # a repeated row counts once
        assert not done.done
        done.finish(row)
        finished[row] = True
        assert done.complete == complete_groups(torch.tensor(groups), finished)
    assert done.complete == 1 and not done.done  # group 7 only: 5 and 9 each wait for a row
    done.finish(1)
    assert done.done and done.complete == 2 and done.finished == [True, True, True, True, True, False]
    assert common.GroupCompletion([], 0).done


def test_group_completion_keeps_running_groups_decoding_and_starts_waiting_ones_in_order():
    groups = [3, 3, 1, 1, 4, 4, 8, 8]  # four groups, in the order of their first row: 3, 1, 4, 8
    schedule = common.GroupCompletion(groups, groups_needed=3, running=2)
    assert schedule.begin() == [0, 1, 2, 3]  # groups 3 and 1 decode; 4 and 8 wait
    assert schedule.finish(2) == []  # group 1 still has a row running
    assert schedule.finish(3) == [4, 5]  # group 1 complete: group 4 starts
    assert schedule.finish(0) == [] and schedule.finish(1) == [6, 7]  # group 3 complete: group 8 starts
    assert not schedule.done
    assert schedule.finish(5) == [] and schedule.finish(4) == []  # the third group completes: done, none starts
    assert schedule.done and schedule.finished == [True] * 6 + [False] * 2


def test_group_completion_passes_over_a_waiting_group_with_nothing_left_to_decode():
    # rows 2-3 (group 1) have no budget left: finished before the call, complete without a slot
    schedule = common.GroupCompletion([0, 0, 1, 1, 2, 2], groups_needed=3, running=1)
    schedule.finish(2)
    schedule.finish(3)
    assert schedule.complete == 1
    assert schedule.begin() == [0, 1]
    assert schedule.finish(0) == [] and schedule.finish(1) == [4, 5]  # group 1 skipped: it needs no decoding
    # a running group with nothing to decode frees its slot at once
    early = common.GroupCompletion([0, 0, 1, 1], groups_needed=2, running=1)
    early.finish(0)
    early.finish(1)
    assert early.begin() == [2, 3]


def test_running_groups_is_a_share_of_the_calls_groups():
    index = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 4, 4])
    assert common.running_groups(index, 1.0) is None
    assert common.running_groups(index, 0.5) == 3  # ceil(2.5)
    assert common.running_groups(index, 0.01) == 1


def test_options_unset_keys_keep_the_defaults():
    options = {"tensor_parallel": "2", "enforce_eager": None, "seed_mode": "", "other": 1}
    read = common.read_options(options, common.ENGINE_OPTION_CASTS)
    made = _Opts(**read, **common.read_choices(options, ["seed_mode"]))
    assert made == _Opts(tensor_parallel=2)
    common.check_engine_options(made.tensor_parallel, made.gpu_memory_utilization)
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        common.check_engine_options(1, 1.5)
    with pytest.raises(ValueError, match=r"seed_mode must be one of \('a', 'b'\), got 'c'"):
        common.check_choice("seed_mode", "c", ("a", "b"))
