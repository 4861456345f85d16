"""Fused RMSNorm, SwiGLU and rotary-embedding kernels in the decoder layers (``options.fused_kernels``).

Why: in eager transformers an RMSNorm is half a dozen kernels over the (tokens x hidden) tensor and keeps an
fp32 copy of its input for backward, the MLP's ``act(gate) * up`` two more, the rotary embedding another
handful; next to the GEMMs of a 0.5B-3B model these memory-bound kernels are a large share of the update.
liger-kernel's Triton kernels do each in one pass and keep less for backward (``ModelShape`` in the core's
memory plan counts the difference when the backend declares ``fused_layer_kernels``).

The layers keep their modules: each RMSNorm and MLP instance gets a forward that calls the fused function on
its own weight and projections (so LoRA-wrapped projections, FSDP2's hooks and gradient checkpointing stay as
they are). The rotary embedding is a function of the modeling module, replaced there by one that takes the
fused path for CUDA tensors and the original otherwise.
"""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

#: ``options.fused_kernels``: ``auto`` (on with CUDA where liger-kernel is installed), true or false.
CHOICES = ("auto", True, False)
INSTALL_HINT = "pip install 'hybridrl-fsdp[kernels]' (liger-kernel)"
#: RMSNorm classes whose forward is ``weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)`` (liger's "llama" casting);
#: Gemma's norms scale by ``1 + weight`` and are left alone.
RMS_NORM_CLASSES = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm", "Qwen3MoeRMSNorm")
SILU_NAMES = ("silu", "swish")


def liger_installed() -> bool:
    from hybridrl_fsdp.plugin import liger_installed as installed  # one lookup, shared with the registration

    return installed()


def resolve(choice: Any, device: torch.device) -> bool:
    """Whether the engine fuses its layers: ``auto`` on CUDA with liger-kernel installed; ``true`` where either
    is missing is an error (the kernels are Triton, CUDA only)."""
    if choice not in CHOICES:
        raise ValueError(f"options.fused_kernels must be auto, true or false, got {choice!r}")
    if choice is False:
        return False
    if device.type != "cuda":
        if choice is True:
            raise ValueError("options.fused_kernels: true needs CUDA (liger-kernel's kernels are Triton); "
                             "use auto or false")
        return False
    if not liger_installed():
        if choice is True:
            raise ValueError(f"options.fused_kernels: true needs liger-kernel: {INSTALL_HINT}")
        return False
    return True


@dataclass
class FusedLayers:
    """What ``install`` fused, by kind (module names; the modeling modules whose rotary function it wraps)."""

    rms_norms: list[str] = field(default_factory=list)
    mlps: list[str] = field(default_factory=list)
    rotary: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return f"{len(self.rms_norms)} RMSNorms, {len(self.mlps)} MLPs, rotary in {len(self.rotary)} modules"


def fusable_rms_norm(module: nn.Module) -> bool:
    return (type(module).__name__ in RMS_NORM_CLASSES and isinstance(getattr(module, "weight", None), torch.Tensor)
            and hasattr(module, "variance_epsilon"))


def fusable_mlp(module: nn.Module) -> bool:
    """A gated SiLU MLP: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""
    if not all(isinstance(getattr(module, name, None), nn.Module) for name in ("gate_proj", "up_proj", "down_proj")):
        return False
    act = getattr(module, "act_fn", None)
    config = getattr(module, "config", None)
    hidden_act = getattr(config, "hidden_act", None)
    return isinstance(act, nn.SiLU) or (hidden_act in SILU_NAMES and type(act).__name__ in ("SiLU", "SiLUActivation"))


def rotary_module(model_module: Any) -> types.ModuleType | None:
    """The modeling module of a layer class when it rotates q/k with the standard ``apply_rotary_pos_emb``."""
    module = sys.modules.get(model_module)
    fn = getattr(module, "apply_rotary_pos_emb", None)
    if module is None or not callable(fn) or not hasattr(module, "rotate_half"):
        return None
    return module


def plan(model: nn.Module) -> FusedLayers:
    """What ``install`` would fuse in ``model`` (engine-free: reads the module tree only)."""
    fused = FusedLayers()
    for name, module in model.named_modules():
        if fusable_rms_norm(module):
            fused.rms_norms.append(name)
        elif fusable_mlp(module):
            fused.mlps.append(name)
        elif type(module).__name__.endswith("Attention"):
            owner = type(module).__module__
            if owner not in fused.rotary and rotary_module(owner) is not None:
                fused.rotary.append(owner)
    return fused


def install(model: nn.Module) -> FusedLayers:
    """Give the model's RMSNorms and gated MLPs liger's fused forwards and wrap its rotary function; CUDA only
    (call after ``resolve`` said yes)."""
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.ops.rope import LigerRopeFunction
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    fused = plan(model)
    modules = dict(model.named_modules())

    def rms_norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        # in_place=False: the gradient of the norm's output is not overwritten (it may have other readers)
        return LigerRMSNormFunction.apply(hidden_states, self.weight, self.variance_epsilon, 0.0, "llama", False)

    def mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(LigerSiLUMulFunction.apply(self.gate_proj(x), self.up_proj(x)))

    for name in fused.rms_norms:
        modules[name].forward = types.MethodType(rms_norm_forward, modules[name])
    for name in fused.mlps:
        modules[name].forward = types.MethodType(mlp_forward, modules[name])
    for owner in fused.rotary:
        module = sys.modules[owner]
        if not getattr(module.apply_rotary_pos_emb, "_hybridrl_fused", False):
            module.apply_rotary_pos_emb = _fused_rotary(module.apply_rotary_pos_emb, LigerRopeFunction.apply)
    log.info("fused layer kernels (liger-kernel): %s", fused.describe())
    return fused


def _fused_rotary(original: Callable[..., Any], fused: Callable[..., Any]) -> Callable[..., Any]:
    def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        # the fused kernel takes the layout of transformers' own call: (batch, heads, tokens, head_dim), no extras
        if args or kwargs.get("unsqueeze_dim", 1) != 1 or not q.is_cuda or cos.shape[-1] != q.shape[-1]:
            return original(q, k, cos, sin, *args, **kwargs)
        return fused(q, k, cos, sin, None, 1)

    apply_rotary_pos_emb._hybridrl_fused = True  # type: ignore[attr-defined]
    return apply_rotary_pos_emb
