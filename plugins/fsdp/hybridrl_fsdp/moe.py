"""The router losses of a mixture-of-experts model: load balancing (and router z-loss), added to the update.

A policy-gradient loss alone lets the routers collapse onto a few experts; MoE models are trained with the
Switch Transformer load-balancing loss, ``E * sum_e f_e * P_e`` (``f_e``: the share of the top-k assignments that
go to expert ``e``, ``P_e``: its mean router probability, both over the real tokens of every MoE layer, as
transformers' ``load_balancing_loss_func`` computes it), weighted by ``options.moe_aux_loss_coef`` (default: the
model config's ``router_aux_loss_coef``). A model whose config sets ``router_z_loss_coef`` also gets the router
z-loss, the mean squared log-sum-exp of the router logits (``options.moe_z_loss_coef``).

The router logits are read by forward hooks on the model's router modules (the class transformers records as
``router_logits``), so every forward path of the engine (padded or packed rows, the fused head, shared prompts)
feeds them unchanged; the hooks record only inside ``recording()`` (not in the recomputed forward of gradient
checkpointing, nor in forward-only passes).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

#: the metric keys of the update.
AUX_LOSS = "moe/aux_loss"
Z_LOSS = "moe/z_loss"


def hf_config(model: nn.Module) -> Any:
    """The transformers config of ``model`` (or of the causal LM inside a wrapper), None if there is none."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "to_dict"):
            return config
    return None


def router_recorder(model: nn.Module) -> Any:
    """transformers' ``OutputRecorder`` of the model's ``router_logits`` (None: not an MoE model)."""
    for module in model.modules():
        recorder = (getattr(type(module), "_can_record_outputs", None) or {}).get("router_logits")
        if recorder is not None:
            return recorder
    return None


def router_class(model: nn.Module) -> type[nn.Module] | None:
    """The module class whose output transformers records as ``router_logits`` (None: not an MoE model)."""
    return getattr(router_recorder(model), "target_class", None)


@dataclass
class RouterLosses:
    """The router losses of one forward (each a scalar tensor with its graph) and the tokens they cover."""

    aux: torch.Tensor
    z: torch.Tensor | None
    tokens: int


class RouterLoss:
    """Hooks on the routers of an MoE model; ``losses(mask)`` after a forward inside ``recording()``."""

    def __init__(self, model: nn.Module, aux_coef: float, z_coef: float) -> None:
        config = hf_config(model)
        target = router_class(model)
        if config is None or target is None:
            raise TypeError(f"{type(model).__name__} has no router module transformers records as router_logits")
        self.num_experts = int(config.num_experts)
        self.top_k = int(config.num_experts_per_tok)
        self.aux_coef = aux_coef
        self.z_coef = z_coef
        self._logits: list[torch.Tensor] = []
        self._recording = False
        index = getattr(router_recorder(model), "index", 0)
        self._handles = [m.register_forward_hook(self._hook(index)) for m in model.modules() if isinstance(m, target)]

    def _hook(self, index: int):
        def record(module: nn.Module, args: Any, output: Any) -> None:
            if self._recording:
                self._logits.append(output[index] if isinstance(output, (tuple, list)) else output)
        return record

    @contextmanager
    def recording(self) -> Iterator[None]:
        self._logits.clear()
        self._recording = True
        try:
            yield
        finally:
            self._recording = False

    def losses(self, token_mask: torch.Tensor | None) -> RouterLosses:
        """The router losses of the forward just recorded; ``token_mask``: which of the routed rows are real
        tokens (the flattened attention mask of padded rows; None: every row)."""
        if not self._logits:
            raise RuntimeError("no router logits were recorded (was the forward run inside recording()?)")
        logits = [t.reshape(-1, self.num_experts).float() for t in self._logits]
        self._logits.clear()
        mask = None if token_mask is None else token_mask.reshape(-1).to(logits[0].device, torch.float32)
        aux = load_balancing_loss(logits, self.num_experts, self.top_k, mask)
        z = router_z_loss(logits, mask) if self.z_coef else None
        tokens = int(mask.sum()) if mask is not None else logits[0].shape[0]
        return RouterLosses(aux, z, tokens)

    def weighted(self, losses: RouterLosses) -> torch.Tensor:
        """What the losses add to the objective (before the micro-batch's share is applied)."""
        total = self.aux_coef * losses.aux
        if losses.z is not None:
            total = total + self.z_coef * losses.z
        return total


def load_balancing_loss(logits: list[torch.Tensor], num_experts: int, top_k: int,
                        mask: torch.Tensor | None) -> torch.Tensor:
    """Switch Transformer's load-balancing loss over the layers' router logits (each ``(tokens, E)``), the real
    tokens only: transformers' ``load_balancing_loss_func``, so a value compares with the model's own
    ``aux_loss``. 1 when the routing is uniform, up to ``E / top_k`` when it is collapsed."""
    device = logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    for layer in logits:
        p = torch.softmax(layer, dim=-1)
        chosen = torch.topk(p, top_k, dim=-1).indices.reshape(-1)
        weight = torch.ones(layer.shape[0], device=device) if mask is None else mask
        counts = counts.scatter_add(0, chosen, weight.repeat_interleave(top_k))
        probs = probs + (p * weight.unsqueeze(-1)).sum(dim=0)
        rows = rows + weight.sum()
    rows = rows.clamp(min=1.0)
    return num_experts * torch.sum((counts / rows) * (probs / rows))


def router_z_loss(logits: list[torch.Tensor], mask: torch.Tensor | None) -> torch.Tensor:
    """ST-MoE's router z-loss: the mean over real tokens and layers of ``logsumexp(router logits) ** 2``."""
    total = torch.zeros((), dtype=torch.float32, device=logits[0].device)
    for layer in logits:
        z = torch.logsumexp(layer, dim=-1) ** 2
        total = total + (z.mean() if mask is None else (z * mask).sum() / mask.sum().clamp(min=1.0))
    return total / len(logits)
