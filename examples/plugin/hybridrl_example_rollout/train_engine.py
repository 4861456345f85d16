"""``ExampleTrainer``: a train engine in plain PyTorch, one rank, written from ``docs/plugins.md`` alone.

A transformers causal LM with fp32 weights, AdamW and a linear warmup, micro-batched forward/backward. It does
on one rank what the built-in FSDP engine does on many, and passes the same conformance kit. It is registered
with ``max_ranks=1``: a pool of two or more devices for it is refused before any work starts.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from hybridrl.engines import EngineContext, LossScale, Objective, TrainEngine, WeightBucket
from hybridrl.engines.batch import ENTROPY, LOG_PROBS, RESPONSE_IDS, RESPONSE_MASK, Batch, sequence_tensors
from hybridrl.weights.buckets import group_into_buckets

STATE_FILE = "example_trainer.pt"


class ExampleTrainer(TrainEngine):
    """Actor or reference policy (``ctx.trainable=False``: no optimiser) on one device."""

    def __init__(self, ctx: EngineContext) -> None:
        super().__init__(ctx)
        from transformers import AutoModelForCausalLM  # heavy: only in the worker that builds the engine

        if ctx.world_size != 1:
            raise ValueError(f"roles.{ctx.role}: the example trainer runs on one rank, got {ctx.world_size}")
        training = ctx.training  # lr, betas, weight_decay, grad_clip, warmup_steps, micro_batch: checked already
        if training.max_tokens_per_micro_batch is not None:
            raise ValueError(f"roles.{ctx.role}.max_tokens_per_micro_batch: the example trainer splits by rows "
                             f"(micro_batch) only")
        self.micro_batch = training.micro_batch
        self.grad_clip = training.grad_clip if training.grad_clip and training.grad_clip > 0 else math.inf
        self.device = torch.device(ctx.device)
        torch.manual_seed(ctx.seed)
        self.model = AutoModelForCausalLM.from_pretrained(ctx.model_path, dtype=torch.float32).to(self.device)
        self.model.requires_grad_(ctx.trainable)
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        if ctx.trainable:
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=training.lr, betas=training.betas,
                                               weight_decay=training.weight_decay)
            warmup = training.warmup_steps
            # optimiser step k (from 0) runs at lr * min(1, (k+1)/warmup): the first step already moves
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer, lambda k: 1.0 if warmup <= 0 else min(1.0, (k + 1) / warmup))

    # --- forward ------------------------------------------------------------------------------------------
    def _response_logits(self, micro: Batch, temperature: float | None) -> torch.Tensor:
        """Logits ``(b, R, V)`` that predict each response token: positions ``P-1 .. P+R-2``."""
        input_ids, attention_mask, position_ids = (t.to(self.device) for t in sequence_tensors(micro))
        width = micro[RESPONSE_IDS].shape[1]
        prompt_len = input_ids.shape[1] - width
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False).logits[:, prompt_len - 1: prompt_len - 1 + width].float()
        return logits / temperature if temperature else logits

    def _outputs(self, micro: Batch, temperature: float | None, with_entropy: bool) -> dict[str, torch.Tensor]:
        logits = self._response_logits(micro, temperature)
        mask = micro[RESPONSE_MASK].to(self.device).bool()
        labels = micro[RESPONSE_IDS].to(self.device).masked_fill(~mask, 0)
        log_softmax = torch.log_softmax(logits, dim=-1)
        out = {LOG_PROBS: log_softmax.gather(-1, labels.unsqueeze(-1)).squeeze(-1).masked_fill(~mask, 0.0)}
        if with_entropy:
            out[ENTROPY] = -(log_softmax.exp() * log_softmax).sum(-1).masked_fill(~mask, 0.0)
        return out

    def _micro_batches(self, batch: Batch) -> list[Batch]:
        return [batch.index(range(i, min(i + self.micro_batch, len(batch))))
                for i in range(0, len(batch), self.micro_batch)]

    @torch.no_grad()
    def compute_log_probs(self, batch: Batch, with_entropy: bool = False) -> Batch:
        """A new Batch of ``log_probs`` (and ``entropy``): float32 on CPU, ``(B, R)``, 0 at padding."""
        self.model.eval()
        temperature = batch.info.get("temperature")
        parts = [self._outputs(m, temperature, with_entropy) for m in self._micro_batches(batch)]
        return Batch.from_tensors({k: torch.cat([p[k] for p in parts]).cpu() for k in parts[0]})

    # --- training -----------------------------------------------------------------------------------------
    def update(self, batch: Batch, objective: Objective) -> dict[str, float]:
        """One AdamW step over ``batch``; gradients summed over the micro-batches, zeroed before and after."""
        if self.optimizer is None or self.scheduler is None:
            raise RuntimeError(f"role '{self.ctx.role}' is frozen (trainable=False): it cannot be updated")
        scale = LossScale(total_tokens=float(batch[RESPONSE_MASK].sum()), total_sequences=float(len(batch)),
                          dp_size=1)  # one rank: the batch is the whole mini-batch
        lr = float(self.optimizer.param_groups[0]["lr"])
        temperature = batch.info.get("temperature")
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, sums, rows = 0.0, {}, 0
        for micro in self._micro_batches(batch):
            micro = micro.to(self.device)
            outputs = self._outputs(micro, temperature, ENTROPY in objective.needs)
            loss, metrics = objective({k: outputs[k] for k in objective.needs}, micro, scale)
            loss.backward()
            loss_sum += float(loss.detach())
            for key, value in metrics.items():  # the objective's metrics, weighted by micro-batch size
                sums[key] = sums.get(key, 0.0) + float(value) * len(micro)
            rows += len(micro)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip))
        skipped = not math.isfinite(grad_norm)
        if not skipped:  # a non-finite step leaves weights, AdamW moments and the schedule as they were
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {**{k: v / rows for k, v in sums.items()}, "loss": loss_sum, "grad_norm": grad_norm, "lr": lr,
                "skipped_step": float(skipped)}

    # --- weights ------------------------------------------------------------------------------------------
    def export_weights(self, bucket_bytes: int) -> Iterator[WeightBucket]:
        """fp32 copies under the HF names (a tied head once, as ``named_parameters`` gives it), then the
        persistent buffers; copies, so that a later step never shows through them."""
        return group_into_buckets(self._named_tensors(), bucket_bytes)

    def _named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self.model.named_parameters():
            yield name, param.detach().clone()
        persistent = self.model.state_dict().keys()
        for name, buffer in self.model.named_buffers():
            if name in persistent:
                yield name, buffer.detach().clone()

    def offload(self) -> None:
        """On CUDA, weights and AdamW state to host memory (on CPU they already are: nothing to do)."""
        self._move(torch.device("cpu"))

    def onload(self) -> None:
        self._move(self.device)

    def _move(self, device: torch.device) -> None:
        if self.device.type != "cuda":
            return
        self.model.to(device)
        for state in (self.optimizer.state.values() if self.optimizer is not None else ()):
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and key != "step":
                    state[key] = value.to(device)

    # --- checkpoints --------------------------------------------------------------------------------------
    def save_checkpoint(self, path: str) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        state: dict[str, Any] = {"model": self.model.state_dict(), "rng": torch.get_rng_state()}
        if self.optimizer is not None and self.scheduler is not None:
            state.update(optimizer=self.optimizer.state_dict(), scheduler=self.scheduler.state_dict())
        torch.save(state, Path(path) / STATE_FILE)

    def load_checkpoint(self, path: str) -> None:
        file = Path(path) / STATE_FILE
        if not file.is_file():
            raise FileNotFoundError(f"no example-trainer checkpoint in '{path}' (missing {STATE_FILE})")
        state = torch.load(file, map_location=self.device, weights_only=False)
        self.model.load_state_dict(state["model"])
        if self.optimizer is not None and self.scheduler is not None and "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"].cpu())
