"""The role options ``MegatronEngine`` reads (``ctx.options``), with their defaults and checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from hybridrl.roles import role_spec


HEADS = ("lm", "value")


@dataclass(frozen=True)
class MegatronSettings:
    micro_batch: int = 16
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float | None = 1.0  # None or <= 0: measure the norm but do not clip
    warmup_steps: int = 0
    #: None: take the layout Megatron already has in this process (a reference policy fused with a Megatron
    #: actor shares its process and so its parallel state), else 1.
    tensor_parallel: int | None = None
    pipeline_parallel: int | None = None
    vocab_multiple: int = 128  # Megatron pads the vocabulary to a multiple of this times tensor_parallel
    recompute: bool = False  # full activation recomputation of every layer (Megatron's "full/uniform/1")
    head: str = "lm"  # "lm" (actor, reference: log-probs) or "value" (critic: one value per position)

    @classmethod
    def from_options(cls, options: Mapping[str, Any], role: str = "actor") -> "MegatronSettings":
        betas = options.get("betas", cls.betas)
        grad_clip = options.get("grad_clip", cls.grad_clip)

        def optional_int(key: str) -> int | None:
            value = options.get(key)
            return None if value is None else int(value)

        settings = cls(
            micro_batch=int(options.get("micro_batch", cls.micro_batch)),
            lr=float(options.get("lr", cls.lr)),
            weight_decay=float(options.get("weight_decay", cls.weight_decay)),
            betas=(float(betas[0]), float(betas[1])),
            grad_clip=None if grad_clip is None else float(grad_clip),
            warmup_steps=int(options.get("warmup_steps", cls.warmup_steps)),
            tensor_parallel=optional_int("tensor_parallel"),
            pipeline_parallel=optional_int("pipeline_parallel"),
            vocab_multiple=int(options.get("vocab_multiple", cls.vocab_multiple)),
            recompute=bool(options.get("recompute", options.get("gradient_checkpointing", False))),
            head=str(options.get("head") or role_spec(role).head or "lm"),
        )
        problems = []
        if settings.head not in HEADS:
            problems.append(f"head '{settings.head}' is not one of {', '.join(HEADS)} (a reward model needs another "
                            f"backend)")
        if options.get("max_tokens_per_micro_batch") is not None:
            problems.append("max_tokens_per_micro_batch is not supported: batches are split by rows (micro_batch), "
                            "since pipeline schedules send fixed-shape micro-batches")
        if settings.micro_batch <= 0:
            problems.append(f"micro_batch must be positive, got {settings.micro_batch}")
        if settings.lr < 0 or settings.warmup_steps < 0:
            problems.append(f"lr and warmup_steps must be >= 0, got {settings.lr} and {settings.warmup_steps}")
        for key in ("tensor_parallel", "pipeline_parallel"):
            value = getattr(settings, key)
            if value is not None and value <= 0:
                problems.append(f"{key} must be positive, got {value}")
        if settings.vocab_multiple <= 0:
            problems.append(f"vocab_multiple must be positive, got {settings.vocab_multiple}")
        if problems:
            raise ValueError("; ".join(problems))
        return settings
