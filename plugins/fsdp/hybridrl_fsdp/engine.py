"""``FSDPEngine``: a Hugging Face causal LM sharded with PyTorch FSDP2 (``fully_shard``).

The engine runs inside a process whose default ``torch.distributed`` group is already initialised by the
host (``hybridrl.runtime.distributed.init_process_group``): every rank of that group is one data-parallel shard.
Master weights, gradients and AdamW state are fp32; on CUDA the forward/backward run in ``ctx.dtype``
through FSDP2's ``MixedPrecisionPolicy`` (gradients reduced in fp32). A single CPU rank has nothing to shard
and no mixed precision: its model stays a plain module (``uses_fsdp``).

Every public method except ``offload``/``onload`` is collective: all ranks must call it, with local batches
that split into the same number of micro-batches (checked, so a mismatch raises instead of hanging; with a
token budget the ranks agree on the count first, see ``micro_batching``).

One engine class serves three heads, chosen by the role (or ``options.head``): ``lm`` (actor, reference:
log-probs and entropies), ``value`` (critic: ``ValueModel``, per-token values) and ``reward`` (reward model:
``SequenceScorer``, one score per sequence).
"""

from __future__ import annotations

import inspect
import math
from collections import defaultdict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from hybridrl.engines import EngineContext, LossScale, Objective, TrainEngine, TrainingOptions, WeightBucket
from hybridrl.engines.batch import (
    ENTROPY,
    LOG_PROBS,
    RESPONSE_IDS,
    RESPONSE_MASK,
    ROUTED_EXPERTS,
    ROUTING_MISMATCH,
    SCORES,
    VALUES,
    Batch,
    sequence_tensors,
)
from hybridrl.engines.train_kit import (
    WeightedMean,
    check_same_count,
    engine_device,
    raise_if_counts_differ,
    require_process_group,
    sampling_temperature,
)
from hybridrl.roles import role_spec
from hybridrl.runtime.distributed import all_reduce_sum
from hybridrl.weights.buckets import group_into_buckets
from hybridrl.weights.experts import to_checkpoint_layout
from hybridrl.weights.sync_check import GREEDY_MARGIN, greedy_margins
from hybridrl_fsdp import layer_kernels, varlen_attention
from hybridrl_fsdp.fused_head import install_log_prob_head
from hybridrl_fsdp.logprobs import chunked_log_probs
from hybridrl_fsdp.lora import Adapters
from hybridrl_fsdp.memory import OPTIMIZER_GROUP_BYTES
from hybridrl_fsdp.micro_batching import MicroBatch, plan_micro_batches, scatter_rows
from hybridrl_fsdp.moe import AUX_LOSS, Z_LOSS, RouterLoss, hf_config, router_class
from hybridrl_fsdp.offload import HostCopy, OffloadPolicy, optimizer_state_tensors, step_group_by_group
from hybridrl_fsdp.packing import PackedRows
from hybridrl_fsdp.routing_replay import ROUTING_MISMATCH_METRIC, RoutingReplay, TokenRouting, token_routing
from hybridrl_fsdp.settings import FSDPSettings

#: the per-micro-batch tensors the LM head can hand to an objective.
SUPPORTED_OUTPUTS = frozenset({LOG_PROBS, ENTROPY})
#: what each head can hand to an objective in ``update``.
HEAD_OUTPUTS = {"lm": SUPPORTED_OUTPUTS, "value": frozenset({VALUES}), "reward": frozenset()}
#: the torch.distributed.checkpoint folder inside a checkpoint directory.
DCP_DIR = "dcp"


class FSDPEngine(TrainEngine):
    """Actor / reference policy / critic / reward model on FSDP2. ``ctx.trainable=False`` gives a frozen model
    without optimiser."""

    def __init__(self, ctx: EngineContext) -> None:
        super().__init__(ctx)
        require_process_group(ctx, "FSDPEngine")
        self.settings = FSDPSettings.from_options(ctx.options, ctx.role)
        self.training = ctx.training
        self.head = self.settings.head
        self.device = engine_device(ctx)
        #: each distinct prompt once per pack (``packing.SharedPrompts``, ``FSDPSettings.shares_prompts``)
        self.share_prompts = self.settings.shares_prompts()
        self.master_dtype = torch.float32
        torch.manual_seed(ctx.seed)  # before anything random (seeds CUDA too)
        self.model = _load_model(ctx, self.settings)
        #: a mixture-of-experts model's router losses, added to every update (``hybridrl_fsdp.moe``)
        self.router_loss = _router_loss(self.model, self.settings) if ctx.trainable else None
        #: the rollout's routing compared with (and replayed by) the routers (``hybridrl_fsdp.routing_replay``)
        self.routing_replay = (RoutingReplay(self.model) if self.head == "lm" and router_class(self.model) is not None
                               else None)
        #: liger-kernel's fused RMSNorm / SwiGLU / rotary forwards in the layers (``hybridrl_fsdp.layer_kernels``)
        self.fused_layers = (layer_kernels.install(self.model)
                             if layer_kernels.resolve(self.settings.fused_kernels, self.device) else None)
        if not ctx.trainable and self.device.type == "cuda" and ctx.torch_dtype != torch.float32:
            # a frozen role computes in the compute dtype anyway (mixed precision casts every gather to it):
            # keeping its shards in it gives the same numbers in half the memory
            for param in self.model.parameters():
                param.data = param.data.to(ctx.torch_dtype)
        self._supports_logits_to_keep = (self.head == "lm" and
                                         "logits_to_keep" in inspect.signature(type(self.model).forward).parameters)
        # The fused head needs the model to select the positions it runs on (``logits_to_keep`` as indices).
        self._log_prob_head = (install_log_prob_head(self.model) if self._supports_logits_to_keep
                               and self.settings.fused_lm_head else None)
        if self._log_prob_head is not None and ctx.trainable and self.settings.keeps_head_logits():
            self._log_prob_head.keep_logits(ctx.training.max_tokens_per_micro_batch)
        #: LoRA (``hybridrl_fsdp.lora``): the model becomes the peft model, frozen but for its adapters
        self.lora = _wrap_lora(self.model, ctx, self.device) if ctx.lora is not None else None
        if self.lora is not None:
            self.model = self.lora.model
        #: FSDP2 wraps the model only where it does something: several ranks to shard over, or a GPU's mixed
        #: precision. One CPU rank keeps the plain module (same fp32 numbers, without the per-layer gathers,
        #: gradient reduce-scatters and hooks that one rank pays for nothing).
        self.sharded = uses_fsdp(ctx.world_size, self.device)
        if self.sharded:
            self.mesh = init_device_mesh(self.device.type, (ctx.world_size,), mesh_dim_names=("dp",))
            _shard_model(self.model, self.mesh, _mixed_precision(ctx, self.device))
        else:
            _own_parameter_storage(self.model)
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        offload = self.settings.offload
        if ctx.trainable:
            self.optimizer = _build_optimizer(self.model, self.training, self.settings.optimizer_implementation)
            self.scheduler = _build_scheduler(self.optimizer, self.training.warmup_steps)
            # the moments exist from the start, so what a colocated rollout finds free when it sizes its KV
            # cache is what the trainer leaves it for the whole run (lazily they would appear at step 1)
            host_groups = _init_optimizer_state(self.optimizer, offload_groups=offload in ("optimizer", "all"))
        elif offload == "optimizer":
            raise ValueError(f"role '{ctx.role}' has no optimizer to offload: offload must be 'none' or 'all'")
        else:
            host_groups = None
        self.offload_policy = OffloadPolicy.build(offload, list(self.model.parameters()), self.optimizer,
                                                  optimizer_groups=host_groups)
        #: after which call the weights go back to the host under ``offload: all``: a frozen role's forward,
        #: the actor's weight export (it follows the update), a critic's update.
        self._release_after = ("forward" if not ctx.trainable else
                               "export" if role_spec(ctx.role).reshard == "send" else "update")
        self.offload_policy.release_weights()

    # --- forward ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def compute_log_probs(self, batch: Batch, with_entropy: bool = False) -> Batch:
        """Log-probs (and entropies) of the response tokens; 0 at padded response positions."""
        self._require_head("lm", "compute_log_probs")
        self.offload_policy.ensure_weights()
        temperature = sampling_temperature(batch)
        keys = [LOG_PROBS, ENTROPY] if with_entropy else [LOG_PROBS]
        if ROUTED_EXPERTS not in batch:
            return self._forward_rows(batch, keys, lambda micro: self._response_outputs(micro, temperature,
                                                                                        with_entropy))

        def routed(micro: MicroBatch) -> dict[str, torch.Tensor]:
            with self._routed(micro) as routing:
                outputs = self._response_outputs(micro, temperature, with_entropy)
            outputs[ROUTING_MISMATCH] = routing.to_rows(self._replay().mismatch.float())  # type: ignore[union-attr]
            return outputs

        return self._forward_rows(batch, [*keys, ROUTING_MISMATCH], routed)

    def _replay(self) -> RoutingReplay:
        if self.routing_replay is None:
            raise ValueError(f"the batch carries {ROUTED_EXPERTS}, but role '{self.ctx.role}' has no MoE router to "
                             "replay it (a dense model, or not the lm head)")
        return self.routing_replay

    @contextmanager
    def _routed(self, micro: MicroBatch) -> Iterator[TokenRouting]:
        """Inside: the routers compare the micro-batch's tokens with the rollout's experts and, with
        ``info['routing_replay']``, route by them (``hybridrl_fsdp.routing_replay``)."""
        replay = self._replay()
        layout = token_routing(micro.batch, micro.packed)
        with replay.routing(layout.experts.to(self.device), bool(micro.batch.info.get("routing_replay")),
                            layout.response):
            yield layout

    @torch.no_grad()
    def compute_greedy_margins(self, batch: Batch) -> Batch:
        """See ``TrainEngine.compute_greedy_margins`` (the trainer's sync check)."""
        self._require_head("lm", "compute_greedy_margins")
        self.offload_policy.ensure_weights()

        def margins(micro: MicroBatch) -> dict[str, torch.Tensor]:
            if micro.packed is not None:
                logits = self._packed_logits(micro.packed)
                return {GREEDY_MARGIN: micro.packed.scatter(greedy_margins(logits, micro.packed.labels))}
            logits, labels, mask = self._micro_response_logits(micro.batch)
            return {GREEDY_MARGIN: greedy_margins(logits, labels.masked_fill(~mask, 0)).masked_fill(~mask, 0.0)}

        return self._forward_rows(batch, [GREEDY_MARGIN], margins)

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> Batch:
        """Critic: ``values`` (B, R), the value of the state before each response token; 0 at padding."""
        self._require_head("value", "compute_values")
        self.offload_policy.ensure_weights()
        return self._forward_rows(batch, [VALUES], lambda micro: {VALUES: self._response_values(micro)})

    @torch.no_grad()
    def compute_scores(self, batch: Batch) -> Batch:
        """Reward model: ``scores`` (B,), each prompt+response scored at its last real token."""
        self._require_head("reward", "compute_scores")
        self.offload_policy.ensure_weights()
        self.model.eval()
        parts = []
        for micro in self._on_device(self._plan(batch)):
            if micro.packed is not None:
                p = micro.packed
                values = self.model(p.input_ids, None, p.position_ids, last_index=p.last_index,
                                    **p.attention_kwargs())
            else:
                values = self.model(*sequence_tensors(micro.batch))
            parts.append((micro.index, values.float().cpu()))
        self._after_forward()
        scores = torch.zeros(len(batch), dtype=torch.float32)
        for index, values in parts:
            scores[index] = values
        return Batch.from_tensors({SCORES: scores})

    def _forward_rows(self, batch: Batch, keys: list[str], forward) -> Batch:
        """Run ``forward(micro) -> {key: (b, w)}`` over the micro-batches and reassemble ``(B, R)`` tensors
        in the batch's row order."""
        self.model.eval()
        width = batch[RESPONSE_IDS].shape[1]
        parts: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = defaultdict(list)
        for micro in self._on_device(self._plan(batch)):
            for key, value in forward(micro).items():
                parts[key].append((micro.index, value.float()))
        parts = {key: [(index, value.cpu()) for index, value in values] for key, values in parts.items()}
        self._after_forward()
        return Batch.from_tensors({key: scatter_rows(parts[key], len(batch), width) for key in keys})

    def _on_device(self, plan: list[MicroBatch]) -> list[MicroBatch]:
        """Every micro-batch's tensors on the device before the loop over them starts (copies from host memory
        there would each wait for the device)."""
        return [micro.to(self.device) for micro in plan]

    def _after_forward(self) -> None:
        """Free what a forward-only pass leaves behind: the root module's gathered parameters (FSDP2 keeps the
        root unsharded after a forward, expecting a backward) and, for a frozen role with ``offload: all``, its
        weights."""
        if self.sharded:
            self.model.reshard()
        if self._release_after == "forward":
            self.offload_policy.release_weights()

    def _require_head(self, head: str, method: str) -> None:
        if self.head != head:
            raise RuntimeError(f"{method} needs the '{head}' head; role '{self.ctx.role}' has the '{self.head}' head")

    def _response_values(self, micro: MicroBatch) -> torch.Tensor:
        """Values at the positions before each response token (the state it is drawn in), (b, R) fp32."""
        if micro.packed is not None:
            p = micro.packed
            values = self.model(p.input_ids, None, p.position_ids, keep_index=p.predict_index,
                                **p.attention_kwargs())
            return p.scatter(values[0])
        input_ids, attention_mask, position_ids = sequence_tensors(micro.batch)
        mask = micro.batch[RESPONSE_MASK].bool()
        response_len = mask.shape[1]
        values = self.model(input_ids, attention_mask, position_ids, keep_last=response_len + 1)[:, :response_len]
        return values.masked_fill(~mask, 0.0)

    def _response_outputs(self, micro: MicroBatch, temperature: float | None, with_entropy: bool
                          ) -> dict[str, torch.Tensor]:
        """Forward one micro-batch; per-token ``log_probs`` (and ``entropy``) of its responses, (b, R) fp32."""
        if micro.packed is not None:
            return self._packed_response_outputs(micro.packed, temperature, with_entropy)
        if self._log_prob_head is not None:
            log_probs, entropy = self._fused_response_outputs(micro.batch, temperature, with_entropy)
        else:
            logits, labels, mask = self._micro_response_logits(micro.batch)
            log_probs, entropy = chunked_log_probs(logits, labels.masked_fill(~mask, 0), temperature, with_entropy)
        mask = micro.batch[RESPONSE_MASK].bool()
        outputs = {LOG_PROBS: log_probs.masked_fill(~mask, 0.0)}
        if entropy is not None:
            outputs[ENTROPY] = entropy.masked_fill(~mask, 0.0)
        return outputs

    def _packed_response_outputs(self, packed: PackedRows, temperature: float | None, with_entropy: bool
                                 ) -> dict[str, torch.Tensor]:
        """Log-probs (and entropies) of packed rows: the head runs only on the positions that predict a response
        token (fused with the log-prob when it can be), and the values go back to the rows' ``(b, R)``."""
        if self._log_prob_head is not None:
            with self._log_prob_head.computing(packed.labels.view(1, -1), temperature, with_entropy):
                out = self.model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False,
                                 logits_to_keep=packed.predict_index, **packed.attention_kwargs()).logits[0]
            log_probs, entropy = out[:, 0], (out[:, 1] if with_entropy else None)
        else:
            log_probs, entropy = chunked_log_probs(self._packed_logits(packed), packed.labels, temperature,
                                                   with_entropy)
        outputs = {LOG_PROBS: packed.scatter(log_probs)}
        if entropy is not None:
            outputs[ENTROPY] = packed.scatter(entropy)
        return outputs

    def _packed_logits(self, packed: PackedRows) -> torch.Tensor:
        """``(n, V)`` logits at the positions that predict the response tokens of packed rows (plain head)."""
        kwargs: dict[str, Any] = {"logits_to_keep": packed.predict_index} if self._supports_logits_to_keep else {}
        logits = self.model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False,
                            **packed.attention_kwargs(), **kwargs).logits[0]
        return logits if self._supports_logits_to_keep else logits[packed.predict_index]

    def _fused_response_outputs(self, micro: Batch, temperature: float | None, with_entropy: bool
                                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and entropies) through ``LogProbHead``: the head runs on the positions that predict the
        response, ``P-1 .. P+R-2``, and never makes their ``(b, R, V)`` logits at once."""
        input_ids, attention_mask, position_ids = sequence_tensors(micro)
        labels = micro[RESPONSE_IDS]
        mask = micro[RESPONSE_MASK].bool()
        response_len = labels.shape[1]
        prompt_len = input_ids.shape[1] - response_len
        if prompt_len < 1:
            raise ValueError("every batch needs at least one prompt column (the first response token's context)")
        keep = torch.arange(prompt_len - 1, prompt_len - 1 + response_len, device=input_ids.device)
        with self._log_prob_head.computing(labels.masked_fill(~mask, 0), temperature, with_entropy):
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             use_cache=False, logits_to_keep=keep).logits
        return out[..., 0], (out[..., 1] if with_entropy else None)

    def _micro_response_logits(self, micro: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(logits (b, R, V), response ids, response mask as bool)`` of one micro-batch, on its device."""
        input_ids, attention_mask, position_ids = sequence_tensors(micro)
        labels = micro[RESPONSE_IDS]
        mask = micro[RESPONSE_MASK].bool()
        return self._response_logits(input_ids, attention_mask, position_ids, labels.shape[1]), labels, mask

    def _response_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                         response_len: int) -> torch.Tensor:
        """Logits at positions ``P-1 .. P+R-2`` (those that predict the response), (b, R, V).

        ``logits_to_keep=R+1`` keeps the LM head off the prompt positions; the last kept position (which would
        predict a token after the response) is dropped."""
        prompt_len = input_ids.shape[1] - response_len
        if prompt_len < 1:
            raise ValueError("every batch needs at least one prompt column (the first response token's context)")
        kwargs: dict[str, Any] = {"logits_to_keep": response_len + 1} if self._supports_logits_to_keep else {}
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=False, **kwargs)
        logits = out.logits
        if self._supports_logits_to_keep:
            return logits[:, :response_len, :]
        return logits[:, prompt_len - 1: prompt_len - 1 + response_len, :]

    # --- training -----------------------------------------------------------------------------------------
    def update(self, batch: Batch, objective: Objective) -> dict[str, float]:
        """One AdamW step over the local batch (gradients accumulated over micro-batches, averaged over ranks)."""
        if self.optimizer is None:
            raise RuntimeError(f"role '{self.ctx.role}' is frozen (trainable=False): it cannot be updated")
        needs = tuple(objective.needs)
        provided = HEAD_OUTPUTS[self.head]
        unsupported = set(needs) - provided
        if unsupported:
            raise ValueError(f"FSDPEngine with the '{self.head}' head cannot compute {sorted(unsupported)}; "
                             f"it provides {sorted(provided) or 'nothing to train on'}")
        self.offload_policy.ensure_weights()
        plan = self._plan(batch, check_counts=False)
        scale = self._loss_scale(batch, len(plan))
        temperature = sampling_temperature(batch)
        lr = float(self.optimizer.param_groups[0]["lr"])

        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        metrics = WeightedMean()
        local_loss = torch.zeros((), dtype=torch.float32, device=self.device)  # summed on the device: no sync
        router = _RouterTotals(self.device)
        routed = ROUTED_EXPERTS in batch
        mismatch = torch.zeros(2, dtype=torch.float32, device=self.device)  # mismatched, compared tokens
        for micro in self._on_device(plan):  # the objective's tensors meet the outputs on one device
            # the routing stays given over the backward (gradient checkpointing runs the forward again there)
            with self._routed(micro) if routed else _nothing():
                with self.router_loss.recording() if self.router_loss is not None else _nothing():
                    if self.head == "value":
                        outputs = {VALUES: self._response_values(micro)}
                    else:
                        outputs = self._response_outputs(micro, temperature, with_entropy=ENTROPY in needs)
                if routed:
                    mismatch += self._replay().counts()
                loss, micro_metrics = objective({k: outputs[k] for k in needs}, micro.batch, scale)
                if self.router_loss is not None:
                    loss = loss + router.add(self.router_loss, micro, scale)
                loss.backward()
            local_loss += loss.detach().float()
            metrics.add(micro_metrics, len(micro.batch))

        if self._log_prob_head is not None:
            self._log_prob_head.release_kept_logits()
        grad_norm = self._clip_gradients()
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            if self.offload_policy.optimizer:
                step_group_by_group(self.optimizer, self.offload_policy.optimizer_groups)
            else:
                self.optimizer.step()
            self.scheduler.step()  # type: ignore[union-attr]
        # A skipped step leaves weights, AdamW moments and the lr schedule untouched (every rank sees the same
        # global norm, so every rank skips together).
        self.optimizer.zero_grad(set_to_none=True)
        (global_loss,) = all_reduce_sum([float(local_loss)], self.ctx.device)
        routing = {}
        if routed:
            differ, compared = all_reduce_sum([float(mismatch[0]), float(mismatch[1])], self.ctx.device)
            routing[ROUTING_MISMATCH_METRIC] = differ / max(compared, 1.0)
        if self._release_after == "update":
            self.offload_policy.release_weights()
        return {**metrics.result(), "loss": global_loss / self.ctx.world_size, "grad_norm": grad_norm, "lr": lr,
                "skipped_step": float(skipped), **router.result(self.router_loss, self.ctx.device), **routing}

    def _loss_scale(self, batch: Batch, n_micro: int) -> LossScale:
        """Global token/sequence counts (one all-reduce, which also checks the micro-batch counts agree)."""
        tokens = float(batch[RESPONSE_MASK].sum())
        total_tokens, total_sequences, n_sum, n_sq_sum = all_reduce_sum(
            [tokens, float(len(batch)), float(n_micro), float(n_micro * n_micro)], self.ctx.device)
        raise_if_counts_differ(n_sum, n_sq_sum, self.ctx.world_size)
        return LossScale(total_tokens=total_tokens, total_sequences=total_sequences, dp_size=self.ctx.world_size)

    def _clip_gradients(self) -> float:
        """Clip to ``grad_clip`` and return the global gradient norm (a collective over DTensor shards)."""
        clip = self.training.grad_clip
        max_norm = clip if clip is not None and clip > 0 else math.inf
        params = [p for p in self.model.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return float(norm)

    def _plan(self, batch: Batch, check_counts: bool = True) -> list[MicroBatch]:
        """Micro-batches by rows or by token budget (ranks agree on their number: a collective).
        ``check_counts`` raises when the ranks' counts differ (``update`` checks inside its own all-reduce)."""
        budget = self.training.max_tokens_per_micro_batch
        plan = plan_micro_batches(batch, self.training.micro_batch, budget,
                                  count_for_all_ranks=lambda n: _all_reduce_max(n, self.ctx.device),
                                  packed=self.settings.packing, share_prompts=self.share_prompts)
        if check_counts:
            check_same_count(len(plan), self.ctx.device)
        return plan

    # --- weights ------------------------------------------------------------------------------------------
    def export_weights(self, bucket_bytes: int) -> Iterator[WeightBucket]:
        """Full fp32 weights under HF names in buckets of about ``bucket_bytes`` (collective, lazy). MoE experts
        go under the checkpoint's per-expert names (``hybridrl.weights.experts``), as every engine loads them.

        A bucket closes once it holds ``bucket_bytes``; a tensor of at least ``bucket_bytes`` travels alone.
        Tensors stay on the engine's device (the bridge decides where they go)."""
        self.offload_policy.ensure_weights()
        return self._released_at_end(group_into_buckets(self._full_named_tensors(), bucket_bytes))

    def export_weights_transient(self, bucket_bytes: int) -> Iterator[WeightBucket]:
        """``export_weights`` for an importer that copies at once (colocated, same process): with one rank the
        live fp32 shards themselves (the importer's copy casts them), with several the all-gather runs in the
        compute dtype (half the bytes on the wire). No copy of the model is made."""
        self.offload_policy.ensure_weights()
        if self.ctx.world_size == 1:
            return self._released_at_end(group_into_buckets(self._local_named_tensors(), bucket_bytes))
        return self._released_at_end(group_into_buckets(self._gathered_named_tensors(), bucket_bytes))

    def _released_at_end(self, buckets: Iterator[WeightBucket]) -> Iterator[WeightBucket]:
        """``buckets``, and under ``offload: all`` the actor's weights back to the host once the export ran
        to its end (the sync is the last use of the weights in a step)."""
        try:
            yield from buckets
        finally:
            if self._release_after == "export":
                self.offload_policy.release_weights()

    def transient_export_holds_views(self) -> bool:
        """One rank: the transient export is the live shards themselves (see ``export_weights_transient``)."""
        return self.ctx.world_size == 1

    @torch.no_grad()
    def _local_named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """One rank: each parameter's local shard is the whole parameter; views of it, read afresh each call
        (an ``offload``/``onload`` or a load swaps the tensors)."""
        if self.lora is not None:  # the adapted layers merged into new tensors (in the base's dtype), views of the rest
            yield from self.lora.named_tensors(_local_view, dtype=self.lora.base_dtype)
            yield from ((self.lora.hf_name(n), b) for n, b in _persistent_buffers(self.model))
            return
        yield from to_checkpoint_layout(
            (name, (param.to_local() if isinstance(param, DTensor) else param).detach())
            for name, param in self.model.named_parameters())
        yield from _persistent_buffers(self.model)

    @torch.no_grad()
    def _gathered_named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        wire_dtype = self.ctx.torch_dtype if self.device.type == "cuda" else self.master_dtype
        if self.lora is not None:
            yield from self.lora.named_tensors(lambda p: _gathered(p, wire_dtype), dtype=wire_dtype)
            yield from ((self.lora.hf_name(n), b) for n, b in _persistent_buffers(self.model))
            return
        yield from to_checkpoint_layout(
            (name, param.detach().to(wire_dtype).full_tensor() if isinstance(param, DTensor) else param.detach())
            for name, param in self.model.named_parameters())
        yield from _persistent_buffers(self.model)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full weights on CPU, keyed like ``export_weights`` (a tied ``lm_head.weight`` appears once, as
        ``model.embed_tokens.weight``). Collective."""
        self.offload_policy.ensure_weights()
        return {name: tensor.cpu() for name, tensor in self._full_named_tensors()}

    @torch.no_grad()
    def _full_named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Unsharded copies of the parameters (``named_parameters`` drops tied duplicates) and persistent
        buffers. Copies, never views: a consumer must not see later optimiser steps through them. With LoRA,
        the policy: the adapters merged into the base."""
        if self.lora is not None:
            yield from self.lora.named_tensors(lambda p: _full_copy(p, self.master_dtype))
            for name, buffer in _persistent_buffers(self.model):
                yield self.lora.hf_name(name), _full_copy(buffer, buffer.dtype)
            return
        yield from to_checkpoint_layout((name, _full_copy(param, self.master_dtype))
                                        for name, param in self.model.named_parameters())
        for name, buffer in _persistent_buffers(self.model):
            yield name, _full_copy(buffer, buffer.dtype)

    def export_adapter(self, bucket_bytes: int) -> Iterator[WeightBucket]:
        """See ``TrainEngine.export_adapter``: with one rank views of the live fp32 adapters, with several their
        all-gather; in the compute dtype on a GPU (the engine serving them computes in it), fp32 elsewhere."""
        if self.lora is None:
            return super().export_adapter(bucket_bytes)
        dtype = self.ctx.torch_dtype if self.device.type == "cuda" else self.master_dtype
        read = _local_view if self.ctx.world_size == 1 else (lambda p: _gathered(p, dtype))
        return group_into_buckets(((n, t.to(dtype)) for n, t in self.lora.adapter_tensors(read)), bucket_bytes)

    def reference_view(self, ctx: EngineContext) -> TrainEngine:
        """See ``TrainEngine.reference_view`` (``hybridrl_fsdp.lora_reference``)."""
        if self.lora is None:
            return super().reference_view(ctx)
        from hybridrl_fsdp.lora_reference import LoraReference

        return LoraReference(self, ctx)

    # --- checkpoints --------------------------------------------------------------------------------------
    def save_checkpoint(self, path: str) -> None:
        """Sharded model + AdamW state through torch.distributed.checkpoint (each rank writes its own shards,
        so no rank gathers the full model), plus per-rank ``engine_rank<r>.pt`` with the lr schedule and
        this rank's RNG states. Reload with any world size DCP can reshard to. Collective."""
        import torch.distributed.checkpoint as dcp

        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        with self._state_on_device():
            dcp.save(self._dcp_state(), checkpoint_id=str(out / DCP_DIR))
        extra = {"scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                 "rng": _rng_state(), "trainable": self.optimizer is not None}
        torch.save(extra, out / _rank_file(self.ctx.rank))
        dist.barrier()

    def _dcp_state(self) -> dict[str, Any]:
        """The sharded state DCP saves into and loads from: the model, and AdamW's state when trainable."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if self.optimizer is None:
            model_sd = get_model_state_dict(self.model)
            return {"model": model_sd if self.lora is None else self.lora.trainable_state(model_sd)}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        if self.lora is not None:  # the adapters and their AdamW state: the base is model.path
            model_sd = self.lora.trainable_state(model_sd)
        return {"model": model_sd, "optim": optim_sd}

    def load_checkpoint(self, path: str) -> None:
        """Restore what ``save_checkpoint`` wrote into this (already built) engine. Collective."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

        from hybridrl.run.trusted_files import UntrustedFileError, load_plain, metadata_problem, refusal

        src = Path(path)
        if not (src / DCP_DIR).is_dir():
            raise FileNotFoundError(f"no FSDP checkpoint in '{src}' (missing {DCP_DIR}/)")
        index = src / DCP_DIR / ".metadata"  # DCP unpickles it: checked first, as plain data only
        problem = metadata_problem(index) if index.is_file() else None
        if problem:
            raise UntrustedFileError(refusal(index, problem))
        with self._state_on_device():
            state = self._dcp_state()
            dcp.load(state, checkpoint_id=str(src / DCP_DIR))
            # a LoRA checkpoint holds the adapters alone: the base keeps what it loaded from model.path
            options = None if self.lora is None else StateDictOptions(strict=False)
            if self.optimizer is not None:
                set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                               optim_state_dict=state["optim"], options=options)
            else:
                set_model_state_dict(self.model, state["model"], options=options)
            del state
            # loading replaces AdamW's state tensors: the host copies must follow the new ones
            self.offload_policy = OffloadPolicy.build(self.settings.offload, list(self.model.parameters()),
                                                      self.optimizer)
        rank_file = src / _rank_file(self.ctx.rank)
        if rank_file.is_file():  # absent when resuming on more ranks than were saved: keep the fresh RNG
            extra = load_plain(rank_file)  # tensors and plain data only: a forged file runs nothing
            if self.scheduler is not None and extra.get("scheduler") is not None:
                self.scheduler.load_state_dict(extra["scheduler"])
            _set_rng_state(extra["rng"])
        dist.barrier()

    # --- memory -------------------------------------------------------------------------------------------
    @contextmanager
    def _state_on_device(self) -> Iterator[None]:
        """Everything ``offload`` keeps on the host brought back for the block (checkpoints read and write the
        live tensors), and put back after it."""
        self.offload_policy.ensure_weights()
        self.offload_policy.ensure_optimizer()
        try:
            yield
        finally:
            if self.offload_policy.optimizer:
                self.offload_policy.release_optimizer()
            self.offload_policy.release_weights()

    def offload(self) -> None:
        """Move parameter shards, gradients and AdamW state to host memory (CUDA only).

        On CPU there is no device memory to release: the weights already live in host memory, so moving them
        would only copy them; it is a no-op."""
        if self.device.type != "cuda":
            return
        self.offload_policy.ensure_weights()  # the whole-engine move below takes over from options.offload
        self.offload_policy.ensure_optimizer()
        self.offload_policy = OffloadPolicy("none")
        self.model.to("cpu")  # FSDP2 reshards first and swaps the DTensor shards in place (params keep identity)
        _move_optimizer_state(self.optimizer, torch.device("cpu"))
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    def onload(self) -> None:
        """Undo ``offload`` (a no-op on CPU, see there)."""
        if self.device.type != "cuda":
            return
        self.model.to(self.device)
        _move_optimizer_state(self.optimizer, self.device)
        torch.cuda.synchronize()


# --- construction helpers ---------------------------------------------------------------------------------
def _load_model(ctx: EngineContext, settings: FSDPSettings) -> nn.Module:
    """fp32 master weights on CPU (``fully_shard`` moves each rank's shard to the mesh device)."""
    from transformers import AutoModelForCausalLM  # heavy import: only when an engine is built

    from hybridrl_fsdp.value_model import SequenceScorer, ValueModel

    kwargs: dict[str, Any] = {"dtype": torch.float32}
    if settings.attn_implementation:
        kwargs["attn_implementation"] = settings.attn_implementation
    elif settings.packing:  # the rows' boundaries reach our varlen attention through the forward's keywords
        varlen_attention.register()
        kwargs["attn_implementation"] = varlen_attention.implementation_name(settings.packed_attention)
    if settings.head == "value":
        model = ValueModel.from_pretrained(ctx.model_path, **kwargs)
    elif settings.head == "reward":
        model = SequenceScorer.from_pretrained(ctx.model_path, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(ctx.model_path, **kwargs)
    model.config.use_cache = False
    if not ctx.trainable:
        model.requires_grad_(False)
        model.eval()
    elif settings.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _router_loss(model: nn.Module, settings: FSDPSettings) -> RouterLoss | None:
    """The router losses of an MoE model (None for a dense one), weighted by the options or, where they are
    unset, by the model config's ``router_aux_loss_coef`` / ``router_z_loss_coef``."""
    if router_class(model) is None:
        if settings.moe_aux_loss_coef is not None or settings.moe_z_loss_coef is not None:
            raise ValueError("options.moe_aux_loss_coef / moe_z_loss_coef: the model has no experts (not a "
                             "mixture-of-experts model)")
        return None
    config = hf_config(model)
    aux = settings.moe_aux_loss_coef
    z = settings.moe_z_loss_coef
    return RouterLoss(model, float(aux if aux is not None else getattr(config, "router_aux_loss_coef", 0.0) or 0.0),
                      float(z if z is not None else getattr(config, "router_z_loss_coef", 0.0) or 0.0))


class _RouterTotals:
    """The router losses of an update's micro-batches, summed with each micro-batch's share (its real tokens
    over the global ones, as the objective's ``LossScale`` shares its loss), for the loss and the metrics."""

    def __init__(self, device: torch.device) -> None:
        self.aux = torch.zeros((), dtype=torch.float32, device=device)
        self.z = torch.zeros((), dtype=torch.float32, device=device)
        self.tokens = 0.0

    def add(self, router: RouterLoss, micro: MicroBatch, scale: LossScale) -> torch.Tensor:
        mask = None if micro.packed is not None else sequence_tensors(micro.batch)[1]
        losses = router.losses(mask)
        self.aux += losses.aux.detach() * losses.tokens
        if losses.z is not None:
            self.z += losses.z.detach() * losses.tokens
        self.tokens += losses.tokens
        share = float(micro.batch[RESPONSE_MASK].sum()) / max(scale.total_tokens, 1.0) * scale.dp_size
        return router.weighted(losses) * share

    def result(self, router: RouterLoss | None, device: str) -> dict[str, float]:
        """``moe/aux_loss`` (and ``moe/z_loss``): token-weighted means over every rank (a collective when the
        model has experts; nothing otherwise)."""
        if router is None:
            return {}
        aux, z, tokens = all_reduce_sum([float(self.aux), float(self.z), self.tokens], device)
        out = {AUX_LOSS: aux / max(tokens, 1.0)}
        if router.z_coef:
            out[Z_LOSS] = z / max(tokens, 1.0)
        return out


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layer list (``model.layers`` of a causal LM, ``backbone.layers`` of a value model ...)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.split(".")[-1] == "layers":
            return module
    raise TypeError(f"{type(model).__name__} has no 'layers' list of decoder layers to shard")


def uses_fsdp(world_size: int, device: torch.device) -> bool:
    """Whether the engine wraps its model with FSDP2: on more than one rank, or on CUDA (its mixed precision
    policy is how the forward/backward run in the compute dtype). A single CPU rank computes in fp32 on its
    whole model: FSDP2 would only add a copy of every layer's weights per forward and of its gradients per
    backward, and hooks around each."""
    return world_size > 1 or device.type == "cuda"


def _own_parameter_storage(model: nn.Module) -> None:
    """Every parameter in memory of its own, as FSDP2's sharding would leave it: weights loaded from a checkpoint
    can be views of the memory-mapped file, whose storage the offload policy cannot resize."""
    with torch.no_grad():
        for param in model.parameters():
            if not param.untyped_storage().resizable():
                param.data = param.data.clone()


def _mixed_precision(ctx: EngineContext, device: torch.device) -> MixedPrecisionPolicy | None:
    """bf16/fp16 compute with fp32 gradient reduction on CUDA; CPU runs plain fp32 (no fast low precision)."""
    if device.type != "cuda":
        return None
    return MixedPrecisionPolicy(param_dtype=ctx.torch_dtype, reduce_dtype=torch.float32)


def _shard_model(model: nn.Module, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy | None) -> None:
    """One FSDP unit per decoder layer (gathered one at a time), then the root (embeddings, norm, head)."""
    kwargs: dict[str, Any] = {"mesh": mesh}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    for layer in _decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)


def _build_optimizer(model: nn.Module, training: TrainingOptions, implementation: str = "auto"
                     ) -> torch.optim.Optimizer:
    """AdamW over param groups of at most ``OPTIMIZER_GROUP_BYTES`` of fp32 parameters each (one group for a
    model under that size): foreach's temporaries (a copy of a group's second moments) stay within a group,
    and an offloaded optimizer streams through the device a group at a time. The update of a parameter
    reads only that parameter's state, so the grouping changes no number."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups: list[list[nn.Parameter]] = [[]]
    size = 0
    for p in params:
        nbytes = _local_numel(p) * 4
        if groups[-1] and size + nbytes > OPTIMIZER_GROUP_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += nbytes
    return torch.optim.AdamW([{"params": g} for g in groups if g], lr=training.lr, betas=training.betas,
                             weight_decay=training.weight_decay, fused=fused_adamw(params, implementation),
                             foreach=True if implementation == "foreach" else None)


def fused_adamw(params: list[nn.Parameter], implementation: str = "auto") -> bool | None:
    """Whether AdamW runs its fused kernel: one pass over each tensor instead of a dozen ops per parameter
    (``foreach`` on CUDA, dispatched from Python on the CPU). ``auto``: where every parameter lives on one CPU or
    CUDA device, torch's default (None) elsewhere; ``foreach``: never."""
    if implementation == "foreach":
        return False
    if not params:
        return None
    devices = {p.device for p in params}
    on_one = len(devices) == 1 and next(iter(devices)).type in ("cpu", "cuda")
    if implementation == "fused" and not on_one:
        raise ValueError(f"optimizer_implementation: fused needs every parameter on one CPU or CUDA device, "
                         f"they are on {sorted(str(d) for d in devices)}")
    return True if on_one else None


def _local_numel(param: torch.Tensor) -> int:
    local = getattr(param, "_local_tensor", None)
    return int(local.numel()) if isinstance(local, torch.Tensor) else int(param.numel())


def _init_optimizer_state(optimizer: torch.optim.Optimizer, offload_groups: bool) -> list[HostCopy] | None:
    """AdamW's per-parameter state as its first step would create it (a ``step`` of 0, on the parameter's device
    for the fused kernel and on the CPU otherwise, zero moments shaped like the parameter), created now; with
    ``offload_groups`` each group's moments go to the host as soon as they exist, so the device never holds more
    than one group's."""
    from torch.optim.optimizer import _get_scalar_dtype

    copies: list[HostCopy] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if state:
                continue
            fused = bool(group.get("fused"))
            state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype(is_fused=fused),
                                         device=p.device if fused else "cpu")
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if offload_groups:
            copies.append(HostCopy(optimizer_state_tensors(optimizer, group)))
            copies[-1].offload()
    return copies if offload_groups else None


def _build_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup: optimiser step k (0-based) uses ``lr * min(1, (k+1)/warmup_steps)``, so the first
    step already moves the weights (unlike schedules that start at 0)."""
    def factor(step: int) -> float:
        return 1.0 if warmup_steps <= 0 else min(1.0, (step + 1) / warmup_steps)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# --- small helpers ----------------------------------------------------------------------------------------
def _all_reduce_max(value: int, device: str) -> int:
    """The largest ``value`` over the ranks (identity without a process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _wrap_lora(model: nn.Module, ctx: EngineContext, device: torch.device) -> Adapters:
    """peft's LoRA around ``model`` (before sharding); on a GPU the frozen base in the compute dtype."""
    base_dtype = ctx.torch_dtype if device.type == "cuda" and ctx.torch_dtype != torch.float32 else None
    return Adapters(model, ctx.lora, base_dtype=base_dtype)


def _local_view(param: torch.Tensor) -> torch.Tensor:
    """One rank: the whole parameter, a view of its local shard."""
    return (param.to_local() if isinstance(param, DTensor) else param).detach()


def _gathered(param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The whole parameter gathered over the ranks in ``dtype`` (a new tensor)."""
    return param.detach().to(dtype).full_tensor() if isinstance(param, DTensor) else param.detach()


def _full_copy(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The unsharded value of a (possibly DTensor) tensor, in ``dtype``, never sharing memory with it."""
    if isinstance(tensor, DTensor):
        local = tensor.to_local()
        full = tensor.full_tensor()
        if full.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():  # one rank: may alias
            full = full.clone()
        return full.detach().to(dtype)
    return tensor.detach().to(dtype, copy=True)


def _persistent_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Buffers saved in ``state_dict`` (non-persistent ones, such as rotary ``inv_freq``, are rebuilt by the
    model and are not sent)."""
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is None or name in module._non_persistent_buffers_set or id(buffer) in seen:
                continue
            seen.add(id(buffer))
            yield (f"{module_name}.{name}" if module_name else name), buffer


def _rank_file(rank: int) -> str:
    return f"engine_rank{rank}.pt"


def _rng_state() -> dict[str, Any]:
    """This process's torch RNG states (CPU, and CUDA when present)."""
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _move_optimizer_state(optimizer: torch.optim.Optimizer | None, device: torch.device) -> None:
    if optimizer is None:
        return
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":  # AdamW keeps ``step`` on CPU
                state[key] = value.to(device, non_blocking=True)
