"""The kit's reference for MoE routing replay (train capability ``routing_replay``): a transformers forward whose
routers take given experts, with their weights from the model's own router logits (the softmax probabilities of
the given experts, renormalised over them where the router renormalises its top-k), one row at a time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hybridrl.config import TinyModelConfig
from hybridrl.rollout.routing import router_modules, top_k_indices

#: the kit's MoE model: a tiny Qwen3-MoE (8 experts, top-2) with peaked routers; head size 64 (hidden / heads), as
#: the kit's dense models, suits every engine's attention kernels on a GPU.
KIT_MOE = TinyModelConfig(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64,
                          num_experts=8, experts_per_token=2, init_std=0.2)


def random_routing(response_mask: torch.Tensor, layers: int, experts: int, top_k: int, seed: int) -> torch.Tensor:
    """``(B, R, layers, top_k)`` distinct random experts at every response token (-1 at padding)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (*response_mask.shape, layers)
    picks = torch.rand((*shape, experts), generator=gen).argsort(dim=-1)[..., :top_k]
    return torch.where(response_mask.bool()[..., None, None], picks, -1)


class ForcedRouting:
    """A transformers MoE model whose routers, inside ``logits``, route the tokens given experts (``-1``: its own)."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        self.routers = router_modules(self.model)
        self._given: torch.Tensor | None = None
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(layer))

    def _hook(self, layer: int):
        def route(module: Any, args: Any, output: Any) -> Any:
            if self._given is None:
                return None
            own = top_k_indices(output)
            given = self._given[:, layer]
            chosen = torch.where(given >= 0, given, own)
            weights = torch.softmax(output[0].float(), dim=-1).gather(-1, chosen)
            if getattr(module, "norm_topk_prob", False):
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return (output[0], weights.to(output[1].dtype), chosen, *output[3:])
        return route

    @torch.no_grad()
    def log_probs(self, prompt: list[int], response: list[int], given: torch.Tensor) -> torch.Tensor:
        """Log-probs of ``response`` after ``prompt`` with the response tokens routed by ``given``
        ``(len(response), layers, top_k)``."""
        ids = torch.tensor([prompt + response])
        prefix = torch.full((len(prompt), *given.shape[1:]), -1, dtype=torch.long)
        self._given = torch.cat([prefix, given.long()])
        try:
            logits = self.model(input_ids=ids).logits[0].float()
        finally:
            self._given = None
        steps = torch.log_softmax(logits[len(prompt) - 1: len(prompt) + len(response) - 1], dim=-1)
        return steps.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
