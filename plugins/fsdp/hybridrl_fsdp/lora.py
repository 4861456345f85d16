"""LoRA adapters on the FSDP engine's model, through peft (``EngineContext.lora``; ``hybridrl.lora``).

The engine wraps its causal LM with ``peft.get_peft_model`` before ``fully_shard`` (peft replaces the targeted
``nn.Linear`` modules with LoRA layers holding ``base_layer``, ``lora_A`` and ``lora_B``; FSDP2 then shards the
wrapped layers like any others). The base is frozen, so the optimizer, its state and the gradients cover the
adapters alone; on a GPU the frozen base is kept in the compute dtype (mixed precision would cast every gather
to it anyway: the same numbers in half the memory) and the adapters in fp32.

What leaves the engine is always under names the rest of hybridrl knows:

* ``named_tensors(merged=True)``: the policy, HF-named, each adapted weight merged (``W + alpha/r * B A``):
  ``export_weights`` (the merged sync, ``hybridrl export``, weight checks);
* ``named_tensors(merged=False)``: the frozen base, HF-named (the reference's weights);
* ``adapter_tensors``: the adapters under peft's saved names (the adapter sync, ``hybridrl export --adapter``).

Checkpoints hold the adapters and their optimizer state only (``trainable_state``): the base is the run's
``model.path``, loaded again on resume and by the export.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from hybridrl.lora import ALL_LINEAR, PEFT_PREFIX, LoraSpec, adapter_name, merged_weight, target_names

#: how the engine reads one (possibly sharded) parameter as a whole tensor: a view, a gather, a copy.
TensorOf = Callable[[torch.Tensor], torch.Tensor]
_BASE = ".base_layer."


class Adapters:
    """The LoRA wrapping of one engine's model: the peft model, its adapted modules, and the tensors it exports."""

    def __init__(self, model: nn.Module, spec: LoraSpec, base_dtype: torch.dtype | None = None) -> None:
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError:
            raise ImportError("roles.actor.lora needs peft: pip install 'hybridrl-fsdp[lora]'") from None

        targets = spec.target_modules if spec.target_modules == ALL_LINEAR else list(spec.target_modules)
        config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=targets,
                            bias="none")
        model.requires_grad_(False)
        try:
            #: the peft model (no task type: its forward hands every argument to the causal LM unchanged)
            self.model = get_peft_model(model, config)
        except ValueError as exc:  # peft's message names the target modules it could not find
            raise ValueError(f"roles.actor.lora.target_modules: {exc}") from None
        self.spec = spec
        self.adapter = self.model.active_adapter
        params = dict(self.model.named_parameters())
        #: HF module path -> the names of its base weight and its two adapter matrices in ``named_parameters``
        self.layers: dict[str, tuple[str, str, str]] = {}
        for name in params:
            if name.endswith(f"{_BASE}weight") and name.startswith(PEFT_PREFIX):
                prefix = name[:-len(f"{_BASE}weight")]
                a, b = f"{prefix}.lora_A.{self.adapter}.weight", f"{prefix}.lora_B.{self.adapter}.weight"
                if a in params and b in params:
                    self.layers[prefix[len(PEFT_PREFIX):]] = (name, a, b)
        if not self.layers:
            raise ValueError(f"roles.actor.lora.target_modules: {spec.target_modules!r} put no adapter on any layer")
        self.adapter_params = frozenset(n for _, a, b in self.layers.values() for n in (a, b))
        #: the dtype the frozen base is kept in (the merged weights leave in it too); None: as loaded (fp32)
        self.base_dtype = base_dtype
        if base_dtype is not None:
            for name, param in self.model.named_parameters():
                if name not in self.adapter_params:
                    param.data = param.data.to(base_dtype)

    @property
    def target_modules(self) -> list[str]:
        """The module names the adapters went on (what ``all-linear`` resolved to)."""
        return target_names(self.layers)

    @staticmethod
    def hf_name(name: str) -> str:
        """A parameter or buffer name of the peft model as the plain causal LM names it."""
        if name.startswith(PEFT_PREFIX):
            name = name[len(PEFT_PREFIX):]
        return name.replace(_BASE, ".")

    @contextmanager
    def disabled(self) -> Iterator[None]:
        """Forwards inside run the frozen base alone (the reference policy). peft's ``disable_adapter`` also
        turns the adapters' ``requires_grad`` off; FSDP2 fixes each group's gradient dtypes at the root's first
        forward from the parameters that require grad then, so a reference forward coming first left the
        adapters' groups reducing bf16 gradients into fp32 parameters. The flag goes back on inside."""
        with self.model.disable_adapter():
            for name, param in self.model.named_parameters():
                if name in self.adapter_params:
                    param.requires_grad_(True)
            yield

    # --- what the engine exports -------------------------------------------------------------------------
    def named_tensors(self, tensor_of: TensorOf, merged: bool = True, dtype: torch.dtype | None = None
                      ) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter under its HF name, read with ``tensor_of``; with ``merged`` each adapted weight is
        ``W + scaling * B A`` (computed in fp32, returned in ``dtype``, default fp32), otherwise the base."""
        params = dict(self.model.named_parameters())
        merged_of = {weight: (a, b) for weight, a, b in self.layers.values()} if merged else {}
        for name, param in params.items():
            if name in self.adapter_params:
                continue
            if name in merged_of:
                a, b = merged_of[name]
                yield self.hf_name(name), merged_weight(tensor_of(param), tensor_of(params[a]), tensor_of(params[b]),
                                                        self.spec.scaling, dtype)
            else:
                yield self.hf_name(name), tensor_of(param)

    def adapter_tensors(self, tensor_of: TensorOf) -> Iterator[tuple[str, torch.Tensor]]:
        """The adapters under peft's saved names, module by module (A then B)."""
        params = dict(self.model.named_parameters())
        for module, (_, a, b) in self.layers.items():
            yield adapter_name(module, "A"), tensor_of(params[a])
            yield adapter_name(module, "B"), tensor_of(params[b])

    def trainable_state(self, model_state: Mapping[str, Any]) -> dict[str, Any]:
        """The part of a model state dict a checkpoint keeps: the adapters (a tied, frozen output head that a
        state dict lists under its own name is dropped with the rest of the base)."""
        return {k: v for k, v in model_state.items() if k in self.adapter_params}
