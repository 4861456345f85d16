"""The kit's own pieces: backend selection, the models it builds, its reference sampling filter, and the
input checks of the built-in ``hf`` rollout at the context boundary."""

from __future__ import annotations

import pytest
import torch

from hybridrl.batch import RESPONSE_MASK
from hybridrl.engines import EngineContext, SamplingParams
from hybridrl.rollout.hf import HFRollout, filter_logits
from hybridrl.testing.batches import prompt_batch
from hybridrl.testing.models import KIT_WIDTH, build_kit_models
from hybridrl.testing.reference import ReferenceModel, filter_top_k_top_p
from hybridrl.testing.selection import SelectionError, select

REGISTERED = {("train", "fsdp"), ("train", "megatron"), ("rollout", "hf"), ("rollout", "vllm"), ("rollout", "x"),
              ("train", "x")}


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    return build_kit_models(tmp_path_factory.mktemp("kit"))


def test_selection_infers_kinds_and_pairs_trainers_with_rollouts():
    assert select(["vllm"], REGISTERED).bridges == [("fsdp", "vllm")]  # a lone rollout: the built-in trainer
    assert select(["megatron"], REGISTERED).bridges == [("megatron", "hf")]
    both = select(["megatron", "vllm", "fsdp", "vllm"], REGISTERED)
    assert both.train == ["megatron", "fsdp"] and both.rollout == ["vllm"]
    assert both.bridges == [("megatron", "vllm"), ("fsdp", "vllm")]
    assert select(["x"], REGISTERED).train == ["x"] and select(["x"], REGISTERED).rollout == ["x"]
    with pytest.raises(SelectionError, match=r"'nope'.*train: fsdp, megatron, x; rollout: hf, vllm, x"):
        select(["hf", "nope"], REGISTERED)


def test_kit_models_stop_some_rows_at_eos_and_not_others(kit):
    policy, other = ReferenceModel(kit.policy), ReferenceModel(kit.other)
    rows = [policy.greedy(p, KIT_WIDTH, kit.eos_ids) for p in kit.prompts]
    early = [r for r in rows if len(r) < KIT_WIDTH]
    assert early and all(r[-1] in kit.eos_ids and len(r) >= 2 for r in early)
    assert any(len(r) == KIT_WIDTH and not set(r) & set(kit.eos_ids) for r in rows)
    assert rows != [other.greedy(p, KIT_WIDTH, kit.eos_ids) for p in kit.prompts]  # import is observable
    assert build_kit_models(kit.policy.parent.parent) == kit  # a second build reuses the folder


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (1, 1.0), (5, 1.0), (0, 0.5), (0, 0.9), (7, 0.8)])
def test_reference_filter_agrees_with_the_hf_rollout(top_k, top_p):
    logits = torch.randn(16, 47, generator=torch.Generator().manual_seed(top_k * 10 + int(top_p * 10))) * 3
    mine = torch.isinf(filter_top_k_top_p(logits, top_k, top_p))
    theirs = torch.isinf(filter_logits(logits, top_k, top_p))
    assert torch.equal(mine, theirs)
    assert (~mine).sum(-1).min() >= 1


def test_hf_rollout_accepts_a_prompt_that_just_fits(kit):
    engine = HFRollout(EngineContext("rollout", "hf", str(kit.policy), 0, 1))
    fits = [kit.prompts[1][i % len(kit.prompts[1])] for i in range(kit.context_length - 4)]
    out = engine.generate(prompt_batch([kit.prompts[0], fits], kit.pad_id),
                          SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True))
    assert out[RESPONSE_MASK][1].tolist() == [1, 1, 1, 1]
    with pytest.raises(ValueError, match=r"row 1: prompt of 60 tokens \+ max_new_tokens=5 exceeds .* 64"):
        engine.generate(prompt_batch([kit.prompts[0], fits], kit.pad_id), SamplingParams(max_new_tokens=5))


def test_reference_problems_widen_with_the_logits_only_when_asked(kit):
    """``logit_rtol``: a log-prob off by a bfloat16-sized error relative to the row's largest logit passes, the
    same error fails the fixed tolerance, and a row from other weights fails either way."""
    from hybridrl.batch import RESPONSE_IDS, ROLLOUT_LOG_PROBS, Batch
    from hybridrl.testing.checks import reference_problems

    ref = ReferenceModel(kit.policy)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=KIT_WIDTH)
    prompt = kit.prompts[0]
    row = ref.greedy(prompt, KIT_WIDTH)
    logits = ref.step_logits(prompt, row)
    logp = torch.log_softmax(logits.float(), -1)[torch.arange(len(row)), torch.tensor(row)]
    largest = float(logits.abs().max())

    def out(values: torch.Tensor, ids: list[int]) -> Batch:
        return Batch.from_tensors({RESPONSE_IDS: torch.tensor([ids]), ROLLOUT_LOG_PROBS: values[None].float(),
                                   RESPONSE_MASK: torch.ones(1, len(ids), dtype=torch.long)})

    noisy = logp + 0.5 * 2**-5 * largest + 1e-3  # half the widening on top of the fixed tolerance
    assert reference_problems(out(noisy, row), [prompt], ref, greedy, [], 1e-3, 1e-4)[1]
    assert reference_problems(out(noisy, row), [prompt], ref, greedy, [], 1e-3, 1e-4, logit_rtol=2**-5) == ([], [])
    other = ReferenceModel(kit.other).greedy(prompt, KIT_WIDTH)
    tokens, _ = reference_problems(out(torch.zeros(len(other)), other), [prompt], ref, greedy, [], 1e-3, 1e-4,
                                   logit_rtol=2**-5)
    assert tokens, "another model's greedy row passed as this model's"
