"""Optimiser steps for the Megatron model: PyTorch AdamW on CPU, Megatron's DDP + optimiser on CUDA.

Megatron's optimiser wrappers check for ``torch.cuda.*Tensor`` parameters and cannot run on a CPU build,
so on CPU ``TorchStepper`` does by hand what Megatron's DDP + ``finalize_model_grads`` + optimiser do:
sum the tied embedding's gradient over the first and last pipeline stage, average gradients over the
data-parallel group, take the global norm over the model-parallel group (each parameter counted once:
tensor-parallel duplicates only on tensor rank 0, the tied copy only on the first stage), clip, and step
AdamW over the local shards. ``MegatronStepper`` wraps the model in Megatron's
``DistributedDataParallel`` and steps ``get_megatron_optimizer`` (fp32 master weights for bf16 models).

Both skip a step whose gradient norm is not finite (every rank sees the same norm, so all skip together),
leaving weights, moments and the warmup schedule untouched.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hybridrl.engines import TrainingOptions
from hybridrl_megatron.convert import expert_of
from hybridrl_megatron.model import ParamEntry
from hybridrl_megatron.parallel import Layout


def warmup_factor(step: int, warmup_steps: int) -> float:
    """Linear warmup as in the FSDP engine: optimiser step k (0-based) uses ``lr * min(1, (k+1)/warmup)``."""
    return 1.0 if warmup_steps <= 0 else min(1.0, (step + 1) / warmup_steps)


class TorchStepper:
    """CPU path (see the module docstring)."""

    def __init__(self, model: nn.Module, table: list[ParamEntry], layout: Layout, settings: TrainingOptions,
                 tied_embeddings: bool) -> None:
        self.model = model
        self.layout = layout
        self.tied_embeddings = tied_embeddings
        self.settings = settings
        self.entries = [e for e in table if e.param.requires_grad]
        self.params = [e.param for e in self.entries]
        self.optimizer = torch.optim.AdamW(self.params, lr=settings.lr, betas=settings.betas,
                                           weight_decay=settings.weight_decay)
        self.steps_taken = 0

    @property
    def module(self) -> nn.Module:
        """What the schedules run (the bare model: gradients land in ``param.grad``)."""
        return self.model

    def configure(self, config: Any) -> None:
        """Nothing to hook into the schedules on CPU."""

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def lr(self) -> float:
        return self.settings.lr * warmup_factor(self.steps_taken, self.settings.warmup_steps)

    @torch.no_grad()
    def step(self) -> tuple[float, bool]:
        """Reduce, clip and step; returns (global gradient norm, skipped)."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self._sync_tied_embedding()
        self._average_over_data_parallel()
        norm = self._global_norm()
        if not math.isfinite(norm):
            self.zero_grad()
            return norm, True
        clip = self.settings.grad_clip
        if clip is not None and clip > 0:
            coef = clip / (norm + 1e-6)
            if coef < 1.0:
                torch._foreach_mul_([p.grad for p in self.params], coef)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr()
        self.optimizer.step()
        self.steps_taken += 1
        self.zero_grad()
        return norm, False

    def _sync_tied_embedding(self) -> None:
        """Stage 0's embedding and the last stage's output layer are one tied weight: sum their gradients."""
        if not self.tied_embeddings or self.layout.embedding_group is None:
            return
        for e in self.entries:
            if e.name == "embedding.word_embeddings.weight":
                dist.all_reduce(e.param.grad, group=self.layout.embedding_group)

    def _average_over_data_parallel(self) -> None:
        """Shared parameters: the mean over the data-parallel group. Experts (expert parallelism): a rank's
        experts already hold the gradients of every token its expert-parallel group routed to them, so they are
        summed over the ranks holding the same experts and divided by the whole data-parallel size (what
        Megatron's DDP does)."""
        if self.layout.dp == 1:
            return
        experts = [p.grad for e, p in zip(self.entries, self.params) if expert_of(e.name) is not None]
        shared = [p.grad for e, p in zip(self.entries, self.params) if expert_of(e.name) is None]
        for grads, group in ((shared, self.layout.dp_group), (experts, self.layout.expert_dp_group)):
            if not grads:
                continue
            flat = torch.cat([g.reshape(-1) for g in grads])
            if group is not self.layout.expert_dp_group or self.layout.expert_dp > 1:
                dist.all_reduce(flat, group=group)
            flat /= self.layout.dp
            offset = 0
            for g in grads:
                g.copy_(flat[offset: offset + g.numel()].view_as(g))
                offset += g.numel()

    def _global_norm(self) -> float:
        sq = torch.zeros((), dtype=torch.float64)
        expert_sq = torch.zeros((), dtype=torch.float64)
        for e in self.entries:
            duplicate = not getattr(e.param, "tensor_model_parallel", False) and self.layout.tp_rank != 0
            if duplicate or e.tied_copy:
                continue
            if expert_of(e.name) is not None:
                expert_sq += e.param.grad.double().pow(2).sum()
            else:
                sq += e.param.grad.double().pow(2).sum()
        if self.layout.ep > 1:  # each expert-parallel rank holds other experts
            dist.all_reduce(expert_sq, group=self.layout.ep_group)
        sq += expert_sq
        if self.layout.tp * self.layout.pp > 1:
            dist.all_reduce(sq, group=self.layout.mp_group)
        return float(sq.sqrt())

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "steps_taken": self.steps_taken}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps_taken = int(state["steps_taken"])

    def offload(self) -> None:
        """Host memory is where the CPU path lives already."""

    def onload(self) -> None:
        """See ``offload``."""


class MegatronStepper:
    """CUDA path: Megatron's ``DistributedDataParallel`` (fp32 gradient buffers, averaged over the data
    parallel group) and ``get_megatron_optimizer`` (Adam; fp32 master weights when the model is bf16/fp16)."""

    def __init__(self, model: nn.Module, config: Any, layout: Layout, settings: TrainingOptions) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.settings = settings
        self.layout = layout
        self.ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
        clip = settings.grad_clip if settings.grad_clip is not None and settings.grad_clip > 0 else 0.0
        opt_config = OptimizerConfig(optimizer="adam", lr=settings.lr, weight_decay=settings.weight_decay,
                                     adam_beta1=settings.betas[0], adam_beta2=settings.betas[1],
                                     bf16=config.bf16, fp16=config.fp16, params_dtype=config.params_dtype,
                                     clip_grad=clip, use_distributed_optimizer=False)
        # The non-distributed optimiser needs no gloo side groups (those serve the distributed one's checkpoints).
        self.optimizer = get_megatron_optimizer(opt_config, [self.ddp], use_gloo_process_groups=False)
        self.steps_taken = 0

    @property
    def module(self) -> nn.Module:
        return self.ddp

    def configure(self, config: Any) -> None:
        """Let the schedules defer the gradient all-reduce to the last micro-batch and finalise it."""
        from megatron.core.distributed import finalize_model_grads

        config.no_sync_func = self.ddp.no_sync
        config.finalize_model_grads_func = finalize_model_grads

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    def lr(self) -> float:
        return self.settings.lr * warmup_factor(self.steps_taken, self.settings.warmup_steps)

    @torch.no_grad()
    def step(self) -> tuple[float, bool]:
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr()
        found_inf = self.optimizer.prepare_grads()
        norm = float(self.optimizer.get_grad_norm()) if not found_inf else math.inf
        if not math.isfinite(norm):
            self.zero_grad()
            return norm, True
        clip = self.settings.grad_clip
        if clip is not None and clip > 0:
            self.optimizer.clip_grad_norm(clip)
        self.optimizer.step_with_ready_grads()
        self.steps_taken += 1
        self.zero_grad()
        return norm, False

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "steps_taken": self.steps_taken}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps_taken = int(state["steps_taken"])

    def offload(self) -> None:
        """Parameters, gradient buffers and optimiser state (master weights, moments) to host memory."""
        for p in self.ddp.module.parameters():
            p.data = p.data.cpu()
        self.ddp.offload_grad_buffers()
        self.optimizer.offload_to_cpu()
        torch.cuda.empty_cache()

    def onload(self) -> None:
        device = torch.device("cuda", torch.cuda.current_device())
        for p in self.ddp.module.parameters():
            p.data = p.data.to(device, non_blocking=True)
        self.ddp.restore_grad_buffers()
        self.optimizer.restore_from_cpu()
        torch.cuda.synchronize()
