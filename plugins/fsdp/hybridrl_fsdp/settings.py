"""The FSDP backend's own role settings (``roles.<role>.options``), with their defaults and checks.

The shared training settings (lr, betas, micro_batch, grad_clip, warmup, token budget) arrive typed in
``EngineContext.training``, validated by the core; this module declares only what is the backend's own, and
pre-flight validates them with ``FSDPSettings`` (registered as the backend's ``options``) before any process
starts.
Engine-free: importing it loads no torch.distributed or transformers code.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, model_validator

from hybridrl.engines.options import BackendOptions, one_of
from hybridrl.roles import role_spec
from hybridrl_fsdp.layer_kernels import CHOICES as FUSED_KERNEL_CHOICES
from hybridrl_fsdp.offload import MODES as OFFLOAD_MODES

#: the model heads the engine builds: LM (log-probs), per-token values (critic), one score per sequence.
HEADS = ("lm", "value", "reward")
#: the varlen attention kernels of packed micro-batches (``hybridrl_fsdp.varlen_attention``; auto: the first
#: of flash_attn, torch_flash, sdpa that can run).
PACKED_ATTENTION = ("auto", "flash_attn", "torch_flash", "sdpa")
#: how AdamW steps (torch's ``fused`` kernel or its ``foreach`` ops; auto: fused where every parameter is on
#: one CPU or CUDA device, as torchtitan's ``optimizer.implementation`` does).
OPTIMIZER_IMPLEMENTATIONS = ("auto", "fused", "foreach")
#: what the fused head does with its logits between forward and backward (``hybridrl_fsdp.fused_head``): keep
#: them (memory for one GEMM less) or make them again; auto: the memory plan's choice (unresolved: recompute).
HEAD_LOGITS = ("auto", "keep", "recompute")


def _coefficient(value: Any) -> Any:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0
                              or value != value):
        raise ValueError(f"must be a number >= 0 (the loss weight; unset: the model config's), got {value!r}")
    return value


Coefficient = Annotated[float | None, BeforeValidator(_coefficient)]


class FSDPSettings(BackendOptions):
    """The FSDP backend's options; every field is printed by ``hybridrl plugins fsdp`` from its description."""

    gradient_checkpointing: Annotated[bool | str, one_of(True, False, "auto")] = Field(
        False, description="recompute each layer's activations in the backward (true, false or auto: the plan's)",
        json_schema_extra={"type": "bool | auto"})
    attn_implementation: str | None = Field(
        None, description="a transformers attention name; unset: the engine's varlen attention (packing) or sdpa")
    head: Annotated[str, one_of(*HEADS)] = Field(
        "lm", description=f"the model head: {', '.join(HEADS)} (default: the role's: critic value, reward reward, "
                          "else lm)", json_schema_extra={"type": "str"})
    fused_lm_head: Annotated[bool, one_of(True, False)] = Field(
        True, description="log-probs and entropies through the fused head, without the full logits")
    offload: Annotated[str, one_of("auto", *OFFLOAD_MODES)] = Field(
        "none", description="what stays in host memory between the role's phases (auto: the plan's choice)",
        json_schema_extra={"type": "str"})
    packing: Annotated[bool, one_of(True, False)] = Field(
        True, description="padding-free micro-batches: rows end to end, varlen attention")
    packed_attention: Annotated[str, one_of(*PACKED_ATTENTION)] = Field(
        "auto", description=f"the varlen kernel of packed rows: {', '.join(PACKED_ATTENTION)}",
        json_schema_extra={"type": "str"})
    share_prompts: Annotated[bool | str, one_of("auto", True, False)] = Field(
        "auto", description="a packed micro-batch holds each distinct prompt once (auto: with packing and varlen "
                            "attention)", json_schema_extra={"type": "bool | auto"})
    fused_kernels: Annotated[bool | str, one_of(*FUSED_KERNEL_CHOICES)] = Field(
        "auto", description="liger-kernel's RMSNorm / SwiGLU / rotary kernels in the layers (auto: on CUDA where "
                            "installed)", json_schema_extra={"type": "bool | auto"})
    optimizer_implementation: Annotated[str, one_of(*OPTIMIZER_IMPLEMENTATIONS)] = Field(
        "auto", description=f"how AdamW steps: {', '.join(OPTIMIZER_IMPLEMENTATIONS)}",
        json_schema_extra={"type": "str"})
    head_logits: Annotated[str, one_of(*HEAD_LOGITS)] = Field(
        "auto", description=f"the fused head keeps its logits for the backward or recomputes them: "
                            f"{', '.join(HEAD_LOGITS)}", json_schema_extra={"type": "str"})
    moe_aux_loss_coef: Coefficient = Field(
        None, description="MoE: weight of the routers' load-balancing loss (unset: the model config's)",
        json_schema_extra={"type": "float | None"})
    moe_z_loss_coef: Coefficient = Field(
        None, description="MoE: weight of the router z-loss (unset: the model config's, else none)",
        json_schema_extra={"type": "float | None"})

    @model_validator(mode="after")
    def _packed_layouts(self) -> FSDPSettings:
        attn = self.attn_implementation
        if self.share_prompts is True and self.packing is not True:
            raise ValueError("share_prompts: needs packing: true (shared prompts are a layout of packed rows)")
        if self.share_prompts is True and attn is not None:
            raise ValueError(f"share_prompts: needs the engine's varlen attention: attn_implementation '{attn}' "
                             "would see the shared prompts' pack as one sequence (leave attn_implementation unset)")
        if self.packing is True and attn is not None and not attn.startswith("flash_attention"):
            raise ValueError(f"attn_implementation: '{attn}' cannot keep packed rows apart: leave it unset (the "
                             "engine's varlen attention, see packed_attention), use flash_attention_2/3, or set "
                             "packing: false")
        return self

    @classmethod
    def from_options(cls, options: Mapping[str, Any], role: str = "actor") -> FSDPSettings:
        """The engine's settings from ``ctx.options``: validated, the role's head where none is set, and an
        ``auto`` the pre-flight left unresolved (no device to plan for) turned off."""
        settings, problems = cls.read(options)
        if settings is None:
            raise ValueError("; ".join(f"options.{key}: {reason}" if key else reason for key, reason in problems))
        update: dict[str, Any] = {"gradient_checkpointing": settings.gradient_checkpointing is True,
                                  "offload": "none" if settings.offload == "auto" else settings.offload}
        if "head" not in options or options.get("head") is None:
            update["head"] = role_spec(role).head or "lm"
        return settings.model_copy(update=update)

    def keeps_head_logits(self) -> bool:
        """Whether the fused head keeps its logits for the backward: ``keep`` only (``auto`` is the memory plan's
        to resolve; where it did not, e.g. without a device to plan for, recomputing needs the least memory)."""
        return self.fused_lm_head and self.head_logits == "keep"

    def shares_prompts(self) -> bool:
        """Whether packs hold each distinct prompt once. Only the engine's own varlen attention reads that
        layout, so ``auto`` is on wherever it runs (packing, no ``attn_implementation``), on every device."""
        return self.packing and not self.attn_implementation and self.share_prompts is not False


def option_problems(role: str, options: Mapping[str, Any], training: Any = None) -> list[tuple[str, str]]:
    """``(key, reason)`` for each bad or unknown key of ``roles.<role>.options`` (the key without its prefix), as
    pre-flight reports them from ``FSDPSettings``."""
    _, problems = FSDPSettings.read({k: v for k, v in options.items() if not (k == "head" and v is None)})
    return [(key, reason.replace("unknown option", "unknown option of the fsdp backend", 1))
            for key, reason in problems]


def auto_options(role: str, options: Mapping[str, Any], device: str) -> list[tuple[str, Any, str]]:
    """The backend's own ``auto`` options of a role (registered as its ``resolve_options``): ``share_prompts``."""
    if options.get("share_prompts", "auto") != "auto" or option_problems(role, options):
        return []
    settings = FSDPSettings.from_options(options, role)
    value = settings.shares_prompts()
    if value:
        why = ("each distinct prompt once per packed micro-batch (a GRPO group's samples repeat it): fewer tokens, "
               "the same numbers")
    else:
        why = "needs packing and the engine's own varlen attention"
    return [("share_prompts", value, why)]
