"""The example train engine's memory model (``hybridrl.engines.memory_model.TrainMemoryModel``): what
``ExampleTrainer`` holds on its one device, so ``hybridrl plan`` can size it and the ``auto`` search can choose
its micro-batch. Engine-free: no torch, no transformers (a plan imports it on a laptop).

The engine loads fp32 weights and, when trainable, keeps fp32 gradients and AdamW's two fp32 moments; a forward
with autograd keeps every layer's activations and the fp32 logits of the micro-batch (with their log-softmax and,
in the backward, their gradient). It splits a batch by rows (``micro_batch``), so that is the one setting it
offers the search: when the config leaves the micro-batch unset, the search picks the most rows that fit.
"""

from __future__ import annotations

from typing import Any

from hybridrl.engines.memory_model import (
    AutoChoice,
    Knobs,
    RoleContext,
    RoleMemory,
    TrainSettings,
    micro_batch_tokens,
    step_cost,
    token_budget_is_auto,
)

#: micro-batches (rows) the search may try, largest first.
ROWS = (64, 32, 16, 8, 4, 2, 1)
#: fp32 copies of the logits alive at the backward: the logits, their log-softmax and its gradient.
LOGITS_COPIES = 3


def _seq(cfg: Any) -> int:
    return cfg.data.max_prompt_len + cfg.roles.rollout.max_new_tokens


class ExampleTrainerMemory:
    """See the module docstring."""

    fused_kernels = None  # no fused layer kernels to offer

    def settings(self, cfg: Any, role: str) -> TrainSettings:
        tokens, response = micro_batch_tokens(cfg, role)
        return TrainSettings(tokens, response)

    def knobs(self, cfg: Any, role: str) -> Knobs:
        from hybridrl.roles import role_spec

        return Knobs(budget=token_budget_is_auto(cfg, role), checkpointing=False, offload=False,
                     trainable=role_spec(role).trainable)

    def candidates(self, cfg: Any, role: str, knobs: Knobs) -> list[TrainSettings]:
        if not knobs.budget:
            return [self.settings(cfg, role)]
        seq, response = _seq(cfg), cfg.roles.rollout.max_new_tokens
        return [TrainSettings(float(rows * seq), float(rows * response)) for rows in ROWS]

    def cost(self, ctx: RoleContext, settings: TrainSettings) -> float:
        return step_cost(ctx, settings)

    def role_memory(self, ctx: RoleContext, settings: TrainSettings) -> RoleMemory:
        shape, tokens = ctx.shape, settings.tokens
        n = shape.param_count()
        mem = RoleMemory(ctx.role, ctx.pool, "train" if ctx.trainable else "frozen", "full", tokens=tokens)
        mem.weights = 4.0 * n
        logits = tokens * shape.vocab_size * 4
        forward = tokens * shape.forward_bytes_per_token_layer(4) + logits
        if ctx.trainable:
            mem.grads = 4.0 * n
            mem.optimizer = 8.0 * n
            mem.activations = tokens * (shape.num_layers * shape.saved_bytes_per_token_layer(4)
                                        + shape.backward_bytes_per_token_layer(4)) + LOGITS_COPIES * logits
        else:
            mem.activations = forward
        mem.forward = mem.weights + mem.optimizer + forward
        mem.idle = mem.weights + mem.optimizer
        mem.notes.append(f"{tokens / _seq(ctx.cfg):.0f} rows per micro-batch")
        return mem

    def option_problems(self, cfg: Any, role: str) -> list[tuple[str, str]]:
        return []  # the search sets no option of this engine

    def choices(self, cfg: Any, role: str, knobs: Knobs, settings: TrainSettings | None, why: str
                ) -> tuple[dict[str, Any], dict[str, Any], list[AutoChoice]]:
        if settings is None or not knobs.budget:  # without a device to plan for: the configured micro-batch
            return {}, {}, []
        rows = max(1, round(settings.tokens / _seq(cfg)))
        return {"micro_batch": rows}, {}, [AutoChoice(f"roles.{role}.micro_batch", rows, why)]

    def advice(self, cfg: Any, mem: RoleMemory) -> str:
        return f"{mem.role} holds the most: lower roles.{mem.role}.micro_batch"
