"""Mixture-of-experts weights between the trainer's layout and the checkpoint's.

A Hugging Face MoE checkpoint stores one tensor per expert and projection
(``model.layers.3.mlp.experts.5.gate_proj.weight``, ``(I, H)``), and that is what inference engines (vLLM, SGLang)
and the HF rollout are sent. Recent transformers fuse each layer's experts into two parameters in memory:
``experts.gate_up_proj`` ``(E, 2I, H)`` (gate rows first, then up) and ``experts.down_proj`` ``(E, H, I)``, and
convert to and from the per-expert names when loading and saving. A trainer built on transformers exports
through ``to_checkpoint_layout`` (per-expert views of the fused tensors: nothing is copied), and a model holding
fused experts imports through ``expert_views`` (per-expert names mapped to views of its parameters).

Only layouts known here are trained (``KNOWN_MOE_TYPES``); pre-flight refuses another MoE checkpoint
(``moe_layout_problem``) instead of sending its experts under names no engine expects.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

#: ``model_type`` of MoE checkpoints whose expert layout this module converts: routed experts in every layer
#: under ``mlp.experts.<e>.{gate,up,down}_proj.weight``, the router at ``mlp.gate`` (Qwen2-MoE adds an always-on
#: ``mlp.shared_expert``, which is an ordinary MLP).
KNOWN_MOE_TYPES = ("qwen2_moe", "qwen3_moe")
#: config keys that announce routed experts in the model families transformers knows.
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")

_FUSED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


def expert_count(config: Mapping[str, Any]) -> int:
    """Routed experts per layer announced by an HF config dict (0: a dense model)."""
    for key in EXPERT_COUNT_KEYS:
        if config.get(key):
            return int(config[key])
    return 0


def moe_layout_problem(config: Mapping[str, Any]) -> str | None:
    """Why the trainer cannot train this MoE config (None: dense, or a layout it knows); the caller names the
    key the model came from."""
    experts = expert_count(config)
    if not experts:
        return None
    model_type = str(config.get("model_type", "")).lower()
    if model_type not in KNOWN_MOE_TYPES:
        return (f"'{model_type or 'unknown'}' is a mixture-of-experts model ({experts} experts) whose expert "
                f"layout hybridrl does not know (known: {', '.join(KNOWN_MOE_TYPES)})")
    if config.get("mlp_only_layers") or int(config.get("decoder_sparse_step") or 1) != 1:
        return (f"'{model_type}' with dense layers between its expert layers (mlp_only_layers / "
                "decoder_sparse_step) is a layout hybridrl does not know: every layer must hold experts")
    top_k = int(config.get("num_experts_per_tok") or 0)
    if not 0 < top_k <= experts:
        return f"num_experts_per_tok {top_k} must be between 1 and num_experts {experts}"
    return None


def is_fused_expert(name: str, tensor: torch.Tensor) -> bool:
    """Whether ``name`` is a fused experts tensor (``...experts.gate_up_proj`` / ``...experts.down_proj``, 3-D)."""
    return tensor.dim() == 3 and _FUSED.match(name) is not None


def split_fused_expert(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The per-expert checkpoint tensors of one fused experts tensor, as views of it (expert by expert, gate
    before up: the order a checkpoint lists them in does not matter to a loader)."""
    match = _FUSED.match(name)
    assert match is not None and tensor.dim() == 3, name
    prefix, kind = match["prefix"], match["kind"]
    if kind == "down_proj":
        for e in range(tensor.shape[0]):
            yield f"{prefix}.{e}.down_proj.weight", tensor[e]
        return
    width = tensor.shape[1] // 2
    for e in range(tensor.shape[0]):
        yield f"{prefix}.{e}.gate_proj.weight", tensor[e, :width]
        yield f"{prefix}.{e}.up_proj.weight", tensor[e, width:]


def to_checkpoint_layout(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``named`` with every fused experts tensor split into the checkpoint's per-expert tensors (views); other
    tensors pass unchanged, so a dense model's stream is untouched."""
    for name, tensor in named:
        if is_fused_expert(name, tensor):
            yield from split_fused_expert(name, tensor)
        else:
            yield name, tensor


def expert_views(targets: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint names mapped to views of the fused experts tensors among ``targets`` (a model's
    named parameters): copying into a view writes the fused parameter. Empty for a model without them."""
    views: dict[str, torch.Tensor] = {}
    for name, tensor in targets.items():
        if is_fused_expert(name, tensor):
            views.update(split_fused_expert(name, tensor))
    return views


def fuse_experts(weights: Mapping[str, torch.Tensor], fused_names: Iterable[str]) -> dict[str, torch.Tensor]:
    """``weights`` in the checkpoint layout with the per-expert tensors of each name in ``fused_names`` (a
    model's fused experts parameters) stacked into it: the inverse of ``to_checkpoint_layout``. A fused
    parameter whose experts are not all given is left out (the caller's check of missing names reports it)."""
    out = dict(weights)
    for fused in fused_names:
        match = _FUSED.match(fused)
        if match is None:
            continue
        prefix, kind = match["prefix"], match["kind"]
        parts = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
        experts: list[torch.Tensor] = []
        e = 0
        while all(f"{prefix}.{e}.{p}.weight" in weights for p in parts):
            experts.append(torch.cat([out.pop(f"{prefix}.{e}.{p}.weight") for p in parts], dim=0))
            e += 1
        if experts:
            out[fused] = torch.stack(experts)
    return out
