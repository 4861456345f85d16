"""The router's load-balancing loss of a mixture-of-experts model on Megatron: Megatron adds it to the gradients
itself (``moe_router_load_balancing_type: aux_loss``, weighted by ``moe_aux_loss_coeff``); this module reads what
its routers recorded during an update into the ``moe/aux_loss`` metric.

Megatron's per-layer loss is ``E / k * sum_e f_e P_e`` (1 when balanced); the metric multiplies it by ``k`` and
averages over the layers, so that it reads like the FSDP backend's (transformers' definition over all layers
together, ``k`` when balanced). The two agree when the routing is balanced and are close otherwise; Megatron
weights the loss of every layer by the coefficient, transformers the loss over all layers once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridrl_megatron.convert import ModelSpec
from hybridrl_megatron.parallel import Layout

AUX_LOSS = "moe/aux_loss"
_TRACKED = "load_balancing_loss"


def clear_router_losses() -> None:
    """Forget what the routers recorded so far (before an update's micro-batches run)."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    clear_aux_losses_tracker()


def router_loss_metrics(spec: ModelSpec, layout: Layout, n_micro: int, device: torch.device) -> dict[str, float]:
    """``moe/aux_loss`` of the update just run: the mean over micro-batches, layers and data-parallel ranks
    (collective over every rank; nothing for a dense model or without the loss)."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    if not spec.is_moe:
        return {}
    tracked = get_moe_layer_wise_logging_tracker().get(_TRACKED)
    values = (tracked["values"].detach().to(device, torch.float64) if tracked is not None
              else torch.zeros(spec.num_layers, dtype=torch.float64, device=device))
    total = values.sum()
    if dist.get_world_size() > 1:  # each layer's value lives on the tp x dp ranks of its stage
        dist.all_reduce(total)
    if tracked is None:
        return {}
    mean = float(total) / (layout.tp * layout.dp * spec.num_layers * max(1, n_micro))
    return {AUX_LOSS: mean * spec.experts_per_token}
