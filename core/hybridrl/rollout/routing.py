"""The experts a mixture-of-experts model routes each token to, read from its routers (``return_routing``).

transformers' MoE blocks (Qwen3-MoE, Qwen2-MoE) call a router module, the class the model records as
``router_logits``, that returns ``(router_logits, router_scores, router_indices)``: the top-k expert ids of every
token it routes are its last output. Forward hooks on those modules read them, so the model's own forward (and
its fused experts kernels, which take the ids as input) is unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


def router_class(model: nn.Module) -> type[nn.Module] | None:
    """The module class transformers records as the model's ``router_logits`` (None: not an MoE model)."""
    for module in model.modules():
        recorder = (getattr(type(module), "_can_record_outputs", None) or {}).get("router_logits")
        if recorder is not None:
            return getattr(recorder, "target_class", None)
    return None


def router_modules(model: nn.Module) -> list[nn.Module]:
    """The model's routers in layer order (empty for a dense model)."""
    target = router_class(model)
    return [] if target is None else [m for m in model.modules() if isinstance(m, target)]


def top_k_indices(output: Any) -> torch.Tensor:
    """The ``(tokens, top_k)`` expert ids in a router's output (its last element)."""
    if not isinstance(output, (tuple, list)) or len(output) < 2:
        raise TypeError("an MoE router returns (router_logits, ..., router_indices); got "
                        f"{type(output).__name__}")
    return output[-1]


class RoutingCapture:
    """Hooks on every router of ``model``; inside ``capturing()`` each forward's ``(tokens, layers, top_k)``
    expert ids are kept for ``take()``."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = router_modules(model)
        if not self.routers:
            raise TypeError(f"{type(model).__name__} has no MoE router (the class it records as router_logits)")
        self._ids: list[torch.Tensor | None] = [None] * len(self.routers)
        self._on = False
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    @property
    def layers(self) -> int:
        return len(self.routers)

    def _hook(self, layer: int):
        def record(module: nn.Module, args: Any, output: Any) -> None:
            if self._on:
                self._ids[layer] = top_k_indices(output)
        return record

    @contextmanager
    def capturing(self) -> Iterator[None]:
        self._ids = [None] * len(self.routers)
        self._on = True
        try:
            yield
        finally:
            self._on = False

    def take(self) -> torch.Tensor:
        """The last captured forward's ``(tokens, layers, top_k)`` expert ids (int64)."""
        if any(ids is None for ids in self._ids):
            raise RuntimeError("a router was not called inside capturing()")
        ids = torch.stack([t.reshape(t.shape[0], -1) for t in self._ids if t is not None], dim=1)
        self._ids = [None] * len(self.routers)
        return ids.long()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
