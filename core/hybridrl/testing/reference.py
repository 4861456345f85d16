"""The independent computation every engine is compared with: a plain transformers forward pass.

One unpadded, uncached forward over ``prompt + response`` gives the logits that predicted each response
token (teacher forcing on the engine's own tokens), so a check needs one forward per row however the
engine decoded. The sampling distribution is rebuilt here from the ``SamplingParams`` as the
``RolloutEngine.generate`` contract states it (EOS forbidden before ``min_new_tokens``, then logits /
temperature, then top-k and top-p, renormalised; greedy: the log-softmax of the EOS-masked logits).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path

import torch

from hybridrl.engines import SamplingParams


class ReferenceModel:
    """A transformers causal LM in fp32 on CPU, loaded from a folder, optionally with other weights."""

    def __init__(self, path: str | Path, weights: Iterable[tuple[str, torch.Tensor]] | None = None) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        if weights is not None:
            self.load(weights)

    @torch.no_grad()
    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in (a tied ``lm_head.weight`` and ``model.embed_tokens.weight`` are one)."""
        targets = dict(self.model.named_parameters(remove_duplicate=False))
        for name, buf in self.model.named_buffers(remove_duplicate=False):
            targets.setdefault(name, buf)
        for name, tensor in weights:
            targets[name].copy_(tensor.detach().to("cpu", torch.float32))

    def named_weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    @torch.no_grad()
    def step_logits(self, prompt: Sequence[int], response: Sequence[int]) -> torch.Tensor:
        """``(len(response), V)`` fp32 logits: row ``t`` predicted ``response[t]`` from everything before it."""
        ids = torch.tensor([list(prompt) + list(response)], dtype=torch.long)
        logits = self.model(input_ids=ids).logits[0].float()
        start = len(prompt) - 1
        return logits[start:start + len(response)]

    @torch.no_grad()
    def greedy(self, prompt: Sequence[int], steps: int, eos_ids: Sequence[int] = ()) -> list[int]:
        """Step-by-step argmax (stops after an EOS)."""
        out: list[int] = []
        for _ in range(steps):
            token = int(self.model(input_ids=torch.tensor([list(prompt) + out])).logits[0, -1].argmax())
            out.append(token)
            if token in eos_ids:
                break
        return out


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``-inf`` outside the ``top_k`` largest logits and outside the smallest most-likely set whose probability
    reaches ``top_p`` (the top token always stays). ``logits``: (n, V), already divided by the temperature."""
    out = logits.clone()
    if 0 < top_k < out.shape[-1]:
        kth = out.topk(top_k, dim=-1).values[:, -1:]
        out[out < kth] = float("-inf")
    if top_p < 1.0:
        probs = out.softmax(-1)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # probability of the more likely tokens
        drop_sorted = mass_before >= top_p
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out[drop] = float("-inf")
    return out


def sampling_log_probs(logits: torch.Tensor, params: SamplingParams, eos_ids: Sequence[int],
                       first_step: int = 0) -> torch.Tensor:
    """Log-probs ``(n, V)`` of the distribution each token was drawn from; row ``t`` is decoding step
    ``first_step + t``."""
    logits = logits.float().clone()
    steps = torch.arange(logits.shape[0]) + first_step
    early = steps < params.min_new_tokens
    if early.any() and eos_ids:
        logits[early.nonzero().squeeze(1)[:, None], torch.tensor(list(eos_ids))[None, :]] = float("-inf")
    if params.greedy:
        return torch.log_softmax(logits, dim=-1)
    scaled = filter_top_k_top_p(logits / params.temperature, params.top_k, params.top_p)
    return torch.log_softmax(scaled, dim=-1)


def near_support_edge(logits: torch.Tensor, token: int, params: SamplingParams, eos_ids: Sequence[int], step: int,
                      tolerance: float) -> bool:
    """Whether ``token``, outside the top-k/top-p support that ``logits`` (one decoding step, unscaled) give, is
    the support's next token in order of probability and within ``tolerance`` (in logits) of getting in: an
    engine whose logits differ by that much may keep it. For top-k its log-prob is then no further below the
    k-th largest; for top-p the probability before it falls short of ``top_p`` once scaled down by that much.
    Only the first token past the edge: an engine that ignores the truncation draws further out too. An EOS
    banned by ``min_new_tokens`` and greedy rows never are (exact rules)."""
    if params.greedy or (step < params.min_new_tokens and token in eos_ids):
        return False
    scaled_tolerance = tolerance / params.temperature
    # the step's distribution before truncation (EOS banned as at this step, temperature applied)
    logp = sampling_log_probs(logits[None], replace(params, top_k=0, top_p=1.0), eos_ids, first_step=step)[0]
    support = torch.isfinite(filter_top_k_top_p(logp[None], int(params.top_k or 0), params.top_p)[0])
    outside = logp.masked_fill(support, float("-inf"))
    if int(outside.argmax()) != token or bool(support[token]):
        return False  # not the most likely token outside the support
    k = int(params.top_k) if params.top_k else 0
    if 0 < k < logp.shape[-1]:
        kth = logp.topk(k).values[-1]
        if logp[token] < kth - scaled_tolerance:
            return False
        # top-p then applies within the top-k, this token counted among them
        logp = logp.masked_fill(logp < torch.minimum(kth, logp[token]), float("-inf"))
    if params.top_p < 1.0:
        probs = torch.softmax(logp, dim=-1)
        before = float(probs[probs > probs[token]].sum())
        if before * math.exp(-scaled_tolerance) >= params.top_p:
            return False
    return True


def entropy(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)
