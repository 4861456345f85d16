"""The kit's own pieces: backend selection, the models it builds, its reference sampling filter, and the
input checks of the built-in ``hf`` rollout at the context boundary."""

from __future__ import annotations

import pytest
import torch

from hybridrl.engines import EngineContext, SamplingParams
from hybridrl.engines.batch import RESPONSE_MASK
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
    from hybridrl.engines.batch import RESPONSE_IDS, ROLLOUT_LOG_PROBS, Batch
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


def test_a_token_just_past_a_top_k_or_top_p_edge_is_a_near_tie_and_no_further():
    """``near_support_edge``: the first token outside the support, within the tolerance of getting in, is
    allowed (a 16-bit engine's logits may put it inside); the next one, a banned EOS, a greedy row or a zero
    tolerance are not."""
    from hybridrl.testing.reference import near_support_edge

    top_k = SamplingParams(temperature=1.0, top_k=2)
    logits = torch.tensor([5.0, 4.0, 3.98, 3.0, 0.0])  # ranks: 0, 1 | 2 (0.02 below rank 1), 3, 4
    assert near_support_edge(logits, 2, top_k, [], 0, tolerance=0.05)
    assert not near_support_edge(logits, 2, top_k, [], 0, tolerance=0.0)
    assert not near_support_edge(logits, 3, top_k, [], 0, tolerance=5.0)  # not the first past the edge
    assert not near_support_edge(logits, 1, top_k, [], 0, tolerance=0.05)  # inside: not this function's case
    assert not near_support_edge(logits, 2, SamplingParams(temperature=0.0), [], 0, tolerance=0.05)
    banned = SamplingParams(temperature=1.0, top_k=2, min_new_tokens=3)
    assert not near_support_edge(logits, 2, banned, [2], 1, tolerance=0.05)  # an EOS before min_new_tokens
    probs = torch.tensor([0.60, 0.305, 0.05, 0.045])  # before the third: 0.905, just past top_p=0.9
    top_p = SamplingParams(temperature=1.0, top_p=0.9)
    assert near_support_edge(probs.log(), 2, top_p, [], 0, tolerance=0.05)
    assert not near_support_edge(probs.log(), 2, top_p, [], 0, tolerance=0.001)
    assert not near_support_edge(probs.log(), 3, top_p, [], 0, tolerance=0.05)


def _noisy_rows(ref: ReferenceModel, prompts, params: SamplingParams, noise: float, seed: int, eos_ids):
    """A simulated 16-bit engine: each step samples from the reference's logits plus noise of ``noise`` times
    the step's largest logit, with the engine-side truncation, and reports that distribution's log-prob."""
    from hybridrl.engines.batch import RESPONSE_IDS, ROLLOUT_LOG_PROBS, Batch
    from hybridrl.testing.reference import sampling_log_probs

    gen = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(prompts), KIT_WIDTH, dtype=torch.long)
    logps = torch.zeros(len(prompts), KIT_WIDTH)
    for i, prompt in enumerate(prompts):
        row: list[int] = []
        for t in range(KIT_WIDTH):
            logits = ref.step_logits(prompt, row + [0])[-1:]
            logits = logits + noise * logits.abs().max() * torch.randn(logits.shape, generator=gen)
            logp = sampling_log_probs(logits, params, eos_ids, first_step=t)[0]
            token = int(torch.multinomial(logp.exp(), 1, generator=gen))
            row.append(token)
            ids[i, t], logps[i, t] = token, logp[token]
    return Batch.from_tensors({RESPONSE_IDS: ids, ROLLOUT_LOG_PROBS: logps,
                               RESPONSE_MASK: torch.ones_like(ids)})


def test_sampled_rows_of_a_noisy_but_right_engine_pass_and_of_one_ignoring_top_p_fail(kit):
    """With bfloat16-sized logit noise a correct engine draws tokens just past a top-k/top-p edge now and then;
    the 16-bit tolerances let those through, while an engine that ignores top-p is still caught."""
    from dataclasses import replace

    from hybridrl.testing.checks import reference_problems

    ref = ReferenceModel(kit.policy)
    tolerances = (0.1, 0.05, 2**-5)  # the SGLang engine tests' bfloat16 setting
    for params in (SamplingParams(temperature=0.8, top_k=4, max_new_tokens=KIT_WIDTH, ignore_eos=True),
                   SamplingParams(temperature=1.0, top_p=0.8, max_new_tokens=KIT_WIDTH, ignore_eos=True)):
        for seed in range(3):
            out = _noisy_rows(ref, kit.prompts, params, 2**-7, seed, kit.eos_ids)
            problems = reference_problems(out, kit.prompts, ref, params, kit.eos_ids, *tolerances)
            assert problems == ([], []), (params, seed)
    top_p = SamplingParams(temperature=1.0, top_p=0.8, max_new_tokens=KIT_WIDTH, ignore_eos=True)
    caught = [reference_problems(_noisy_rows(ref, kit.prompts, replace(top_p, top_p=1.0), 2**-7, seed, kit.eos_ids),
                                 kit.prompts, ref, top_p, kit.eos_ids, *tolerances)[0] for seed in range(3)]
    assert all(caught), "an engine sampling past top-p passed"
