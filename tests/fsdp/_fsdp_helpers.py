"""Shared pieces of the FSDP engine tests: a tiny Qwen2 checkpoint, padded batches, a policy-gradient objective.

Imported by the test modules and by ``_fsdp_worker.py`` (a script run in subprocesses), so it must not import
pytest fixtures or anything that initialises torch.distributed.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hybridrl.engines import EngineContext, LossScale, TrainingOptions
from hybridrl.engines.batch import (
    ADVANTAGES,
    PROMPT_IDS,
    PROMPT_MASK,
    RESPONSE_IDS,
    RESPONSE_MASK,
    Batch,
    left_pad,
    right_pad,
)

VOCAB = 40


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter or optimizer state: a DTensor's local shard, or the tensor itself (one
    CPU rank keeps a plain module, see ``hybridrl_fsdp.engine.uses_fsdp``)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def save_tiny_qwen2(path: Path, tie: bool = True, seed: int = 0) -> Path:
    """A 2-layer Qwen2 with hidden size 32, saved with ``save_pretrained`` (wide init: peaky distributions)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         initializer_range=0.2, tie_word_embeddings=tie)
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def save_tiny_reward_model(path: Path) -> Path:
    """A 2-layer Qwen2 sequence classifier (one label) with hidden size 32, saved with ``save_pretrained``."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=0)
    Qwen2ForSequenceClassification(config).save_pretrained(path)
    return path


def reward_context(model_path: Path, **options) -> EngineContext:
    return EngineContext(role="reward", backend="fsdp", model_path=str(model_path), rank=0, world_size=1,
                         trainable=False, **_split(options))


def make_batch(size: int, seed: int, max_prompt: int = 6, max_response: int = 5) -> Batch:
    """Left-padded prompts and right-padded responses of random lengths (>= 1), random advantages."""
    gen = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(1, max_prompt + 1, (size,), generator=gen).tolist()
    response_lens = torch.randint(1, max_response + 1, (size,), generator=gen).tolist()
    prompt_lens[0], response_lens[0] = max_prompt, max_response  # fix the widths
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in prompt_lens]
    responses = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in response_lens]
    prompt_ids, prompt_mask = left_pad(prompts, pad_id=0)
    response_ids, response_mask = right_pad(responses, pad_id=0)
    advantages = torch.randn(size, max_response, generator=gen) * response_mask
    return Batch.from_tensors({PROMPT_IDS: prompt_ids, PROMPT_MASK: prompt_mask, RESPONSE_IDS: response_ids,
                               RESPONSE_MASK: response_mask, ADVANTAGES: advantages})


def grouped(sizes: tuple[int, ...] = (4, 1, 3, 4), seed: int = 5, max_prompt: int = 7, max_response: int = 6) -> Batch:
    """Rows in groups that share a prompt (GRPO's samples of one prompt), responses of random lengths; the
    groups' rows interleaved, so that sharing cannot lean on their order."""
    batch = make_batch(sum(sizes), seed=seed, max_prompt=max_prompt, max_response=max_response)
    owner = torch.cat([torch.full((n,), g) for g, n in enumerate(sizes)])
    first = torch.tensor([sum(sizes[:g]) for g in range(len(sizes))])
    order = torch.randperm(len(owner), generator=torch.Generator().manual_seed(seed))
    tensors = dict(batch.tensors)
    tensors[PROMPT_IDS] = batch[PROMPT_IDS][first[owner]][order]
    tensors[PROMPT_MASK] = batch[PROMPT_MASK][first[owner]][order]
    return Batch.from_tensors(tensors)


class PolicyGradient:
    """``-(log_probs * adv * mask).sum() / total_tokens * dp_size``: the exact share of the global
    token-mean loss that this micro-batch of this rank contributes."""

    needs = ("log_probs",)

    def __call__(self, outputs: dict[str, torch.Tensor], micro_batch: Batch, scale: LossScale
                 ) -> tuple[torch.Tensor, dict[str, float]]:
        mask = micro_batch[RESPONSE_MASK].float()
        weighted = outputs["log_probs"] * micro_batch[ADVANTAGES] * mask
        loss = -weighted.sum() / scale.total_tokens * scale.dp_size
        mean_lp = float((outputs["log_probs"].detach() * mask).sum() / mask.sum().clamp(min=1))
        return loss, {"mean_log_prob": mean_lp}


class NaNObjective(PolicyGradient):
    """The policy-gradient loss times NaN: every gradient is NaN."""

    def __call__(self, outputs, micro_batch, scale):
        loss, metrics = super().__call__(outputs, micro_batch, scale)
        return loss * float("nan"), metrics


def context(model_path: Path, rank: int = 0, world_size: int = 1, trainable: bool = True, **options) -> EngineContext:
    return EngineContext(role="actor" if trainable else "ref", backend="fsdp", model_path=str(model_path), rank=rank,
                         world_size=world_size, device="cpu", seed=0, trainable=trainable, **_split(options))


def _split(options: dict) -> dict:
    """The flat options of a test as the engine context's ``training`` and backend ``options``."""
    training, own = TrainingOptions.split(options)
    return {"training": training, "options": own}
