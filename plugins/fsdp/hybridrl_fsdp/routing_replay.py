"""MoE routing replay: the response tokens routed to the experts the rollout routed them to (``routed_experts``).

The trainer's top-k can differ from the engine's that sampled the tokens (other kernels and batch shapes, near
ties, weights a step behind), and then its log-probs are those of another computation: the importance ratios
drift. With ``batch.info["routing_replay"]`` each router's output is replaced by forward hooks: the given experts
(``(tokens, top_k)`` ids) with their weights recomputed from the trainer's own router logits (the softmax
probabilities of the given experts, renormalised over them where the router renormalises its top-k), so the
gradient still reaches the router. The prompt tokens take the experts of the rollout's prefill where the batch
carries them (``prompt_routed_experts``); tokens without given experts (padding, a row's last token, never fed
back) keep the trainer's own routing.

Either way the share of response tokens whose own top-k (in any layer) differs from the rollout's is measured:
``moe/routing_mismatch``. The routing is laid out as the forward sees its tokens (padded rows, packed rows,
shared prompts): ``token_routing`` builds that layout from the micro-batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hybridrl.engines.batch import (
    PROMPT_IDS,
    PROMPT_MASK,
    PROMPT_ROUTED_EXPERTS,
    RESPONSE_MASK,
    ROUTED_EXPERTS,
    Batch,
    distinct_prompts,
    response_attention_mask,
)
from hybridrl.rollout.routing import router_modules, top_k_indices
from hybridrl_fsdp.packing import PackedRows

#: the update's metric: share of the response tokens whose own routing differs from the rollout's.
ROUTING_MISMATCH_METRIC = "moe/routing_mismatch"


@dataclass
class TokenRouting:
    """The given experts of one forward's tokens, in the order the routers see them, and the way back to rows."""

    experts: torch.Tensor  # (T, layers, top_k) long, -1 where the trainer keeps its own routing
    rows: Any  # (T,) per-token values -> (b, R) response values
    response: torch.Tensor  # (T,) bool: the response tokens (what the mismatch counts)

    def to_rows(self, values: torch.Tensor) -> torch.Tensor:
        return self.rows(values)


def token_routing(batch: Batch, packed: PackedRows | None) -> TokenRouting:
    """``batch[ROUTED_EXPERTS]`` laid out as the forward of ``batch`` (``packed``: its packed rows) routes its
    tokens: prompt tokens and untrained response positions get -1."""
    prompt_mask = batch[PROMPT_MASK].bool()
    attended = response_attention_mask(batch).bool()
    trained = batch[RESPONSE_MASK].bool()
    width = trained.shape[1]
    given = batch[ROUTED_EXPERTS][:, :width].long()  # a trimmed micro-batch has fewer response columns
    given = torch.where(trained[:, :, None, None], given, -1)
    b, p = prompt_mask.shape
    if PROMPT_ROUTED_EXPERTS in batch:  # left-padded: a trimmed micro-batch keeps the last p columns
        prompt_part = torch.where(prompt_mask[:, :, None, None], batch[PROMPT_ROUTED_EXPERTS][:, -p:].long(), -1)
    else:
        prompt_part = given.new_full((b, p, *given.shape[2:]), -1)
    is_response = torch.cat([torch.zeros_like(prompt_mask), torch.ones_like(attended)], dim=1)
    if packed is not None and packed.shared is not None:
        tokens = packed.shared.prompt_tokens
        groups, first = distinct_prompts(batch[PROMPT_IDS], batch[PROMPT_MASK])
        experts = torch.cat([prompt_part[first][prompt_mask[first]], given[attended]])
        response = torch.cat([is_response.new_zeros(tokens), is_response.new_ones(int(attended.sum()))])

        def rows(values: torch.Tensor) -> torch.Tensor:
            return values.new_zeros(attended.shape).masked_scatter(attended, values[tokens:])
    elif packed is not None:
        mask = torch.cat([prompt_mask, attended], dim=1)
        experts, response = torch.cat([prompt_part, given], dim=1)[mask], is_response[mask]

        def rows(values: torch.Tensor) -> torch.Tensor:
            return values.new_zeros(mask.shape).masked_scatter(mask, values)[:, p:]
    else:
        experts = torch.cat([prompt_part, given], dim=1).reshape(b * (p + width), *given.shape[2:])
        response = is_response.reshape(-1)

        def rows(values: torch.Tensor) -> torch.Tensor:
            return values.view(b, p + width)[:, p:]
    return TokenRouting(experts, rows, response)


class RoutingReplay:
    """Hooks on every router of an MoE model; active inside ``routing(...)`` only."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = router_modules(model)
        if not self.routers:
            raise TypeError(f"{type(model).__name__} has no MoE router: routing replay needs an MoE model")
        self._given: torch.Tensor | None = None
        self._replay = False
        self.mismatch: torch.Tensor | None = None  # (T,) bool after a forward inside routing()
        self.valid: torch.Tensor | None = None  # (T,) bool: the tokens the mismatch counts
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    def _hook(self, layer: int):
        def route(module: nn.Module, args: Any, output: Any) -> Any:
            if self._given is None:
                return None
            own = top_k_indices(output)
            given = self._given[:, layer].to(own.device)
            if given.shape != own.shape:
                raise RuntimeError(f"routing replay: layer {layer} routes {tuple(own.shape)} (tokens, top_k), the "
                                   f"given experts are {tuple(given.shape)}")
            valid = given[:, 0] >= 0
            compared = valid if self.valid is None else self.valid
            differs = (own.sort(dim=-1).values != given.sort(dim=-1).values).any(dim=-1) & compared
            self.mismatch = differs if self.mismatch is None else self.mismatch | differs
            if not self._replay:
                return None
            logits, scores = output[0], output[1]
            chosen = torch.where(valid[:, None], given, own.long())
            weights = torch.softmax(logits.float(), dim=-1).gather(-1, chosen)
            if getattr(module, "norm_topk_prob", False):
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return (logits, weights.to(scores.dtype), chosen.to(own.dtype), *output[3:])
        return route

    @contextmanager
    def routing(self, given: torch.Tensor, replay: bool, compared: torch.Tensor | None = None) -> Iterator[None]:
        """Inside: the routers compare with (and with ``replay`` route by) ``given`` ``(T, layers, top_k)``;
        ``compared`` (T,) bool: the tokens the mismatch counts (default: every given one). Keep it open over the
        backward too: gradient checkpointing runs the forward again there."""
        self._given, self._replay = given, replay
        valid = given[:, 0, 0] >= 0
        self.mismatch, self.valid = None, valid if compared is None else valid & compared.to(valid.device).bool()
        try:
            yield
        finally:
            self._given, self._replay = None, False

    def counts(self) -> torch.Tensor:
        """``(mismatched, compared)`` response tokens of the forward just run, as a float tensor (no host sync)."""
        if self.mismatch is None or self.valid is None:
            raise RuntimeError("no router ran inside routing()")
        valid = self.valid.to(self.mismatch.device)
        return torch.stack([(self.mismatch & valid).sum(), valid.sum()]).float()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
