"""The contracts between the core and its backends: ``TrainEngine`` and ``RolloutEngine``.

A backend plugin implements one of these and registers it with ``registry.add_train_engine`` /
``registry.add_rollout``, declaring there which optional methods it implements (``supports=``, the names in
``hybridrl.engines.capabilities``): pre-flight and the trainer read the declarations, never probe the methods.
The core never imports a backend; it only calls these methods, inside the worker process that hosts the role
(see ``hybridrl.runtime.worker``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Protocol

import torch

from hybridrl.data_parallel import DataParallelInfo
from hybridrl.engines.batch import FINISHED, MAX_NEW_TOKENS, Batch, cap_responses
from hybridrl.lora import LoraSpec

if TYPE_CHECKING:
    from hybridrl.environments.spec import EnvironmentSpec

NamedTensor = tuple[str, torch.Tensor]
WeightBucket = list[NamedTensor]


@dataclass(frozen=True)
class TrainingOptions:
    """The training settings every train backend reads, from the role's typed keys (``roles.actor.lr`` ...,
    validated with their key paths before any process starts; a critic, reference or reward model inherits
    what it leaves unset from the actor, see ``roles.RoleSpec.inherits``). A backend validates only its own
    settings, which arrive in ``EngineContext.options``.

    ``lr`` is the peak rate: with ``warmup_steps`` the k-th optimiser step (0-based) uses
    ``lr * min(1, (k + 1) / warmup_steps)``. ``grad_clip`` None or <= 0 measures the norm without clipping.
    ``max_tokens_per_micro_batch`` replaces ``micro_batch`` (rows per forward) by a token budget."""

    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float | None = 1.0
    warmup_steps: int = 0
    micro_batch: int = 16
    max_tokens_per_micro_batch: int | None = None

    def __post_init__(self) -> None:
        """Refuse sizes no backend can split a batch by (the config schema checks these too; this guards an
        engine built from a dict)."""
        if isinstance(self.micro_batch, bool) or not isinstance(self.micro_batch, int) or self.micro_batch < 1:
            raise ValueError(f"micro_batch must be a positive integer, got {self.micro_batch!r}")
        budget = self.max_tokens_per_micro_batch
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ValueError(f"max_tokens_per_micro_batch must be a positive integer, got {budget!r}")

    @classmethod
    def split(cls, options: Mapping[str, Any]) -> tuple[TrainingOptions, dict[str, Any]]:
        """A flat mapping of role settings as ``(TrainingOptions, the backend's own settings)``; unset or None
        shared keys keep their defaults (for tests and tools that build an engine from one dict)."""
        shared = {f.name for f in fields(cls)}
        given = {k: v for k, v in options.items() if k in shared and v is not None}
        if "betas" in given:
            given["betas"] = (float(given["betas"][0]), float(given["betas"][1]))
        return cls(**given), {k: v for k, v in options.items() if k not in shared}


@dataclass(frozen=True)
class EngineContext:
    """Where and as what an engine runs. ``training`` holds the shared training settings (train roles),
    ``options`` the role's backend-specific keys (``roles.<role>.options``; for a rollout also its typed keys)."""

    role: str
    backend: str
    model_path: str
    rank: int
    world_size: int
    device: str = "cpu"  # "cpu" or "cuda"
    dtype: str = "float32"
    seed: int = 0
    trainable: bool = True
    options: dict[str, Any] = field(default_factory=dict)
    training: TrainingOptions = field(default_factory=TrainingOptions)
    #: LoRA adapters (``roles.actor.lora``): given to the actor (it trains them) and to the rollout (it is sent
    #: them when ``lora.sync`` is 'adapter'); None: full weights.
    lora: LoraSpec | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 32
    min_new_tokens: int = 0
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: bool = True  # return the sampled tokens' log-probs (False: engines that can skip their cost)
    return_routing: bool = False  # MoE: also return ``routed_experts`` (engines declaring ``return_routing``)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class GeneratedTokens:
    """One request's completion (``RolloutEngine.generate_request``): the sampled ids (the stop token
    included when it stopped), their log-probs as in ``generate`` (None when ``params.logprobs`` is off)."""

    token_ids: list[int]
    log_probs: list[float] | None = None


@dataclass(frozen=True)
class LossScale:
    """Global sizes of the mini-batch, summed over data-parallel ranks, so that an objective evaluated on
    one micro-batch of one rank returns its exact share of the global loss (gradients are averaged over
    ``dp_size`` ranks by the engine's all-reduce, so the share is multiplied back by ``dp_size``)."""

    total_tokens: float
    total_sequences: float
    dp_size: int


class Objective(Protocol):
    """The training loss the core hands to ``TrainEngine.update`` (policy loss, value loss ...)."""

    #: tensors the engine must compute per micro-batch: "log_probs", "entropy", "values".
    needs: tuple[str, ...]

    def __call__(self, outputs: dict[str, torch.Tensor], micro_batch: Batch, scale: LossScale
                 ) -> tuple[torch.Tensor, dict[str, float]]:
        """Scalar loss of this micro-batch (already scaled, see ``LossScale``) and metrics to average."""


class TrainEngine(ABC):
    """A trainable (or frozen, for the reference policy) model sharded over the ranks of its pool."""

    def __init__(self, ctx: EngineContext) -> None:
        self.ctx = ctx

    def data_parallel(self) -> DataParallelInfo:
        return DataParallelInfo(self.ctx.rank, self.ctx.world_size)

    @abstractmethod
    def compute_log_probs(self, batch: Batch, with_entropy: bool = False) -> Batch:
        """Per-token log-probs ``(B, R)`` of the response tokens (``log_probs``; ``entropy`` if asked),
        float32 on CPU. ``batch.info["temperature"]``, when set, divides the logits first (here and in
        ``update``), so that they compare with the rollout's log-probs. All ranks of a data-parallel group
        receive equally long batches (the driver pads to a multiple of the data-parallel size)."""

    def compute_values(self, batch: Batch) -> Batch:
        """Critic engines: ``values`` ``(B, R)``, the value of the state *before* each response token (the
        prompt and the response tokens before it), float32 on CPU, 0 at padded positions. Added for PPO's
        critic role; optional: declare the `value_head` capability when implemented."""
        raise NotImplementedError(f"{type(self).__name__} has no value head (role '{self.ctx.role}')")

    def compute_greedy_margins(self, batch: Batch) -> Batch:
        """``greedy_margin`` ``(B, R)``: at each response position, the largest logit minus the response
        token's (temperature 1; 0: the token is an argmax), float32 on CPU, 0 at padded positions. Read by the
        trainer's sync check (``hybridrl.weights.sync_check``, helper ``greedy_margins``); optional: declare the
        `greedy_margins` capability."""
        raise NotImplementedError(f"{type(self).__name__} does not score greedy margins")

    def compute_scores(self, batch: Batch) -> Batch:
        """Reward-model engines: ``scores`` ``(B,)``, one scalar per prompt+response, float32 on CPU. Added
        for the reward-model role; optional: declare the `reward_head` capability."""
        raise NotImplementedError(f"{type(self).__name__} is not a reward model (role '{self.ctx.role}')")

    @abstractmethod
    def update(self, batch: Batch, objective: Objective) -> dict[str, float]:
        """One optimiser step over ``batch`` (micro-batched inside). Returns this rank's metrics averaged
        over its micro-batches; the driver averages them over data-parallel ranks."""

    @abstractmethod
    def export_weights(self, bucket_bytes: int) -> Iterator[WeightBucket]:
        """Full (unsharded) weights under Hugging Face names, in buckets of about ``bucket_bytes``, on the
        engine's device in its master dtype (the importer casts). Collective: every rank must iterate to
        the end; ranks that are not ``exports_on_rank`` may yield nothing useful and the bridge ignores them."""

    def export_weights_transient(self, bucket_bytes: int) -> Iterator[WeightBucket]:
        """Like ``export_weights`` for an importer that copies each bucket before asking for the next one
        (the colocated in-process bridge): tensors may be views of the live weights and in any dtype the
        importer can cast from, so an engine can skip its own copy. Default: ``export_weights``."""
        return self.export_weights(bucket_bytes)

    def transient_export_holds_views(self) -> bool:
        """Whether ``export_weights_transient`` hands views of the live weights (no memory of its own per
        bucket). Then the in-process bridge may ask for larger buckets from an importer that needs no staging
        memory either (``RolloutEngine.imports_without_staging``): fewer calls per sync. Default: False."""
        return False

    def exports_on_rank(self) -> bool:
        """Whether this rank's exported buckets are the ones sent to a rollout on another pool."""
        return self.ctx.rank == 0

    def export_adapter(self, bucket_bytes: int) -> Iterator[WeightBucket]:
        """LoRA engines (``ctx.lora``; declare the `lora` capability): the adapters alone, unsharded, under
        peft's saved names (``hybridrl.lora.adapter_name``), in buckets of about ``bucket_bytes``: what a weight
        sync sends when ``ctx.lora.sync`` is 'adapter' (tensors may be views, as in ``export_weights_transient``)
        and what ``hybridrl export --adapter`` writes. ``export_weights`` stays the full policy: the base with
        the adapters merged in, under HF names. Collective."""
        raise NotImplementedError(f"{type(self).__name__} (backend '{self.ctx.backend}') has no LoRA adapters")

    def reference_view(self, ctx: EngineContext) -> TrainEngine:
        """LoRA engines: the reference role (``ctx``) served by this engine in its own process: the frozen base
        with the adapters disabled, computing log-probs with the reference's own micro-batching, holding no copy
        of the weights. Called by the worker instead of building a second engine when the reference shares the
        actor's process (``hybridrl.lora.reference_is_actor_base``)."""
        raise NotImplementedError(f"{type(self).__name__} (backend '{self.ctx.backend}') has no LoRA adapters")

    def offload(self) -> None:
        """Release device memory (parameters, gradients, optimiser state) so a colocated engine can use it."""

    def onload(self) -> None:
        """Undo ``offload``."""

    def save_checkpoint(self, path: str) -> None:
        """Everything needed to continue training into folder ``path`` (created if missing): sharded weights,
        optimiser and lr-schedule state, this rank's RNG. Collective: every rank writes its own part (``path``
        is on a filesystem all ranks share). The driver publishes the folder atomically after all returned
        (``hybridrl.run.checkpoint``). Optional: declare the `checkpoint` capability; without it
        ``trainer.save_every`` and resuming are refused."""
        raise NotImplementedError(f"{type(self).__name__} (backend '{self.ctx.backend}') does not save checkpoints")

    def load_checkpoint(self, path: str) -> None:
        """Restore what ``save_checkpoint`` wrote into this freshly built engine (collective). The driver
        then syncs the weights into the rollout as after any update."""
        raise NotImplementedError(f"{type(self).__name__} (backend '{self.ctx.backend}') does not load checkpoints")


class RolloutEngine(ABC):
    """Token-in/token-out generation. One instance per rank; ``data_parallel`` says which ranks form a replica."""

    def __init__(self, ctx: EngineContext) -> None:
        self.ctx = ctx

    def data_parallel(self) -> DataParallelInfo:
        return DataParallelInfo(self.ctx.rank, self.ctx.world_size)

    @abstractmethod
    def generate(self, batch: Batch, params: SamplingParams) -> Batch:
        """Sample one response per row of ``prompt_ids``/``prompt_mask``. Returns ``response_ids``,
        ``response_mask`` (right-padded to exactly ``max_new_tokens`` columns, EOS included in the mask)
        and ``rollout_log_probs``: log-probs of the sampled tokens under the distribution they were drawn
        from (logits / temperature, after top-k/top-p renormalisation; raw log-softmax when greedy).
        ``params.seed`` is shared by all ranks; an engine mixes in its rank so replicas draw distinct streams."""

    def generate_until(self, batch: Batch, params: SamplingParams, share: float, running: float = 1.0) -> Batch:
        """``generate`` that may stop early: rows that sample one prompt share a ``group_index``, and once
        ``ceil(share * groups)`` of the batch's groups have every row finished, the engine stops and returns
        each unfinished row's tokens so far (maybe none). Returns ``generate``'s keys plus ``finished`` (B,)
        bool. Every row honours its ``max_new_tokens`` cap when the batch has one (the driver resumes a cut
        row as prompt + its tokens, with the rest of its budget, under new weights: partial rollouts).

        ``running`` below 1 (passed only to an engine that declares ``refill``): at most
        ``ceil(running * groups)`` groups decode at once; the others wait in batch order and each starts as a
        running group completes (``rollout_kit.GroupCompletion``). A row never started returns no token,
        unfinished.

        Default: ``generate`` to the end, rows cut to their caps, all finished: correct, never early. An engine
        that stops early (its batch decodes no tail of a few long rows) declares the `partial` capability."""
        out = self.generate(batch, params)
        if MAX_NEW_TOKENS in batch:
            out = cap_responses(out, batch[MAX_NEW_TOKENS])
        out.set(FINISHED, torch.ones(len(out), dtype=torch.bool))
        return out

    async def generate_request(self, prompt_ids: list[int], params: SamplingParams) -> GeneratedTokens:
        """Sample one response to ``prompt_ids`` (no padding), awaitable so that many run at once (the
        per-request episode runner awaits one per live trajectory). Same sampling and log-prob contract as
        ``generate``; ``params.seed`` is this request's own (the runner mixes in row and turn), which an
        engine mixes with its replica as ``generate`` does with rows. Optional: an engine that serves single
        requests concurrently (continuous batching) declares ``supports={"requests"}`` at registration, and
        multi-turn episodes then run one request per turn, none waiting for another."""
        raise NotImplementedError(f"{type(self).__name__} does not generate single requests")

    def run_requests(self, coroutine: Any) -> Any:
        """Run the episode runner's coroutine (which awaits ``generate_request``) to completion on the event
        loop the engine's requests belong to. Default: a fresh loop (``asyncio.run``); an engine bound to a
        loop of its own (SGLang's) runs it there."""
        import asyncio

        return asyncio.run(coroutine)

    def generate_episodes(self, batch: Batch, params: SamplingParams, environment: EnvironmentSpec) -> Batch:
        """Play one episode of ``environment`` per row (``prompt_ids``/``prompt_mask``, and the rows'
        ``prompt``/``meta`` fields) and return the trainer's rows (``hybridrl.environments.trajectory``).
        Runs in the rollout worker, next to the engine; engines inherit it and need not override it."""
        from hybridrl.environments.runner import run_episodes

        return run_episodes(self, batch, params, environment)

    @abstractmethod
    def import_weights(self, bucket: WeightBucket) -> None:
        """Load one bucket of Hugging Face-named tensors into the engine's model. With ``ctx.lora.sync`` 'adapter'
        (declare the `lora_adapters` capability) the buckets hold the actor's LoRA adapters under peft's saved
        names instead (``hybridrl.lora``; a pair may span buckets, and tensors may be views of a buffer reused
        for the next bucket): the engine serves them on its own base weights from ``finish_weight_import`` on."""

    def finish_weight_import(self) -> None:
        """Called after the last bucket: reset prefix caches and the like."""

    def imports_without_staging(self) -> bool:
        """Whether ``import_weights`` copies each tensor straight into the engine's weights, holding no
        staging buffer of the bucket's size: the bucket size then bounds nothing on this side, and the
        in-process bridge may send views in larger buckets (fewer calls and launches per sync).
        Default: False (bucket_bytes bounds the staging memory)."""
        return False

    def import_stats(self) -> dict[str, float]:
        """Optional figures of the last weight update (seconds per part ...), logged as ``reshard/<key>``."""
        return {}

    def sleep(self) -> None:
        """Release device memory (KV cache, and weights where the engine can) while the trainer works."""

    def wake(self) -> None:
        """Undo ``sleep`` before the next generation."""

    def named_weights(self) -> Iterator[NamedTensor]:
        """The engine's current weights under HF names (for verification; optional: declare `named_weights`)."""
        raise NotImplementedError(f"{type(self).__name__} does not expose its weights")
