"""``ExampleRollout``: token-in/token-out sampling on a plain transformers causal LM.

Deliberately simple rather than fast: every step re-runs the model over the whole (left-padded) sequence,
with no KV cache, so the sampling logic reads top to bottom. Fine for short responses on small models; a
real backend would wrap an inference engine (vLLM, SGLang ...) behind the same five methods.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from hybridrl.engines import EngineContext, NamedTensor, RolloutEngine, SamplingParams, WeightBucket
from hybridrl.engines.batch import PROMPT_IDS, PROMPT_MASK, RESPONSE_IDS, RESPONSE_MASK, ROLLOUT_LOG_PROBS, Batch


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def restrict(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Keep the ``top_k`` most likely tokens and the smallest most-likely set holding ``top_p`` of the
    probability (the best token always stays); the rest get ``-inf``. ``logits``: (B, V)."""
    if 0 < top_k < logits.shape[-1]:
        threshold = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    if top_p < 1.0:
        probs, order = torch.sort(logits.softmax(dim=-1), dim=-1, descending=True)
        outside = (probs.cumsum(dim=-1) - probs) >= top_p  # mass of the better tokens already reaches top_p
        outside[:, 0] = False
        logits = logits.masked_fill(torch.zeros_like(outside).scatter(-1, order, outside), float("-inf"))
    return logits


class ExampleRollout(RolloutEngine):
    """The rollout contract of ``hybridrl.engines.RolloutEngine`` on one transformers model per rank."""

    def __init__(self, ctx: EngineContext) -> None:
        super().__init__(ctx)
        from transformers import AutoModelForCausalLM

        self.device = torch.device("cuda", torch.cuda.current_device()) if ctx.device == "cuda" else torch.device("cpu")
        self.model = AutoModelForCausalLM.from_pretrained(ctx.model_path, dtype=ctx.torch_dtype)
        self.model.to(self.device).eval().requires_grad_(False)
        config, gen = self.model.config, self.model.generation_config
        self.eos_ids = _ids(getattr(gen, "eos_token_id", None)) or _ids(config.eos_token_id)
        if not self.eos_ids:
            raise ValueError(f"{ctx.model_path}: the model names no eos_token_id")
        self.pad_id = (_ids(getattr(gen, "pad_token_id", None)) or _ids(config.pad_token_id) or self.eos_ids)[0]
        self.context_length = getattr(config, "max_position_embeddings", None)
        self.asleep = False

    # --- generation ---------------------------------------------------------------------------------------
    def _check(self, mask: torch.Tensor, max_new_tokens: int) -> None:
        """The documented input errors: ``ValueError`` naming the row."""
        for row, n in enumerate(mask.sum(dim=1).tolist()):
            if n == 0:
                raise ValueError(f"row {row}: empty prompt")
            if self.context_length is not None and n + max_new_tokens > self.context_length:
                raise ValueError(f"row {row}: {n} prompt tokens + {max_new_tokens} new tokens exceed the context "
                                 f"length {self.context_length}")

    @torch.no_grad()
    def _next_logits(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)  # left padding: count real tokens only
        return self.model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1].float()

    def generate(self, batch: Batch, params: SamplingParams) -> Batch:
        if self.asleep:
            raise RuntimeError("ExampleRollout.generate called while asleep")
        mask = batch[PROMPT_MASK].long()
        self._check(mask, params.max_new_tokens)
        ids, mask = batch[PROMPT_IDS].long().to(self.device), mask.to(self.device)
        rows, width = ids.shape[0], params.max_new_tokens
        out_ids = torch.full((rows, width), self.pad_id, dtype=torch.long)
        out_mask = torch.zeros((rows, width), dtype=torch.long)
        out_logp = torch.zeros((rows, width), dtype=torch.float32)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed * 7919 + self.ctx.rank)
        eos = torch.tensor(self.eos_ids, device=self.device)
        running = torch.ones(rows, dtype=torch.bool, device=self.device)
        for step in range(width):
            if rows == 0:
                break
            logits = self._next_logits(ids, mask)
            if step < params.min_new_tokens:
                logits[:, eos] = float("-inf")
            if params.greedy:
                logp = logits.log_softmax(dim=-1)
                token = logits.argmax(dim=-1)
            else:
                logp = restrict(logits / params.temperature, params.top_k, params.top_p).log_softmax(dim=-1)
                token = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)
            out_ids[:, step] = torch.where(running, token, self.pad_id).cpu()
            out_mask[:, step] = running.long().cpu()
            out_logp[:, step] = torch.where(running, logp.gather(1, token[:, None]).squeeze(1), 0.0).cpu()
            if not params.ignore_eos:
                running &= ~torch.isin(token, eos)
            if not running.any():
                break
            ids = torch.cat([ids, token[:, None]], dim=1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        return Batch.from_tensors({RESPONSE_IDS: out_ids, RESPONSE_MASK: out_mask, ROLLOUT_LOG_PROBS: out_logp})

    # --- weights and memory -------------------------------------------------------------------------------
    def import_weights(self, bucket: WeightBucket) -> None:
        """Copy each tensor into the parameter of that HF name (tied names share one tensor)."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            for name, tensor in bucket:
                if name not in params:
                    raise KeyError(f"ExampleRollout: no weight named '{name}'")
                params[name].copy_(tensor)

    def sleep(self) -> None:
        """Hand the GPU to the trainer: weights to host memory (nothing to release on CPU)."""
        if self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()
        self.asleep = True

    def wake(self) -> None:
        if self.device.type == "cuda":
            self.model.to(self.device)
        self.asleep = False

    def named_weights(self) -> Iterator[NamedTensor]:
        yield from self.model.named_parameters()
