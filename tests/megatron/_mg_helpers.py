"""Shared pieces of the Megatron tests: tiny Llama/Qwen2 checkpoints, padded batches, a policy-gradient loss and
the independent computations (plain transformers + AdamW) the engine is checked against.

Imported by the test modules and by ``_mg_worker.py`` (run in subprocesses), so it must not import pytest
fixtures, megatron-core, or anything that initialises torch.distributed.
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
    sequence_tensors,
)

#: odd on purpose: with vocab_multiple=1 and tensor_parallel=2 the vocabulary is padded by one id.
VOCAB = 41


def save_tiny(path: Path, family: str = "qwen2", tie: bool = True, seed: int = 0, layers: int = 2,
              rope_scaling: dict | None = None) -> Path:
    """A tiny Qwen2 (QKV bias) or Llama (no bias) with grouped-query attention (4 heads, 2 KV heads), wide
    init (peaky distributions), saved with ``save_pretrained``. ``rope_scaling`` (Llama): e.g. Llama 3's."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2,
                  tie_word_embeddings=tie, rms_norm_eps=1e-6)
    if family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, rope_theta=10000.0))
        with torch.no_grad():  # Qwen2 initialises biases to zero: make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.2)
    else:
        rope = {"rope_type": "default", **(rope_scaling or {}), "rope_theta": 500000.0}
        model = LlamaForCausalLM(LlamaConfig(**common, rope_parameters=rope))
    with torch.no_grad():  # norms start at one: make their loading observable
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return path


def make_batch(size: int, seed: int, max_prompt: int = 6, max_response: int = 5) -> Batch:
    """Left-padded prompts and right-padded responses of random lengths (>= 1), random advantages."""
    gen = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(1, max_prompt + 1, (size,), generator=gen).tolist()
    response_lens = torch.randint(1, max_response + 1, (size,), generator=gen).tolist()
    prompt_lens[0], response_lens[0] = max_prompt, max_response
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in prompt_lens]
    responses = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in response_lens]
    prompt_ids, prompt_mask = left_pad(prompts, pad_id=0)
    response_ids, response_mask = right_pad(responses, pad_id=0)
    advantages = torch.randn(size, max_response, generator=gen) * response_mask
    return Batch.from_tensors({PROMPT_IDS: prompt_ids, PROMPT_MASK: prompt_mask, RESPONSE_IDS: response_ids,
                               RESPONSE_MASK: response_mask, ADVANTAGES: advantages})


class PolicyGradient:
    """``-(log_probs * adv * mask).sum() / total_tokens * dp_size``: this micro-batch's exact share of the
    global token-mean loss."""

    needs = ("log_probs",)

    def __call__(self, outputs: dict[str, torch.Tensor], micro_batch: Batch, scale: LossScale
                 ) -> tuple[torch.Tensor, dict[str, float]]:
        mask = micro_batch[RESPONSE_MASK].float()
        loss = -(outputs["log_probs"] * micro_batch[ADVANTAGES] * mask).sum() / scale.total_tokens * scale.dp_size
        return loss, {"tokens": float(mask.sum())}


class ValueRegression:
    """A critic's loss: ``sum(mask * (values - returns)^2) / total_tokens * dp_size`` (returns: the advantages
    column of ``make_batch``)."""

    needs = ("values",)

    def __call__(self, outputs: dict[str, torch.Tensor], micro_batch: Batch, scale: LossScale
                 ) -> tuple[torch.Tensor, dict[str, float]]:
        mask = micro_batch[RESPONSE_MASK].float()
        err = (outputs["values"] - micro_batch[ADVANTAGES]) ** 2 * mask
        return err.sum() / scale.total_tokens * scale.dp_size, {"tokens": float(mask.sum())}


class NaNObjective(PolicyGradient):
    def __call__(self, outputs, micro_batch, scale):
        loss, metrics = super().__call__(outputs, micro_batch, scale)
        return loss * float("nan"), metrics


def context(model_path: Path, rank: int = 0, world_size: int = 1, trainable: bool = True, role: str | None = None,
            **options) -> EngineContext:
    return EngineContext(role=role or ("actor" if trainable else "ref"), backend="megatron",
                         model_path=str(model_path), rank=rank, world_size=world_size, device="cpu", seed=0,
                         trainable=trainable, **_split(options))


def assert_close(got: torch.Tensor, want: torch.Tensor, atol: float, what: str) -> None:
    """``torch.testing.assert_close`` with ``rtol=0``, its report prefixed by ``what``."""
    torch.testing.assert_close(got, want, atol=atol, rtol=0, msg=lambda report: f"{what}: {report}")


def hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_response_log_probs(model, batch: Batch) -> torch.Tensor:
    """Per-token log-probs of the responses from a transformers forward (full-vocabulary log-softmax)."""
    ids, mask, pos = sequence_tensors(batch)
    r = batch[RESPONSE_IDS].shape[1]
    p = ids.shape[1] - r
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, p - 1: p + r - 1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, batch[RESPONSE_IDS][..., None]).squeeze(-1)
    return lp * batch[RESPONSE_MASK]


def logits_input(seed: int = 3, batch: int = 2, length: int = 9) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def plain_training(model_path: Path, batch: Batch, steps: int, micro_batch: int, lr: float, grad_clip: float
                   ) -> tuple[dict[str, torch.Tensor], list[float], list[float]]:
    """The same training written directly: one unsharded transformers model, AdamW, gradients accumulated
    over micro-batches of the token-mean loss, clipped. Returns (weights, losses, gradient norms)."""
    model = hf_model(model_path).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
    total = float(batch[RESPONSE_MASK].sum())
    losses, norms = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss_sum = 0.0
        for start in range(0, len(batch), micro_batch):
            micro = batch.index(range(start, min(start + micro_batch, len(batch))))
            loss = -(hf_response_log_probs(model, micro) * micro[ADVANTAGES]).sum() / total
            loss.backward()
            loss_sum += float(loss.detach())
        losses.append(loss_sum)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)))
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, losses, norms


class PlainCritic(torch.nn.Module):
    """A transformers backbone plus ``nn.Linear(hidden, 1)``: the critic written directly."""

    def __init__(self, model_path: Path, head_weight: torch.Tensor, head_bias: torch.Tensor) -> None:
        from transformers import AutoModel

        super().__init__()
        self.backbone = AutoModel.from_pretrained(model_path, dtype=torch.float32)
        self.head = torch.nn.Linear(head_weight.shape[1], 1)
        with torch.no_grad():
            self.head.weight.copy_(head_weight)
            self.head.bias.copy_(head_bias)

    def response_values(self, batch: Batch) -> torch.Tensor:
        ids, mask, pos = sequence_tensors(batch)
        hidden = self.backbone(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
        r = batch[RESPONSE_IDS].shape[1]
        p = ids.shape[1] - r
        return self.head(hidden)[:, p - 1: p + r - 1, 0] * batch[RESPONSE_MASK]

    def hf_state(self) -> dict[str, torch.Tensor]:
        """Weights under the engine's export names."""
        out = {f"model.{n}": t.detach().clone() for n, t in self.backbone.named_parameters()}
        out.update({f"value_head.{n}": t.detach().clone() for n, t in self.head.named_parameters()})
        return out


def plain_critic_training(critic: PlainCritic, batch: Batch, steps: int, micro_batch: int, lr: float,
                          grad_clip: float) -> tuple[list[float], list[float]]:
    """``ValueRegression`` trained directly on ``critic`` (in place): (losses, gradient norms)."""
    critic.train()
    opt = torch.optim.AdamW(critic.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
    total = float(batch[RESPONSE_MASK].sum())
    losses, norms = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss_sum = 0.0
        for start in range(0, len(batch), micro_batch):
            micro = batch.index(range(start, min(start + micro_batch, len(batch))))
            err = (critic.response_values(micro) - micro[ADVANTAGES]) ** 2 * micro[RESPONSE_MASK]
            loss = err.sum() / total
            loss.backward()
            loss_sum += float(loss.detach())
        losses.append(loss_sum)
        norms.append(float(torch.nn.utils.clip_grad_norm_(critic.parameters(), grad_clip)))
        opt.step()
    return losses, norms


def _split(options: dict) -> dict:
    """The flat options of a test as the engine context's ``training`` and backend ``options``."""
    training, own = TrainingOptions.split(options)
    return {"training": training, "options": own}
