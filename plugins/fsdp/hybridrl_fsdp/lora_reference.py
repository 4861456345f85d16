"""``LoraReference``: the reference policy of a LoRA actor, served by the actor's own FSDP module.

With LoRA the reference policy *is* the frozen base: the actor's model with its adapters disabled. When the
reference role shares the actor's process (``hybridrl.lora.reference_is_actor_base``), the worker asks the
actor's engine for this view (``FSDPEngine.reference_view``) instead of building a second engine: no second copy
of the weights, no second load. The view is an ``FSDPEngine`` over the actor's model, mesh and offload policy
(the same objects), with the reference's own context and micro-batching, no optimizer, and every forward run
inside ``Adapters.disabled()``.
"""

from __future__ import annotations

from collections.abc import Iterator

from hybridrl.engines import EngineContext, TrainEngine, WeightBucket
from hybridrl.engines.batch import Batch
from hybridrl.weights.buckets import group_into_buckets
from hybridrl_fsdp.engine import FSDPEngine, _full_copy, _persistent_buffers


class LoraReference(FSDPEngine):
    """The base of a LoRA actor's engine, with the adapters disabled (see the module docstring)."""

    def __init__(self, actor: FSDPEngine, ctx: EngineContext) -> None:  # no FSDPEngine.__init__: no model of its own
        if actor.lora is None:
            raise RuntimeError("a LoRA reference needs an actor with adapters (roles.actor.lora)")
        TrainEngine.__init__(self, ctx)
        vars(self).update({k: v for k, v in vars(actor).items() if k != "ctx"})  # the actor's model, mesh, policy
        self.actor = actor
        self.settings = actor.settings  # the model's settings (head, packing, offload) are the actor's
        self.training = ctx.training  # how the reference splits a batch (micro_batch, token budget) is its own
        self.optimizer = None
        self.scheduler = None

    def compute_log_probs(self, batch: Batch, with_entropy: bool = False) -> Batch:
        with self.lora.disabled():
            return super().compute_log_probs(batch, with_entropy)

    def compute_greedy_margins(self, batch: Batch) -> Batch:
        with self.lora.disabled():
            return super().compute_greedy_margins(batch)

    def update(self, batch, objective):  # noqa: ANN001 - the contract's signature
        raise RuntimeError("the reference policy is frozen: it cannot be updated")

    def export_weights(self, bucket_bytes: int) -> Iterator[WeightBucket]:
        """The frozen base under HF names (full fp32 copies)."""
        def tensors():
            yield from self.lora.named_tensors(lambda p: _full_copy(p, self.master_dtype), merged=False)
            for name, buffer in _persistent_buffers(self.model):
                yield self.lora.hf_name(name), _full_copy(buffer, buffer.dtype)
        return group_into_buckets(tensors(), bucket_bytes)

    def export_weights_transient(self, bucket_bytes: int) -> Iterator[WeightBucket]:
        return self.export_weights(bucket_bytes)

    def transient_export_holds_views(self) -> bool:
        return False

    def export_adapter(self, bucket_bytes: int) -> Iterator[WeightBucket]:
        raise RuntimeError("the reference policy has no adapters of its own (they are the actor's)")

    def reference_view(self, ctx: EngineContext) -> TrainEngine:
        return self.actor.reference_view(ctx)

    def offload(self) -> None:
        """Nothing of its own to move: the memory is the actor's."""

    def onload(self) -> None:
        """See ``offload``."""

    def save_checkpoint(self, path: str) -> None:
        raise RuntimeError("the reference policy is frozen: it has no checkpoint (the base is model.path)")

    def load_checkpoint(self, path: str) -> None:
        raise RuntimeError("the reference policy is frozen: it has no checkpoint (the base is model.path)")
