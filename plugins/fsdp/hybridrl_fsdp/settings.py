"""The FSDP backend's own role settings (``roles.<role>.options``), with their defaults and checks.

The shared training settings (lr, betas, micro_batch, grad_clip, warmup, token budget) arrive typed in
``EngineContext.training``, validated by the core; this module declares only what is the backend's own, and
``option_problems`` checks them before any process starts (registered as the backend's options checker).
Engine-free: importing it loads no torch.distributed or transformers code.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from hybridrl.plugins.options import dataclass_options
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


@dataclass(frozen=True)
class FSDPSettings:
    gradient_checkpointing: bool = False
    attn_implementation: str | None = None  # None: the transformers default (sdpa)
    head: str = "lm"  # "lm", "value" (critic) or "reward" (reward model); default from the role
    fused_lm_head: bool = True  # log-probs/entropies through the fused head (no full logits); False: plain head
    offload: str = "none"  # what stays in host memory between the role's phases (hybridrl_fsdp.offload)
    packing: bool = True  # padding-free micro-batches (rows end to end, varlen attention); False: padded
    packed_attention: str = "auto"  # the varlen kernel of packed rows (PACKED_ATTENTION)
    share_prompts: Any = "auto"  # a pack holds each distinct prompt once (packing.SharedPrompts); auto: see engine
    fused_kernels: Any = "auto"  # liger-kernel's RMSNorm/SwiGLU/rotary in the layers (hybridrl_fsdp.layer_kernels)
    optimizer_implementation: str = "auto"  # AdamW's fused kernel or foreach ops (OPTIMIZER_IMPLEMENTATIONS)
    head_logits: str = "auto"  # the fused head keeps its logits for the backward or recomputes them (HEAD_LOGITS)
    #: MoE: weight of the routers' load-balancing loss (None: the model config's router_aux_loss_coef)
    moe_aux_loss_coef: float | None = None
    #: MoE: weight of the router z-loss (None: the model config's router_z_loss_coef, else none)
    moe_z_loss_coef: float | None = None

    @classmethod
    def from_options(cls, options: Mapping[str, Any], role: str = "actor") -> FSDPSettings:
        problems = option_problems(role, options)
        if problems:
            raise ValueError("; ".join(f"options.{key}: {reason}" for key, reason in problems))
        return cls(gradient_checkpointing=_flag(options.get("gradient_checkpointing")),
                   attn_implementation=options.get("attn_implementation"),
                   head=str(options.get("head") or role_spec(role).head or "lm"),
                   fused_lm_head=bool(options.get("fused_lm_head", cls.fused_lm_head)),
                   offload=_offload_mode(options.get("offload")),
                   packing=bool(options.get("packing", cls.packing)),
                   packed_attention=str(options.get("packed_attention", cls.packed_attention)),
                   share_prompts=options.get("share_prompts", cls.share_prompts),
                   fused_kernels=options.get("fused_kernels", cls.fused_kernels),
                   optimizer_implementation=str(options.get("optimizer_implementation",
                                                            cls.optimizer_implementation)),
                   head_logits=str(options.get("head_logits", cls.head_logits)),
                   moe_aux_loss_coef=_coef(options.get("moe_aux_loss_coef")),
                   moe_z_loss_coef=_coef(options.get("moe_z_loss_coef")))

    def keeps_head_logits(self) -> bool:
        """Whether the fused head keeps its logits for the backward: ``keep`` only (``auto`` is the memory plan's
        to resolve; where it did not, e.g. without a device to plan for, recomputing needs the least memory)."""
        return self.fused_lm_head and self.head_logits == "keep"

    def shares_prompts(self) -> bool:
        """Whether packs hold each distinct prompt once. Only the engine's own varlen attention reads that
        layout, so ``auto`` is on wherever it runs (packing, no ``attn_implementation``), on every device."""
        return self.packing and not self.attn_implementation and self.share_prompts is not False


#: one line per option for ``hybridrl plugins fsdp`` (``OPTIONS``); every field of ``FSDPSettings`` has one.
OPTION_DESCRIPTIONS = {
    "gradient_checkpointing": "recompute each layer's activations in the backward (true, false or auto: the plan's)",
    "attn_implementation": "a transformers attention name; unset: the engine's varlen attention (packing) or sdpa",
    "head": f"the model head: {', '.join(HEADS)} (default: the role's: critic value, reward reward, else lm)",
    "fused_lm_head": "log-probs and entropies through the fused head, without the full logits",
    "offload": "what stays in host memory between the role's phases (auto: the plan's choice)",
    "packing": "padding-free micro-batches: rows end to end, varlen attention",
    "packed_attention": f"the varlen kernel of packed rows: {', '.join(PACKED_ATTENTION)}",
    "share_prompts": "a packed micro-batch holds each distinct prompt once (auto: with packing and varlen attention)",
    "fused_kernels": "liger-kernel's RMSNorm / SwiGLU / rotary kernels in the layers (auto: on CUDA where installed)",
    "optimizer_implementation": f"how AdamW steps: {', '.join(OPTIMIZER_IMPLEMENTATIONS)}",
    "head_logits": f"the fused head keeps its logits for the backward or recomputes them: {', '.join(HEAD_LOGITS)}",
    "moe_aux_loss_coef": "MoE: weight of the routers' load-balancing loss (unset: the model config's)",
    "moe_z_loss_coef": "MoE: weight of the router z-loss (unset: the model config's, else none)",
}
OPTIONS = dataclass_options(FSDPSettings, OPTION_DESCRIPTIONS,
                            {"share_prompts": "bool | auto", "fused_kernels": "bool | auto"})


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


def option_problems(role: str, options: Mapping[str, Any], training: Any = None) -> list[tuple[str, str]]:
    """``(key, reason)`` for each bad or unknown key of ``roles.<role>.options`` (the key without its prefix);
    every shared training setting (``training``) is one the engine honours."""
    known = {f.name for f in fields(FSDPSettings)}
    problems = [(key, f"unknown option of the fsdp backend (known: {', '.join(sorted(known))})")
                for key in options if key not in known]
    value = options.get("gradient_checkpointing", False)
    if not isinstance(value, bool) and value != "auto":
        problems.append(("gradient_checkpointing", f"must be true, false or auto, got {value!r}"))
    value = options.get("fused_lm_head", True)
    if not isinstance(value, bool):
        problems.append(("fused_lm_head", f"must be true or false, got {value!r}"))
    value = options.get("offload")
    if value is not None and value not in ("auto", *OFFLOAD_MODES):
        problems.append(("offload", f"must be one of {', '.join(('auto', *OFFLOAD_MODES))}, got {value!r}"))
    value = options.get("fused_kernels", "auto")
    if value not in FUSED_KERNEL_CHOICES or not isinstance(value, (bool, str)):
        problems.append(("fused_kernels", f"must be auto, true or false, got {value!r}"))
    value = options.get("optimizer_implementation", "auto")
    if value not in OPTIMIZER_IMPLEMENTATIONS:
        problems.append(("optimizer_implementation",
                         f"must be one of {', '.join(OPTIMIZER_IMPLEMENTATIONS)}, got {value!r}"))
    value = options.get("head_logits", "auto")
    if value not in HEAD_LOGITS:
        problems.append(("head_logits", f"must be one of {', '.join(HEAD_LOGITS)}, got {value!r}"))
    for key in ("moe_aux_loss_coef", "moe_z_loss_coef"):
        value = options.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0
                                  or value != value):
            problems.append((key, f"must be a number >= 0 (the loss weight; unset: the model config's), got {value!r}"))
    head = options.get("head")
    if head is not None and head not in HEADS:
        problems.append(("head", f"unknown head '{head}' (known: {', '.join(HEADS)})"))
    attn = options.get("attn_implementation")
    if attn is not None and not isinstance(attn, str):
        problems.append(("attn_implementation", f"must be a transformers attention name, got {attn!r}"))
    packing = options.get("packing", True)
    if not isinstance(packing, bool):
        problems.append(("packing", f"must be true or false, got {packing!r}"))
    kernel = options.get("packed_attention", "auto")
    if kernel not in PACKED_ATTENTION:
        problems.append(("packed_attention", f"unknown kernel {kernel!r} (known: {', '.join(PACKED_ATTENTION)})"))
    share = options.get("share_prompts", "auto")
    if share not in ("auto", True, False) or not isinstance(share, (bool, str)):
        problems.append(("share_prompts", f"must be auto, true or false, got {share!r}"))
    elif share is True and packing is not True:
        problems.append(("share_prompts", "needs packing: true (shared prompts are a layout of packed rows)"))
    elif share is True and attn is not None:
        problems.append(("share_prompts", f"needs the engine's varlen attention: attn_implementation '{attn}' "
                         "would see the shared prompts' pack as one sequence (leave attn_implementation unset)"))
    if packing is True and isinstance(attn, str) and not attn.startswith("flash_attention"):
        problems.append(("attn_implementation", f"'{attn}' cannot keep packed rows apart: leave it unset (the "
                         "engine's varlen attention, see packed_attention), use flash_attention_2/3, or set "
                         "packing: false"))
    return problems


def _flag(value: Any) -> bool:
    """A boolean option where ``auto`` (resolved by the pre-flight; unresolved: off) and None mean off."""
    return value is True or (isinstance(value, str) and value.lower() in ("true", "1", "yes"))


def _coef(value: Any) -> float | None:
    return None if value is None else float(value)


def _offload_mode(value: Any) -> str:
    """``options.offload``: ``auto`` (resolved by the pre-flight; unresolved: nothing) and None mean none."""
    return "none" if value in (None, "auto") else str(value)
