"""``MegatronEngine``: a Llama/Qwen2 policy (or critic) on megatron-core with tensor, pipeline and data parallelism.

The hosting worker owns the default ``torch.distributed`` group (gloo on CPU, NCCL on GPU); the engine builds
Megatron's ``parallel_state`` on top of it (``tensor_parallel`` x ``pipeline_parallel`` from the role options,
data parallel = world / tp / pp) and a ``GPTModel`` stage (local layer spec without Transformer Engine) filled
from the HF checkpoint (``convert``). Forward and backward passes go through Megatron's schedules
(``get_forward_backward_func``: plain micro-batching, or 1F1B with pipeline parallelism). Log-probs are taken
with the vocabulary split over the tensor-parallel ranks (``logprobs``). Weights leave as full HF-named tensors
(``weights``), so the engine pairs with every rollout backend through the general bridges. The critic role
(``head="value"``) swaps the last stage's output layer for a scalar value head (``model.ValueHead``).

On CPU the engine runs inside ``cpu_compat.cpu_megatron()`` and steps PyTorch AdamW (``optim.TorchStepper``);
on CUDA it uses bf16/fp16 parameters, Megatron's DDP and optimiser (``optim.MegatronStepper``).

Every public method except ``offload``/``onload`` is collective over all ranks of the pool. Ranks of one
data-parallel group (tensor and pipeline peers) receive the same batch; only tensor rank 0 of the last
pipeline stage returns results (``data_parallel``).
"""

from __future__ import annotations

import functools
import json
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hybridrl.engines import DataParallelInfo, EngineContext, LossScale, Objective, TrainEngine, WeightBucket
from hybridrl.engines.batch import ENTROPY, LOG_PROBS, RESPONSE_IDS, RESPONSE_MASK, VALUES, Batch, sequence_tensors
from hybridrl.engines.train_kit import (
    WeightedMean,
    check_same_count,
    engine_device,
    require_process_group,
    sampling_temperature,
)
from hybridrl.weights.buckets import group_into_buckets
from hybridrl.weights.sync_check import GREEDY_MARGIN
from hybridrl_megatron.convert import VALUE_HEAD_NAMES, HFCheckpoint, padded_vocab_size, write_hf_checkpoint
from hybridrl_megatron.cpu_compat import install_moe_fallbacks, install_rng_tracker, maybe_cpu
from hybridrl_megatron.logprobs import vocab_parallel_greedy_margins, vocab_parallel_log_probs
from hybridrl_megatron.model import VALUE_HEAD_FILE, build_gpt, load_hf_weights, param_table, transformer_config
from hybridrl_megatron.moe import clear_router_losses, router_loss_metrics
from hybridrl_megatron.optim import MegatronStepper, TorchStepper
from hybridrl_megatron.parallel import init_parallel
from hybridrl_megatron.settings import MegatronSettings, option_problems
from hybridrl_megatron.weights import iter_full_hf

# megatron-core announces its fallbacks (no Apex / Transformer Engine: the local spec wants none) and a
# CUDA launch tip on every import; they say nothing about this engine's runs.
for _message in (r"Apex is not installed", r"Transformer Engine and Apex are not installed",
                 r"When using async grad allreduce it is recommended", r"full scope is deprecated"):
    warnings.filterwarnings("ignore", message=_message, category=UserWarning)

#: what ``update`` can hand to an objective, per head.
HEAD_OUTPUTS = {"lm": frozenset({LOG_PROBS, ENTROPY}), "value": frozenset({VALUES})}
CHECKPOINT_META = "megatron_layout.json"


@dataclass
class _MicroBatch:
    """One micro-batch as the schedules' data iterator yields it."""

    batch: Batch  # rows of the local batch (padding rows, if any, have a zero response mask)
    real_rows: int
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor  # (b, 1, s, s) bool, True = masked (Megatron's convention)
    labels: torch.Tensor  # (b, R), 0 at padded response positions
    response_mask: torch.Tensor  # (b, R) bool


class MegatronEngine(TrainEngine):
    """Actor / reference policy / critic on megatron-core. ``ctx.trainable=False`` gives a frozen model without
    optimiser."""

    def __init__(self, ctx: EngineContext) -> None:
        super().__init__(ctx)
        require_process_group(ctx, "MegatronEngine")
        self.settings = MegatronSettings.from_options(ctx.options, ctx.role)
        self.training = ctx.training
        problems = option_problems(ctx.role, {}, ctx.training)
        if problems:
            raise ValueError("; ".join(f"{key}: {reason}" for key, reason in problems))
        self.head = self.settings.head
        self.device = engine_device(ctx)
        self._compat = functools.partial(maybe_cpu, self.device.type)
        with self._compat():
            self.layout = init_parallel(ctx.world_size, self.settings.tensor_parallel, self.settings.pipeline_parallel,
                                        self.settings.expert_parallel)
            torch.manual_seed(ctx.seed)
            self._seed_rng(ctx.seed)
            self.ckpt = HFCheckpoint(ctx.model_path)
            self.spec = self.ckpt.spec
            if self.spec.is_moe:
                install_moe_fallbacks()
            self.padded_vocab = padded_vocab_size(self.spec.vocab_size, self.layout.tp, self.settings.vocab_multiple)
            self.config = transformer_config(self.spec, self.settings, self.layout, ctx.device, ctx.torch_dtype)
            self.model = build_gpt(self.spec, self.config, self.layout, self.settings, self.head)
            self.table = param_table(self.model, self.spec, self.layout, self.head)
            load_hf_weights(self.table, self.ckpt, self.layout, self.padded_vocab, ctx.seed)
            self.vocab_start = self.layout.tp_rank * (self.padded_vocab // self.layout.tp)
            self.stepper: TorchStepper | MegatronStepper | None = None
            if ctx.trainable:
                if self.device.type == "cuda":
                    self.stepper = MegatronStepper(self.model, self.config, self.layout, self.training)
                else:
                    tied = self.spec.tie_embeddings and self.head == "lm"  # a critic is built untied
                    self.stepper = TorchStepper(self.model, self.table, self.layout, self.training, tied)
                self.stepper.configure(self.config)
            else:
                self.model.requires_grad_(False)
            self.model.eval()

    def _seed_rng(self, seed: int) -> None:
        if self.device.type == "cuda":
            from megatron.core import tensor_parallel

            tensor_parallel.model_parallel_cuda_manual_seed(seed)
        else:
            install_rng_tracker(seed, self.layout.tp_rank)

    # --- layout -------------------------------------------------------------------------------------------
    def data_parallel(self) -> DataParallelInfo:
        lay = self.layout
        return DataParallelInfo(lay.dp_rank, lay.dp, returns_output=lay.tp_rank == 0 and lay.last_stage)

    @property
    def module(self) -> torch.nn.Module:
        """What the schedules run: the model, or Megatron's DDP wrapper around it on CUDA."""
        return self.stepper.module if self.stepper is not None else self.model

    # --- forward ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def compute_log_probs(self, batch: Batch, with_entropy: bool = False) -> Batch:
        """Log-probs (and entropies) of the response tokens; 0 at padded response positions. Ranks that do
        not return output (``data_parallel``) give zeros of the right shape."""
        self._require_head("lm", "compute_log_probs")
        temperature = sampling_temperature(batch)
        keys = [LOG_PROBS, ENTROPY] if with_entropy else [LOG_PROBS]
        return self._forward_rows(batch, keys, lambda micro, out: self._response_outputs(micro, out, temperature,
                                                                                         with_entropy))

    @torch.no_grad()
    def compute_greedy_margins(self, batch: Batch) -> Batch:
        """See ``TrainEngine.compute_greedy_margins`` (the trainer's sync check); vocabulary-parallel."""
        self._require_head("lm", "compute_greedy_margins")
        group = self.layout.tp_group if self.layout.tp > 1 else None

        def margins(micro: _MicroBatch, logits: torch.Tensor) -> dict[str, torch.Tensor]:
            gaps = vocab_parallel_greedy_margins(_response_positions(micro, logits), micro.labels, self.vocab_start,
                                                 self.spec.vocab_size, group)
            return {GREEDY_MARGIN: gaps.masked_fill(~micro.response_mask, 0.0)}

        return self._forward_rows(batch, [GREEDY_MARGIN], margins)

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> Batch:
        """Critic: ``values`` (B, R), the value of the state before each response token; 0 at padding."""
        self._require_head("value", "compute_values")
        return self._forward_rows(batch, [VALUES], lambda micro, out: {VALUES: self._response_values(micro, out)})

    def _forward_rows(self, batch: Batch, keys: list[str],
                      reduce: Callable[[_MicroBatch, torch.Tensor], dict[str, torch.Tensor]]) -> Batch:
        """Forward-only schedule over the micro-batches; ``reduce(micro, last stage output)`` gives (b, R)
        tensors, reassembled in row order (padding rows dropped). Ranks that return no output give zeros."""
        width = batch[RESPONSE_IDS].shape[1]
        micro_batches = self._micro_batches(batch)
        check_same_count(len(micro_batches), self.ctx.device)
        with self._compat():
            self.model.eval()

            def collect(micro: _MicroBatch, output: torch.Tensor, non_loss_data: bool = True
                        ) -> dict[str, torch.Tensor]:
                return {k: v[: micro.real_rows].float().cpu() for k, v in reduce(micro, output).items()}

            stored = self._run_schedule(micro_batches, collect, forward_only=True)
        if not stored:
            return Batch.from_tensors({k: torch.zeros(len(batch), width) for k in keys})
        return Batch.from_tensors({k: torch.cat([s[k] for s in stored], dim=0) for k in keys})

    def _require_head(self, head: str, method: str) -> None:
        if self.head != head:
            raise RuntimeError(f"{method} needs the '{head}' head; role '{self.ctx.role}' has the '{self.head}' head")

    @torch.no_grad()
    def compute_logits(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """Full-vocabulary fp32 logits ``(B, S, V)`` of unpadded ``input_ids`` (positions 0..S-1), for checks
        against other implementations: unlike ``compute_log_probs`` this gathers the vocabulary over the
        tensor-parallel group. Collective; ranks of the last pipeline stage return the logits, others None."""
        self._require_head("lm", "compute_logits")
        b, s = input_ids.shape
        causal = torch.ones(s, s, dtype=torch.bool).triu(1).expand(b, 1, s, s)
        dev = self.device
        micro = _MicroBatch(Batch.from_tensors({}), b, input_ids.to(dev), torch.arange(s).expand(b, s).to(dev),
                            causal.to(dev), torch.zeros(b, 0, dtype=torch.long, device=dev),
                            torch.zeros(b, 0, dtype=torch.bool, device=dev))

        def gather(micro: _MicroBatch, logits: torch.Tensor, non_loss_data: bool = True) -> torch.Tensor:
            if self.layout.tp > 1:
                parts = [torch.empty_like(logits) for _ in range(self.layout.tp)]
                dist.all_gather(parts, logits.contiguous(), group=self.layout.tp_group)
                logits = torch.cat(parts, dim=-1)
            return logits[..., : self.spec.vocab_size].float().cpu()

        with self._compat():
            self.model.eval()
            stored = self._run_schedule([micro], gather, forward_only=True)
        return stored[0] if stored else None

    def _response_outputs(self, micro: _MicroBatch, logits: torch.Tensor, temperature: float | None,
                          with_entropy: bool) -> dict[str, torch.Tensor]:
        """Per-token ``log_probs`` (and ``entropy``) of the responses from the last stage's logits
        ``(b, P+R, V/tp)``: positions ``P-1 .. P+R-2`` predict the response tokens."""
        logits = _response_positions(micro, logits)
        if temperature is not None:
            logits = logits / temperature
        group = self.layout.tp_group if self.layout.tp > 1 else None
        log_probs, entropy = vocab_parallel_log_probs(logits, micro.labels, self.vocab_start, self.spec.vocab_size,
                                                      group, with_entropy)
        out = {LOG_PROBS: log_probs.masked_fill(~micro.response_mask, 0.0)}
        if entropy is not None:
            out[ENTROPY] = entropy.masked_fill(~micro.response_mask, 0.0)
        return out

    def _response_values(self, micro: _MicroBatch, output: torch.Tensor) -> torch.Tensor:
        """Values ``(b, R)`` fp32 from the value head's ``(b, P+R, 1)``, at the positions before each response
        token (the state the token is chosen in); 0 at padding."""
        values = _response_positions(micro, output)[..., 0].float()
        return values.masked_fill(~micro.response_mask, 0.0)

    # --- training -----------------------------------------------------------------------------------------
    def update(self, batch: Batch, objective: Objective) -> dict[str, float]:
        """One optimiser step over the local batch: micro-batches through Megatron's schedule (gradients
        accumulated, averaged over data-parallel ranks), clipped to ``grad_clip``."""
        if self.stepper is None:
            raise RuntimeError(f"role '{self.ctx.role}' is frozen (trainable=False): it cannot be updated")
        needs = tuple(objective.needs)
        provided = HEAD_OUTPUTS[self.head]
        unsupported = set(needs) - provided
        if unsupported:
            raise ValueError(f"MegatronEngine with the '{self.head}' head cannot compute {sorted(unsupported)}; "
                             f"it provides {sorted(provided)}")
        micro_batches = self._micro_batches(batch)
        scale = self._loss_scale(batch, len(micro_batches))
        temperature = sampling_temperature(batch)
        lr = self.stepper.lr()
        n_micro = len(micro_batches)
        metrics = WeightedMean()
        losses: list[float] = []

        def loss_fn(micro: _MicroBatch, output: torch.Tensor, non_loss_data: bool = False):
            if self.head == "value":
                outputs = {VALUES: self._response_values(micro, output)}
            else:
                outputs = self._response_outputs(micro, output, temperature, with_entropy=ENTROPY in needs)
            view = micro.batch.to(self.device)
            loss, micro_metrics = objective({k: outputs[k] for k in needs}, view, scale)
            metrics.add(micro_metrics, micro.real_rows)
            losses.append(float(loss.detach()))
            # The schedule divides by the number of micro-batches; the objective's share is already exact.
            return loss * n_micro, {}

        with self._compat():
            self.model.train()
            self.stepper.zero_grad()
            if self.spec.is_moe:
                clear_router_losses()
            self._run_schedule(micro_batches, loss_fn, forward_only=False)
            grad_norm, skipped = self.stepper.step()
            self.model.eval()
            router = router_loss_metrics(self.spec, self.layout, n_micro, self.device)
        return {**metrics.result(), "loss": self._global_loss(sum(losses)), "grad_norm": grad_norm, "lr": lr,
                "skipped_step": float(skipped), **router}

    def _global_loss(self, local: float) -> float:
        """The batch loss: the sum of this data-parallel rank's shares, summed over data-parallel ranks of the
        last stage, divided by ``dp`` (each share is multiplied by ``dp_size``, see ``LossScale``)."""
        if not self.layout.last_stage:
            return 0.0
        if self.layout.dp > 1:
            t = torch.tensor([local], dtype=torch.float64, device=self.device)
            dist.all_reduce(t, group=self.layout.dp_group)
            local = float(t.item())
        return local / self.layout.dp

    def _loss_scale(self, batch: Batch, n_micro: int) -> LossScale:
        """Global token/sequence counts over the data-parallel group (tensor and pipeline peers hold the same
        rows); one all-reduce over all ranks also checks that every rank has as many micro-batches."""
        tokens = float(batch[RESPONSE_MASK].sum())
        dp_sum = torch.tensor([tokens, float(len(batch))], dtype=torch.float64, device=self.device)
        if self.layout.dp > 1:
            dist.all_reduce(dp_sum, group=self.layout.dp_group)
        check_same_count(n_micro, self.ctx.device)
        return LossScale(total_tokens=float(dp_sum[0]), total_sequences=float(dp_sum[1]), dp_size=self.layout.dp)

    # --- schedules ----------------------------------------------------------------------------------------
    def _micro_batches(self, batch: Batch) -> list[_MicroBatch]:
        """Equal micro-batches of at most ``micro_batch`` rows (pipeline schedules send fixed shapes): the last
        one is filled up with copies of its first row whose response mask is zero, which weigh nothing."""
        n = len(batch)
        if n == 0:
            return []
        count = -(-n // self.training.micro_batch)
        size = -(-n // count)
        out = []
        for start in range(0, n, size):
            rows = list(range(start, min(start + size, n)))
            real = len(rows)
            micro = batch.index(rows + [rows[0]] * (size - real))
            if real < size:
                micro.tensors[RESPONSE_MASK][real:] = 0
            out.append(self._prepare(micro, real))
        return out

    def _prepare(self, micro: Batch, real_rows: int) -> _MicroBatch:
        input_ids, attention_mask, position_ids = sequence_tensors(micro)
        seq = input_ids.shape[1]
        causal = torch.ones(seq, seq, dtype=torch.bool).triu(1)
        masked = causal.unsqueeze(0) | ~attention_mask.bool().unsqueeze(1)  # (b, s, s): future or padding keys
        response_mask = micro[RESPONSE_MASK].bool()
        labels = micro[RESPONSE_IDS].masked_fill(~response_mask, 0)
        dev = self.device
        return _MicroBatch(micro, real_rows, input_ids.to(dev), position_ids.to(dev), masked.unsqueeze(1).to(dev),
                           labels.to(dev), response_mask.to(dev))

    def _run_schedule(self, micro_batches: list[_MicroBatch], reduce: Callable[..., Any], forward_only: bool) -> list:
        """Megatron's forward(-backward) schedule over the micro-batches. ``reduce(micro, logits, ...)`` runs on
        the last stage: in ``forward_only`` mode its results are collected, else it returns the loss."""
        if not micro_batches:
            return []
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator: Iterator[_MicroBatch], model: torch.nn.Module):
            micro = next(data_iterator)
            output = model(micro.input_ids, micro.position_ids, micro.attention_mask)
            return output, functools.partial(reduce, micro)

        seq_len = micro_batches[0].input_ids.shape[1]
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[self.module],
            num_microbatches=len(micro_batches), seq_length=seq_len,
            micro_batch_size=micro_batches[0].input_ids.shape[0], forward_only=forward_only,
            collect_non_loss_data=forward_only)

    # --- weights ------------------------------------------------------------------------------------------
    def export_weights(self, bucket_bytes: int) -> Iterator[WeightBucket]:
        """Full weights under HF names in buckets of about ``bucket_bytes`` (collective, lazy): tensor-parallel
        shards gathered, each pipeline stage's tensors broadcast once to the other stages, so every rank holds
        every tensor. The parameters' dtype (fp32 on CPU; bf16/fp16 on CUDA, whose fp32 master copy lives in
        the optimiser). A tied ``lm_head.weight`` is sent once, as ``model.embed_tokens.weight``."""
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        with self._compat():
            dtype = self.table[0].param.dtype
            full = iter_full_hf(self.table, self.spec, self.layout, dtype, self.device, self.head)
            yield from group_into_buckets(full, bucket_bytes)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full HF-named weights on CPU (collective)."""
        return {name: t.cpu() for bucket in self.export_weights(1 << 62) for name, t in bucket}

    def save_hf_checkpoint(self, path: str) -> None:
        """Write the current weights as an HF checkpoint folder (config and tokenizer copied from the model
        the engine was built from; a critic's head as ``value_head.safetensors`` beside its backbone, as the
        FSDP critic saves it). Collective; rank 0 writes."""
        state = self.full_state_dict()
        if self.ctx.rank == 0:
            head = {n.removeprefix("value_head."): state.pop(n) for n in VALUE_HEAD_NAMES if n in state}
            write_hf_checkpoint(path, state.items(), self.ctx.model_path)
            if head:
                from safetensors.torch import save_file

                save_file({k: v.contiguous() for k, v in head.items()}, str(Path(path) / VALUE_HEAD_FILE))
        dist.barrier()

    # --- checkpoints --------------------------------------------------------------------------------------
    def save_checkpoint(self, path: str) -> None:
        """One file per rank (its shards, optimiser state and step count) plus ``megatron_layout.json``;
        reload with the same layout. Collective."""
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        state = {"model": {e.local_name: e.param.detach().cpu().clone() for e in self.table},
                 "stepper": self.stepper.state_dict() if self.stepper is not None else None}
        torch.save(state, out / _rank_file(self.ctx.rank))
        if self.ctx.rank == 0:
            (out / CHECKPOINT_META).write_text(json.dumps(self._layout_meta(), indent=2))
        dist.barrier()

    def load_checkpoint(self, path: str) -> None:
        """Restore what ``save_checkpoint`` wrote (same tensor/pipeline/data layout and model). Collective."""
        src = Path(path)
        meta = json.loads((src / CHECKPOINT_META).read_text())
        if meta != self._layout_meta():
            raise ValueError(f"checkpoint {src} was saved with {meta}, this engine runs {self._layout_meta()}")
        from hybridrl.run.trusted_files import load_plain

        state = load_plain(src / _rank_file(self.ctx.rank))  # tensors and plain data only: a forged file runs nothing
        with torch.no_grad():
            for entry in self.table:
                entry.param.data.copy_(state["model"][entry.local_name])
        if self.stepper is not None:
            if state["stepper"] is None:
                raise ValueError(f"checkpoint {src} holds no optimiser state (saved by a frozen engine)")
            self.stepper.load_state_dict(state["stepper"])
        dist.barrier()

    def _layout_meta(self) -> dict[str, Any]:
        lay = self.layout
        meta = {"world_size": self.ctx.world_size, "tensor_parallel": lay.tp, "pipeline_parallel": lay.pp,
                "data_parallel": lay.dp, "padded_vocab": self.padded_vocab, "model": self.spec.to_json()}
        if lay.ep > 1:  # which experts a rank file holds (a dense checkpoint's record stays as it was)
            meta["expert_parallel"] = lay.ep
        return meta

    # --- memory -------------------------------------------------------------------------------------------
    def offload(self) -> None:
        """Parameters, gradient buffers and optimiser state to host memory (CUDA; a no-op on CPU, where they
        already live in host memory)."""
        if self.device.type != "cuda":
            return
        if self.stepper is not None:
            self.stepper.offload()
        else:
            for p in self.model.parameters():
                p.data = p.data.cpu()
            torch.cuda.empty_cache()

    def onload(self) -> None:
        if self.device.type != "cuda":
            return
        if self.stepper is not None:
            self.stepper.onload()
        else:
            for p in self.model.parameters():
                p.data = p.data.to(self.device, non_blocking=True)
            torch.cuda.synchronize()


# --- helpers ----------------------------------------------------------------------------------------------
def _rank_file(rank: int) -> str:
    return f"megatron_rank{rank:05d}.pt"


def _response_positions(micro: _MicroBatch, output: torch.Tensor) -> torch.Tensor:
    """Rows ``P-1 .. P+R-2`` of a last-stage output ``(b, P+R, ...)``: those that predict (or value the state
    before) each response token."""
    response_len = micro.labels.shape[1]
    prompt_len = micro.input_ids.shape[1] - response_len
    if prompt_len < 1:
        raise ValueError("every batch needs at least one prompt column (the first response token's context)")
    return output[:, prompt_len - 1: prompt_len - 1 + response_len]
