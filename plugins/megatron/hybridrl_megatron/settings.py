"""The Megatron backend's own role settings (``ctx.options``), with their defaults and checks; the shared
training settings (lr, betas, micro_batch, grad_clip, warmup) arrive typed in ``EngineContext.training``.
Engine-free: ``option_problems`` runs in pre-flight, before any process starts."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hybridrl.engines import TrainingOptions
from hybridrl.plugins.options import OptionDoc, dataclass_options
from hybridrl.roles import role_spec

HEADS = ("lm", "value")


@dataclass(frozen=True)
class MegatronSettings:
    #: None: take the layout Megatron already has in this process (a reference policy fused with a Megatron
    #: actor shares its process and so its parallel state), else 1.
    tensor_parallel: int | None = None
    pipeline_parallel: int | None = None
    vocab_multiple: int = 128  # Megatron pads the vocabulary to a multiple of this times tensor_parallel
    recompute: bool = False  # full activation recomputation of every layer (Megatron's "full/uniform/1")
    head: str = "lm"  # "lm" (actor, reference: log-probs) or "value" (critic: one value per position)
    #: a mixture-of-experts model's experts split over this many data-parallel ranks (None: the layout already in
    #: the process, else 1)
    expert_parallel: int | None = None
    #: MoE: weight of the routers' load-balancing loss (None: the model config's router_aux_loss_coef)
    moe_aux_loss_coef: float | None = None

    @classmethod
    def from_options(cls, options: Mapping[str, Any], role: str = "actor") -> MegatronSettings:
        problems = option_problems(role, options)
        if problems:
            raise ValueError("; ".join(f"options.{key}: {reason}" for key, reason in problems))

        def optional_int(key: str) -> int | None:
            value = options.get(key)
            return None if value is None else int(value)

        return cls(
            tensor_parallel=optional_int("tensor_parallel"),
            pipeline_parallel=optional_int("pipeline_parallel"),
            vocab_multiple=int(options.get("vocab_multiple", cls.vocab_multiple)),
            recompute=bool(options.get("recompute", options.get("gradient_checkpointing", False))),
            head=str(options.get("head") or role_spec(role).head or "lm"),
            expert_parallel=optional_int("expert_parallel"),
            moe_aux_loss_coef=None if options.get("moe_aux_loss_coef") is None else float(options["moe_aux_loss_coef"]),
        )


#: keys of ``roles.<role>.options`` the backend reads (``gradient_checkpointing`` is an alias of ``recompute``).
OPTION_KEYS = ("tensor_parallel", "pipeline_parallel", "expert_parallel", "vocab_multiple", "recompute",
               "gradient_checkpointing", "head", "moe_aux_loss_coef")


#: one line per option for ``hybridrl plugins megatron`` (``OPTIONS``).
OPTION_DESCRIPTIONS = {
    "tensor_parallel": "ranks that split each layer (unset: the layout already in the process, else 1)",
    "pipeline_parallel": "ranks that split the layers into stages (unset: the layout already in the process, else 1)",
    "vocab_multiple": "the vocabulary is padded to a multiple of this times tensor_parallel",
    "recompute": "full activation recomputation of every layer",
    "head": f"the model head: {', '.join(HEADS)} (default: the role's)",
    "expert_parallel": "MoE: experts split over this many data-parallel ranks (unset: the layout in the process, "
                       "else 1)",
    "moe_aux_loss_coef": "MoE: weight of the routers' load-balancing loss (unset: the model config's)",
}
OPTIONS = (*dataclass_options(MegatronSettings, OPTION_DESCRIPTIONS),
           OptionDoc("gradient_checkpointing", "bool", False, "an alias of recompute"))


def layout_problem(world_size: int, tp: int, pp: int, ep: int) -> str | None:
    """Why ``tp`` x ``pp`` (x ``ep`` carved out of data parallelism) cannot lay out ``world_size`` ranks."""
    if world_size % (tp * pp):
        return f"tensor_parallel={tp} x pipeline_parallel={pp} does not divide the {world_size} ranks of the pool"
    dp = world_size // (tp * pp)
    if dp % ep:
        return (f"expert_parallel={ep} does not divide the data-parallel size {dp} ({world_size} ranks / "
                f"tensor_parallel={tp} / pipeline_parallel={pp}): expert groups are made of data-parallel ranks")
    return None


def option_problems(role: str, options: Mapping[str, Any], training: TrainingOptions | None = None
                    ) -> list[tuple[str, str]]:
    """``(key, reason)`` for each bad or unknown key of the role's backend options (the key without prefix),
    and for a shared training setting the backend cannot honour."""
    problems = []
    if training is not None and training.max_tokens_per_micro_batch is not None:
        problems.append(("max_tokens_per_micro_batch", "not supported by the megatron backend: batches are split "
                                                        "by rows (micro_batch), since pipeline schedules send "
                                                        "fixed-shape micro-batches"))
    problems += [(key, f"unknown option of the megatron backend (known: {', '.join(OPTION_KEYS)})")
                for key in options if key not in OPTION_KEYS]
    head = options.get("head") or role_spec(role).head or "lm"
    if head not in HEADS:
        problems.append(("head", f"head '{head}' is not one of {', '.join(HEADS)} (a reward model needs another "
                                 "backend)"))
    coef = options.get("moe_aux_loss_coef")
    if coef is not None and (isinstance(coef, bool) or not isinstance(coef, (int, float)) or not coef >= 0):
        problems.append(("moe_aux_loss_coef", f"must be a number >= 0 (unset: the model config's), got {coef!r}"))
    for key in ("tensor_parallel", "pipeline_parallel", "expert_parallel", "vocab_multiple"):
        value = options.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            problems.append((key, f"must be a positive integer, got {value!r}"))
    return problems
