"""The kit's LoRA pieces: the adapters it trains and sends, and the checks of what a LoRA engine exports
(capabilities ``lora`` and ``lora_adapters``; ``hybridrl.lora`` for the names and the merge).

The expected merged weights are computed here from the checkpoint and the adapters (``W0 + alpha/rank * B A``
in fp32), never read back from the engine: an engine that merges wrongly, or whose base drifted, differs."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from hybridrl.lora import LoraSpec, merged_weight, pair_adapters, parse_adapter_name

#: the adapters of the train checks (every linear layer, rank 4, scaling 2).
TRAIN_LORA = LoraSpec(rank=4, alpha=8.0, sync="merged")
#: the adapters the rollout check sends (``sync: adapter``: the rollout serves them on its base).
ROLLOUT_LORA = LoraSpec(rank=4, alpha=8.0, sync="adapter")
#: std of the random adapters the rollout check sends: large enough that the merged model decodes differently
#: from the base (an engine that ignores the adapters fails), not so large that every row is a near-tie.
ADAPTER_STD = 0.2


def linear_modules(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Size]:
    """Module path -> weight shape (out, in) of the decoder layers' projections (what ``all-linear`` adapts)."""
    return {name[:-len(".weight")]: t.shape for name, t in weights.items()
            if name.startswith("model.layers.") and name.endswith("_proj.weight") and t.dim() == 2}


def random_adapters(weights: Mapping[str, torch.Tensor], rank: int, seed: int) -> dict[str, torch.Tensor]:
    """Adapters for every projection of the model, under peft's saved names, drawn from ``seed`` (B is not
    zero, unlike a fresh peft adapter: the merge must show)."""
    from hybridrl.lora import adapter_name

    generator = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for module, (fan_out, fan_in) in linear_modules(weights).items():
        out[adapter_name(module, "A")] = torch.randn(rank, fan_in, generator=generator) * ADAPTER_STD
        out[adapter_name(module, "B")] = torch.randn(fan_out, rank, generator=generator) * ADAPTER_STD
    return out


def merged(weights: Mapping[str, torch.Tensor], adapters: Iterable[tuple[str, torch.Tensor]], scaling: float
           ) -> dict[str, torch.Tensor]:
    """``weights`` with each adapted layer's ``W0 + scaling * B A`` (fp32); KeyError for a layer not there."""
    out = {n: t.float() for n, t in weights.items()}
    for module, (a, b) in pair_adapters(adapters).items():
        out[f"{module}.weight"] = merged_weight(out[f"{module}.weight"], a, b, scaling)
    return out


def adapter_name_problems(names: list[str], tensors: Mapping[str, torch.Tensor], checkpoint: Mapping[str, torch.Tensor],
                          rank: int) -> list[str]:
    """Each name once, peft's format, for a module of the checkpoint, in pairs; A (rank, in), B (out, rank)."""
    problems = [f"'{n}' exported {names.count(n)} times" for n in sorted(set(names)) if names.count(n) > 1]
    if not names:
        return ["export_adapter gave no tensor"]
    for name in sorted(set(names)):
        parsed = parse_adapter_name(name)
        if parsed is None:
            problems.append(f"'{name}' is not a peft adapter name (base_model.model.<module>.lora_A/B.weight)")
            continue
        module, which = parsed
        base = checkpoint.get(f"{module}.weight")
        if base is None:
            problems.append(f"'{name}': the checkpoint has no layer '{module}.weight'")
            continue
        want = (rank, base.shape[1]) if which == "A" else (base.shape[0], rank)
        if tuple(tensors[name].shape) != want:
            problems.append(f"'{name}' has shape {tuple(tensors[name].shape)}, expected {want} (rank {rank}, "
                            f"the layer is {tuple(base.shape)})")
    if not problems:
        try:
            pair_adapters(tensors.items())
        except ValueError as exc:
            problems.append(str(exc))
    return problems
