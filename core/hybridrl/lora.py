"""LoRA adapters, engine-free: the spec a run trains, the names adapters travel under, and merging them.

A LoRA actor (``roles.actor.lora``) trains low-rank adapters ``A`` (rank x in) and ``B`` (out x rank) on some of
its linear layers while the base weights stay frozen; a layer computes ``W x + scaling * B (A x)`` with
``scaling = alpha / rank``. Adapters cross the reshard bridge, and are written by ``hybridrl export --adapter``,
under peft's saved names (``base_model.model.<module>.lora_A.weight``): the format ``peft.PeftModel``, vLLM's
``LoRARequest`` and SGLang's adapter loaders read.

How the rollout gets the actor's policy after an update (``LoraSpec.sync``):

* ``adapter``: only the adapters cross the bridge (megabytes); the rollout engine serves them on its own base
  weights (vLLM and SGLang through their LoRA support, the transformers rollout by merging them into a copy of
  its base). Its base weights are never sent again, so they must stay valid while it sleeps.
* ``merged``: the trainer merges the adapters into its base on its device and sends full weights, as without
  LoRA; the engine generates at the base model's speed, with no LoRA kernels.

``auto`` (resolved before any process starts, ``resolve_sync``) takes ``merged`` when the actor and the rollout
share a process (the merged weights are a copy on the device they already live on) and ``adapter`` when the
weights would cross a link to another process (megabytes instead of the whole model).

This module imports torch only; peft lives in the train backends (``hybridrl_fsdp.lora``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

#: peft's shorthand for every linear layer of the decoder (the output head excluded).
ALL_LINEAR = "all-linear"
#: what a weight sync moves for a LoRA actor (see the module docstring); ``auto`` is resolved in pre-flight.
SYNC_MODES = ("adapter", "merged")
#: the prefix peft puts before the base model's module names in a saved adapter.
PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
#: capability names (``hybridrl.engines.capabilities``): a train engine that trains adapters, a rollout that
#: serves adapters it is sent.
TRAIN_CAPABILITY = "lora"
ROLLOUT_CAPABILITY = "lora_adapters"


@dataclass(frozen=True)
class LoraSpec:
    """The adapters of a LoRA run, as the engines receive them (``EngineContext.lora``)."""

    rank: int
    alpha: float
    dropout: float = 0.0
    target_modules: tuple[str, ...] | str = ALL_LINEAR
    sync: str = "merged"

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @property
    def sends_adapters(self) -> bool:
        """Whether a weight sync sends the adapters alone (else the merged weights)."""
        return self.sync == "adapter"

    @classmethod
    def from_config(cls, cfg: Any) -> LoraSpec | None:
        """From ``roles.actor.lora`` (the pydantic model or its dict); None without one. ``alpha`` unset is
        twice the rank (scaling 2); ``sync`` must be resolved already (``resolve_sync``)."""
        if cfg is None:
            return None
        data = cfg if isinstance(cfg, Mapping) else cfg.model_dump()
        rank = int(data.get("rank", 16))
        alpha = data.get("alpha")
        targets = data.get("target_modules", ALL_LINEAR)
        sync = data.get("sync", "merged")
        return cls(rank=rank, alpha=float(alpha) if alpha is not None else 2.0 * rank,
                   dropout=float(data.get("dropout", 0.0) or 0.0),
                   target_modules=targets if isinstance(targets, str) else tuple(targets),
                   sync="merged" if sync == "auto" else str(sync))

    def peft_config(self, base_model: str, target_modules: Iterable[str] | None = None) -> dict[str, Any]:
        """``adapter_config.json`` of these adapters in peft's format. ``target_modules``: the module names the
        adapters were actually put on (what ``all-linear`` resolved to), when known."""
        targets = sorted(target_modules) if target_modules is not None else (
            self.target_modules if isinstance(self.target_modules, str) else sorted(self.target_modules))
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
                "r": self.rank, "lora_alpha": self.alpha, "lora_dropout": self.dropout, "target_modules": targets,
                "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
                "modules_to_save": None, "inference_mode": True}


# --- names --------------------------------------------------------------------------------------------------

def adapter_name(module: str, which: str) -> str:
    """The saved name of ``module``'s adapter matrix ``which`` ("A" or "B"), ``module`` a Hugging Face module
    path such as ``model.layers.0.self_attn.q_proj``."""
    return f"{PEFT_PREFIX}{module}.lora_{which}.weight"


def parse_adapter_name(name: str) -> tuple[str, str] | None:
    """``(module, "A" | "B")`` of a saved adapter name; None for any other tensor name."""
    for which in ("A", "B"):
        suffix = f".lora_{which}.weight"
        if name.startswith(PEFT_PREFIX) and name.endswith(suffix):
            return name[len(PEFT_PREFIX):-len(suffix)], which
    return None


def is_adapter_name(name: str) -> bool:
    return parse_adapter_name(name) is not None


def pair_adapters(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``module -> (A, B)`` of a set of saved adapter tensors; ``ValueError`` names a matrix missing its pair or
    a name that is not an adapter's."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        parsed = parse_adapter_name(name)
        if parsed is None:
            raise ValueError(f"'{name}' is not a LoRA adapter tensor (expected {PEFT_PREFIX}<module>.lora_A/B.weight)")
        halves.setdefault(parsed[0], {})[parsed[1]] = tensor
    missing = sorted(f"{module}.lora_{'B' if 'A' in h else 'A'}" for module, h in halves.items() if len(h) != 2)
    if missing:
        raise ValueError(f"LoRA adapters without their other matrix: {', '.join(missing[:4])}")
    return {module: (h["A"], h["B"]) for module, h in halves.items()}


def target_names(modules: Iterable[str]) -> list[str]:
    """The module names (last path component) a set of adapted modules covers: peft's ``target_modules``."""
    return sorted({module.rsplit(".", 1)[-1] for module in modules})


# --- merging ------------------------------------------------------------------------------------------------

def merged_weight(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """``base + scaling * B @ A`` computed in fp32 (a new tensor), in ``dtype`` (default: fp32)."""
    delta = torch.matmul(b.to(torch.float32), a.to(torch.float32))
    out = torch.add(base.to(torch.float32), delta, alpha=scaling)
    return out if dtype is None or dtype == torch.float32 else out.to(dtype)


def adapter_parameter_count(modules: Mapping[str, tuple[int, int]], rank: int) -> int:
    """Parameters of the adapters of ``modules`` (``name -> (in_features, out_features)``) at ``rank``."""
    return sum(rank * (fan_in + fan_out) for fan_in, fan_out in modules.values())


# --- files --------------------------------------------------------------------------------------------------

def write_adapter(folder: str | Path, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> Path:
    """A peft adapter folder: ``adapter_model.safetensors`` (the tensors as given, contiguous on CPU) and
    ``adapter_config.json``. Overwrites what is there (a rollout rewrites its folder at every sync)."""
    from safetensors.torch import save_file

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    save_file({n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}, str(out / ADAPTER_WEIGHTS_FILE))
    (out / ADAPTER_CONFIG_FILE).write_text(json.dumps(dict(config), indent=2) + "\n")
    return out


# --- the run's choices --------------------------------------------------------------------------------------

def resolve_sync(requested: str, same_process: bool, rollout_serves_adapters: bool) -> tuple[str, str]:
    """``(sync mode, why)`` for ``roles.actor.lora.sync`` (see the module docstring)."""
    if requested != "auto":
        return requested, "as set"
    if same_process:
        return "merged", ("the actor and the rollout share a process: the merged weights are a copy on the device "
                          "they live on, and the engine generates without LoRA kernels")
    if not rollout_serves_adapters:
        return "merged", "the rollout backend does not serve LoRA adapters: full merged weights are sent"
    return "adapter", "the weights cross to another process: only the adapters are sent"


def reference_is_actor_base(cfg: Any, plan: Any) -> bool:
    """Whether the reference role is served by the LoRA actor's own engine (the base with its adapters
    disabled, no copy of the weights): the actor has adapters and both roles share a process and a backend.
    Otherwise a reference loads ``model.path`` itself, which is the same base."""
    if getattr(cfg.roles.actor, "lora", None) is None or cfg.roles.ref is None:
        return False
    if "ref" not in plan.role_pool or not plan.same_process("actor", "ref"):
        return False
    group = plan.group_of("actor")
    return group.roles.get("ref") == group.roles.get("actor")


class MergedAdapters:
    """A rollout's weights kept at ``W0 + scaling * B A`` from the adapters each sync sends (``sync: adapter``
    into an engine without LoRA kernels: the transformers rollout). The first merge into a layer keeps a copy
    of its base ``W0`` in host memory, so every later merge starts again from the base (merging onto the last
    merge would add up the updates, and undoing it would drift by a rounding per step); the merge is computed
    on the CPU in fp32 and copied into the live weight."""

    def __init__(self, weights: Callable[[], Mapping[str, torch.Tensor]], scaling: float) -> None:
        self.weights = weights  # () -> {HF parameter name: the live tensor}, asked at each merge
        self.scaling = scaling
        self.base: dict[str, torch.Tensor] = {}
        self.pending: list[tuple[str, torch.Tensor]] = []

    def stage(self, name: str, tensor: torch.Tensor) -> None:
        """Keep one adapter matrix of this sync (a copy: the bucket may be a buffer the next one reuses)."""
        self.pending.append((name, tensor.detach().to("cpu", copy=True)))

    @torch.no_grad()
    def apply(self) -> int:
        """Merge the staged adapters into their layers; returns how many layers changed. ``KeyError`` names an
        adapter for a layer the model does not have."""
        pairs = pair_adapters(self.pending)
        self.pending = []
        weights = self.weights()
        for module, (a, b) in pairs.items():
            name = f"{module}.weight"
            target = weights.get(name)
            if target is None:
                raise KeyError(f"a LoRA adapter for '{module}', which the model does not have")
            base = self.base.get(name)
            if base is None:
                base = self.base[name] = target.detach().to("cpu", copy=True)
            target.copy_(merged_weight(base, a, b, self.scaling, target.dtype))
        return len(pairs)
