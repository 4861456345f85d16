"""Scoring responses: rule rewards (a Python function of prompt and text, in the driver) and a reward model
(``AutoModelForSequenceClassification`` with one label, run by the ``reward`` role on its pool), alone or
added together (``score = rule + roles.reward.model.coef * model``).

Also builds the tiny random reward model the tests and examples use (no download).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from hybridrl.run.atomic_dir import replaced_atomically
from hybridrl.batch import PROMPT_IDS, PROMPT_MASK, RESPONSE_IDS, RESPONSE_MASK, SCORES, Batch

#: marks a folder built by ``build_tiny_reward_model`` and records its config.
REWARD_MARKER = "hybridrl_tiny_reward.json"


def decode_responses(tokenizer: Any, batch: Batch) -> list[str]:
    lengths = batch[RESPONSE_MASK].sum(-1).tolist()
    ids = batch[RESPONSE_IDS]
    return [tokenizer.decode(ids[i, : int(n)].tolist(), skip_special_tokens=True) for i, n in enumerate(lengths)]


def on_last_token(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, R) token rewards holding each row's score on its last response token."""
    lengths = mask.sum(-1)
    token_rewards = torch.zeros(mask.shape, dtype=torch.float32)
    token_rewards[torch.arange(len(scores)), (lengths - 1).clamp(min=0)] = scores.float()
    return token_rewards * mask


@dataclass(frozen=True)
class Scored:
    """A scored batch: ``scores`` (B,), the decoded ``texts``, the ``parts`` (``rule`` and/or ``model`` scores)
    and the reward model's compute seconds (None without a model)."""

    scores: torch.Tensor
    texts: list[str]
    parts: dict[str, torch.Tensor]
    model_compute_s: float | None = None


class RewardScorer:
    """Scores batches that hold ``prompt``, ``meta``, prompt and response tensors.

    ``model_group``: the worker group of the reward role (None without a reward model)."""

    def __init__(self, tokenizer: Any, reward_fn: Callable[..., float] | None, model_group: Any = None,
                 model_coef: float = 1.0) -> None:
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.model_group = model_group
        self.model_coef = model_coef

    def __call__(self, batch: Batch) -> Scored:
        texts = decode_responses(self.tokenizer, batch)
        parts: dict[str, torch.Tensor] = {}
        if self.reward_fn is not None:
            parts["rule"] = torch.tensor([float(self.reward_fn(batch["prompt"][i], text, **batch["meta"][i]))
                                          for i, text in enumerate(texts)], dtype=torch.float32)
        model_compute_s = None
        if self.model_group is not None:
            keys = (PROMPT_IDS, PROMPT_MASK, RESPONSE_IDS, RESPONSE_MASK)
            result = self.model_group.call("reward", "compute_scores", batch.select(*keys))
            parts["model"] = result.value[SCORES].float()
            model_compute_s = result.compute_s
        total = torch.zeros(len(batch), dtype=torch.float32)
        for name, part in parts.items():
            total = total + (self.model_coef * part if name == "model" else part)
        return Scored(total, texts, parts, model_compute_s)


def build_tiny_reward_model(cfg: Any, out_dir: str | Path) -> Path:
    """A small random ``Qwen2ForSequenceClassification`` (one label) with the tokenizer of ``cfg.tokenizer``
    (the bundled character one by default), built from a ``TinyModelConfig`` and saved as an HF checkpoint;
    reused when built from the same config. Random weights: it tests the plumbing, it does not judge answers."""
    from hybridrl.tasks.tiny_model import _check, tiny_tokenizer

    _check(cfg)
    out = Path(out_dir)
    spec = {"kind": "reward", "config": cfg.model_dump(mode="json")}
    try:
        if json.loads((out / REWARD_MARKER).read_text()) == spec:
            return out
    except (OSError, json.JSONDecodeError):
        if out.exists() and any(out.iterdir()):
            raise FileExistsError(f"'{out}' is not empty and was not built by build_tiny_reward_model") from None
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    tokenizer = tiny_tokenizer(cfg)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                         num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                         num_key_value_heads=cfg.num_kv_heads, max_position_embeddings=cfg.max_position,
                         use_sliding_window=False, num_labels=1, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with replaced_atomically(out) as tmp:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            model = Qwen2ForSequenceClassification(config).to(torch.float32).eval()
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        (tmp / REWARD_MARKER).write_text(json.dumps(spec, indent=2, sort_keys=True) + "\n")
    return out
