"""The FSDP2 engine's memory model (``hybridrl.engines.memory_model.TrainMemoryModel``), registered with the
backend so the planner and the ``auto`` search know what a role of this engine holds. Engine-free: it imports
no torch, so a laptop plans a GPU cluster.

The engine keeps fp32 master weights (a frozen role on a GPU: weights in the compute dtype), fp32 gradients and
two fp32 AdamW states, sharded over its pool, and gathers a few decoder layers at a time in the compute dtype;
what ``options.offload`` sends to host memory is off the device outside the phases that use it. Its fused LM
head makes the logits a chunk at a time (``options.head_logits: keep`` keeps them for the backward). The
activations saved for backward were counted tensor by tensor on a Qwen2 decoder layer
(``ModelShape.saved_bytes_per_token_layer``); ``benchmarks/model_sizes.py`` checks the plan against the device.
A mixture-of-experts model holds, shards, gathers and steps every expert (``ModelShape.param_count``), while
each token's activations pass through its top-k experts only (``ModelShape.token_intermediate``).

The search may choose the token budget of a micro-batch, ``gradient_checkpointing``, ``offload`` and, after
those, ``head_logits``.
"""

from __future__ import annotations

import itertools
from typing import Any

from hybridrl.engines.memory_model import (
    AUTO,
    OFFLOAD_MODES,
    AutoChoice,
    Knobs,
    RoleContext,
    RoleMemory,
    TrainSettings,
    micro_batch_tokens,
    role_options,
    step_cost,
    token_budget_is_auto,
)
from hybridrl.roles import role_spec

#: bytes of fp32 parameters per AdamW param group: foreach's temporaries (a copy of the group's second moments)
#: stay within one group (the engine builds its groups with this size).
OPTIMIZER_GROUP_BYTES = 2 * 2**30
#: bytes per logit (in units of the compute dtype) alive at the start of the backward: the logits kept for
#: it, the gradient of the response slice and the full-width gradient the slice's backward builds.
TRAIN_LOGITS_COPIES = 3
#: the fp32 chunks of the chunked log-prob (``hybridrl_fsdp.logprobs``): forward, and backward.
LOG_PROB_CHUNKS_FORWARD = 2 * 256 * 2**20
LOG_PROB_CHUNKS_BACKWARD = 4 * 256 * 2**20
#: the fused LM head (``hybridrl_fsdp.fused_head``, on unless ``options.fused_lm_head: false``) makes the logits
#: a chunk of tokens at a time: bytes of one chunk and its softmax temporaries (Triton on a GPU: the chunk in the
#: compute dtype; eager elsewhere: fp32 chunks of 256 MiB).
FUSED_HEAD_CHUNK_BYTES = {"cuda": 1.5 * 2**30, "cpu": 3 * 256 * 2**20}
#: the caching allocator's rounding and fragmentation on a backward's transient memory.
ALLOCATOR_SLACK = 1.05
#: token budgets the search tries for one micro-batch: a trainable role's backward keeps activations, a
#: forward does not.
TRAIN_TOKEN_BUDGETS = (65536, 49152, 32768, 24576, 16384, 12288, 8192, 6144, 4096, 3072, 2048, 1536, 1024)
FORWARD_TOKEN_BUDGETS = (65536, 49152, 32768, 24576, 16384, 12288, 8192, 4096, 2048, 1024)


def uses_fused_head(cfg: Any, role: str) -> bool:
    """Whether the role's log-probs come from the fused head: a vocabulary head, not turned off
    (``options.fused_lm_head: false``)."""
    return bool(role_spec(role).vocab_head) and role_options(cfg, role).get("fused_lm_head", True) is not False


class FSDPMemory:
    """See the module docstring."""

    fused_kernels = "for FSDP: liger-kernel, pip install 'hybridrl-fsdp[kernels]'"

    def settings(self, cfg: Any, role: str) -> TrainSettings:
        tokens, resp = micro_batch_tokens(cfg, role)
        options = role_options(cfg, role)
        offload = options.get("offload") or "none"
        return TrainSettings(tokens, resp, options.get("gradient_checkpointing") is True,
                             offload if offload in OFFLOAD_MODES else "none",
                             options.get("fused_kernels") is True, options.get("head_logits") == "keep")

    def knobs(self, cfg: Any, role: str) -> Knobs:
        options = role_options(cfg, role)
        trainable = role_spec(role).trainable
        return Knobs(budget=token_budget_is_auto(cfg, role),
                     checkpointing=trainable and options.get("gradient_checkpointing", AUTO) == AUTO,
                     offload=options.get("offload", AUTO) == AUTO, trainable=trainable,
                     head_logits=trainable and uses_fused_head(cfg, role) and options.get("head_logits", AUTO) == AUTO)

    def candidates(self, cfg: Any, role: str, knobs: Knobs) -> list[TrainSettings]:
        base = self.settings(cfg, role)
        seq = cfg.data.max_prompt_len + cfg.roles.rollout.max_new_tokens
        share = cfg.roles.rollout.max_new_tokens / seq
        if knobs.budget:
            grid = TRAIN_TOKEN_BUDGETS if knobs.trainable else FORWARD_TOKEN_BUDGETS
            tokens = [(float(b), float(b) * share) for b in sorted({max(seq, b) for b in grid}, reverse=True)]
        else:
            tokens = [(base.tokens, base.response_tokens)]
        checkpointing = [False, True] if knobs.checkpointing else [base.checkpointing]
        offloads = (list(OFFLOAD_MODES) if knobs.trainable else ["none", "all"]) if knobs.offload else [base.offload]
        return [TrainSettings(t, r, c, o, base.fused_layers, base.keep_logits)
                for (t, r), c, o in itertools.product(tokens, checkpointing, offloads)]

    def cost(self, ctx: RoleContext, settings: TrainSettings) -> float:
        return step_cost(ctx, settings)

    def role_memory(self, ctx: RoleContext, settings: TrainSettings) -> RoleMemory:
        """The weights shard (fp32 masters when trainable, the compute dtype for a frozen role on a GPU), fp32
        gradients and two AdamW states when trainable, a few gathered layers and the root module in the compute
        dtype while computing, and the micro-batch's activations."""
        cfg, role, shape, dp, cb, device = ctx.cfg, ctx.role, ctx.shape, ctx.world_size, ctx.compute_bytes, ctx.device
        trainable = ctx.trainable
        shard = shape.param_count() / dp
        tokens, resp_tokens = settings.tokens, settings.response_tokens
        vocab = shape.vocab_size if role_spec(role).vocab_head else 1  # critic and reward model: a scalar head
        layer_forward = tokens * shape.forward_bytes_per_token_layer(cb)
        chunk_cap = 4 * resp_tokens * vocab * 4  # the fp32 chunks never exceed the logits themselves
        fused = uses_fused_head(cfg, role)
        fused_chunk = min(FUSED_HEAD_CHUNK_BYTES["cuda" if device == "cuda" else "cpu"], chunk_cap)
        if fused:  # the head's logits a chunk at a time, never all at once
            forward_logits = fused_chunk
        else:
            forward_logits = resp_tokens * vocab * cb + (min(LOG_PROB_CHUNKS_FORWARD, chunk_cap) if vocab > 1 else 0)
        mem = RoleMemory(role, ctx.pool, "train" if trainable else "frozen", f"1/{dp} FSDP", offload=settings.offload,
                         tokens=tokens, checkpointing=settings.checkpointing,
                         optimizer_group_bytes=OPTIMIZER_GROUP_BYTES)
        master_bytes = 4 if trainable or device != "cuda" else cb
        mem.weights = master_bytes * shard
        mem.gathered = cb * (shape.root_params + 2 * shape.layer_params)  # current layer + the prefetched next
        mem.forward = mem.weights + mem.gathered + layer_forward + forward_logits
        if trainable:
            mem.grads = 4 * shard
            mem.optimizer = 8 * shard
            mem.optimizer_step = 4 * min(shard, OPTIMIZER_GROUP_BYTES / 4)  # sqrt of one group's second moments
            mem.gathered += cb * shape.layer_params  # backward: a layer's unsharded gradients before reduce-scatter
            per_layer = shape.saved_bytes_per_token_layer(cb, fused=settings.fused_layers and device == "cuda")
            if settings.checkpointing:
                layers = tokens * (shape.num_layers * shape.hidden_size * cb + per_layer)
            else:
                layers = tokens * shape.num_layers * per_layer
            if fused:  # backward: a chunk, the head's fp32 weight gradient and a chunk's product, the hidden's grad
                logits = fused_chunk + vocab * shape.hidden_size * (4 + cb) + resp_tokens * shape.hidden_size * cb
                if settings.keep_logits:  # the micro-batch's logits, kept from the forward: at most one per token
                    logits += tokens * vocab * cb  # (a pack with shared prompts is nearly all response tokens)
            else:
                logits = resp_tokens * vocab * cb * TRAIN_LOGITS_COPIES + (min(LOG_PROB_CHUNKS_BACKWARD, chunk_cap)
                                                                           if vocab > 1 else 0)
            mem.activations = (layers + logits + tokens * shape.backward_bytes_per_token_layer(cb)) * ALLOCATOR_SLACK
            if settings.offload == "none":
                mem.forward += mem.optimizer
            mem.notes.append("gradient checkpointing" if settings.checkpointing else "no gradient checkpointing")
        else:
            mem.activations = layer_forward + forward_logits
        mem.notes.append(f"{tokens:.0f} tokens per micro-batch")
        if shape.is_moe:  # every expert is sharded, gathered and stepped; a token computes with its top-k only
            mem.notes.append(f"MoE: {shape.param_count() / 1e9:.2f}B parameters held, "
                             f"{shape.active_param_count() / 1e9:.2f}B active per token")
        on_device_weights = 0.0 if settings.offload == "all" else mem.weights
        on_device_optimizer = mem.optimizer if settings.offload == "none" else 0.0
        mem.idle = on_device_weights + on_device_optimizer  # gradients are freed after the optimizer step
        if settings.offload != "none":
            mem.notes.append(f"offload {settings.offload}: on the host outside its phases")
        return mem

    def option_problems(self, cfg: Any, role: str) -> list[tuple[str, str]]:
        """Values of ``options.offload`` / ``options.gradient_checkpointing`` that are not allowed."""
        problems = []
        options = role_options(cfg, role)
        trainable = role_spec(role).trainable
        offload = options.get("offload")
        allowed = OFFLOAD_MODES if trainable else ("none", "all")
        if offload is not None and offload != AUTO and offload not in allowed:
            problems.append((f"roles.{role}.options.offload", f"must be one of {(AUTO, *allowed)}, got {offload!r}"
                             + ("" if trainable else f" ({role} has no optimizer)")))
        ckpt = options.get("gradient_checkpointing")
        if ckpt is not None and ckpt != AUTO and not isinstance(ckpt, bool):
            problems.append((f"roles.{role}.options.gradient_checkpointing",
                             f"must be true, false or auto, got {ckpt!r}"))
        return problems

    def choices(self, cfg: Any, role: str, knobs: Knobs, settings: TrainSettings | None, why: str
                ) -> tuple[dict[str, Any], dict[str, Any], list[AutoChoice]]:
        update: dict[str, Any] = {}
        options: dict[str, Any] = {}
        out: list[AutoChoice] = []
        if settings is None:  # nothing to plan against: the least memory, the backend's micro-batch
            if knobs.checkpointing:
                options["gradient_checkpointing"] = False
                out.append(AutoChoice(f"roles.{role}.options.gradient_checkpointing", False, why))
            if knobs.offload:
                options["offload"] = "none"
                out.append(AutoChoice(f"roles.{role}.options.offload", "none", why))
            if knobs.head_logits:
                options["head_logits"] = "recompute"
                out.append(AutoChoice(f"roles.{role}.options.head_logits", "recompute", why))
            return update, options, out
        s = settings
        if knobs.budget:
            update["max_tokens_per_micro_batch"] = int(s.tokens)
            out.append(AutoChoice(f"roles.{role}.max_tokens_per_micro_batch", int(s.tokens), why))
        if knobs.checkpointing:
            options["gradient_checkpointing"] = s.checkpointing
            out.append(AutoChoice(f"roles.{role}.options.gradient_checkpointing", s.checkpointing,
                                  "the activations do not fit without it" if s.checkpointing else
                                  "the activations fit without it"))
        if knobs.offload:
            options["offload"] = s.offload
            out.append(AutoChoice(f"roles.{role}.options.offload", s.offload,
                                  "the resident state and the engine fit on the device" if s.offload == "none" else
                                  f"kept on the host outside its phases so that every phase fits ({why})"))
        if knobs.head_logits:
            options["head_logits"] = "keep" if s.keep_logits else "recompute"
            out.append(AutoChoice(f"roles.{role}.options.head_logits", options["head_logits"],
                                  "the fused head keeps its logits for the backward: one GEMM less" if s.keep_logits
                                  else "the fused head's logits, kept for the backward, would not fit beside these "
                                  "settings: made again there"))
        return update, options, out

    def advice(self, cfg: Any, mem: RoleMemory) -> str:
        options = role_options(cfg, mem.role)
        tips = [f"lower roles.{mem.role}.max_tokens_per_micro_batch (or micro_batch)"]
        if mem.kind == "train" and options.get("gradient_checkpointing") is not True:
            tips.append(f"set roles.{mem.role}.options.gradient_checkpointing=true")
        if mem.offload != "all":
            mode = "optimizer" if mem.kind == "train" and mem.offload == "none" else "all"
            tips.append(f"roles.{mem.role}.options.offload={mode}")
        tips.append(f"spread {mem.role} over more devices (pools.{mem.pool})")
        return f"{mem.role} holds the most: " + ", ".join(tips)


FSDP_MEMORY = FSDPMemory()


def oom_fixes(role: str, mem: RoleMemory | None, phase: str | None) -> list[str]:
    """Keys that lower the role's memory in ``phase``, cheapest first; ``phase`` None: what it gives up for
    another role's phase (its state offloaded)."""
    if phase is None:
        out = []
        if role_spec(role).trainable and (mem is None or mem.offload == "none"):
            out.append(f"roles.{role}.options.offload=optimizer")
        if mem is None or mem.offload != "all":
            out.append(f"roles.{role}.options.offload=all")
        return out
    fixes = [f"roles.{role}.max_tokens_per_micro_batch={max(1, int(mem.tokens) // 2)}" if mem is not None and
             mem.tokens else f"roles.{role}.micro_batch lower"]
    if phase.startswith("update") and not (mem is not None and mem.checkpointing):
        fixes.append(f"roles.{role}.options.gradient_checkpointing=true")
    return fixes


def shares_prompts(role: str, options: dict[str, Any]) -> bool:
    """Whether the role's packs hold each distinct prompt once (``options.share_prompts``, resolved)."""
    return options.get("share_prompts") is True
