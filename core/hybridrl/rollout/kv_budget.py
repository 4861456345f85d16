"""The rollout engine's KV cache, sized from the memory that is free when it is allocated (engine-free).

The rule (``roles.rollout.options.gpu_memory_utilization: auto``, the default of the vLLM and SGLang backends):
the rollout is built last, after the trainers hold their resident state (weights, optimizer state where it
stays on the device), and takes for its KV cache what the step needs, out of what is left::

    available = free now - engine weights - engine activations and CUDA graphs - margin
    floor     = the step's sequences (per replica) at full length, in whole cache blocks
    target    = floor x KV_HEADROOM (and at least one sequence of the engine's context length)
    KV cache  = min(target, available); below the floor: ``KVCacheTooSmall`` (key path, numbers, fixes)

A larger cache would hold nothing more (a step never has more sequences in flight) and would cost wake time;
a smaller one would queue or preempt the step's sequences. The plan (``hybridrl.placement.memory``) runs the
same arithmetic on its estimate of what is free, so the engine and the plan agree.

The numbers a share of total memory (vLLM's ``gpu_memory_utilization``) or of free memory (SGLang's
``mem_fraction_static``) turn into are each backend's business; both backends call ``size_kv_cache``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from hybridrl.errors import HybridRLError

GIB = float(2**30)
#: the cache's allocation unit (tokens per block) the floor is rounded to.
KV_BLOCK_TOKENS = 16
#: the target over the floor: block rounding, the scheduler's slack, a sequence or two more in flight.
KV_HEADROOM = 1.15
#: left free beyond the engine's estimate of its own activations and graphs.
KV_MARGIN_BYTES = int(1.0 * GIB)
#: the option that selects this rule, and what the error messages name.
UTILIZATION_KEY = "roles.rollout.options.gpu_memory_utilization"
AUTO = "auto"


@dataclass(frozen=True)
class KVDemand:
    """What one engine replica must hold at once: ``sequences`` of ``tokens_per_sequence`` tokens at
    ``bytes_per_token`` (keys and values of every layer, this rank's share under tensor parallelism)."""

    sequences: int
    tokens_per_sequence: int
    bytes_per_token: int
    block_tokens: int = KV_BLOCK_TOKENS
    #: the engine's context length: it refuses to start without room for one such sequence.
    context_tokens: int | None = None

    @property
    def tokens(self) -> int:
        per_sequence = math.ceil(self.tokens_per_sequence / self.block_tokens) * self.block_tokens
        return self.sequences * per_sequence

    @property
    def floor_bytes(self) -> int:
        return self.tokens * self.bytes_per_token

    @property
    def target_bytes(self) -> int:
        one_context = (self.context_tokens or 0) + self.block_tokens
        return max(math.ceil(self.floor_bytes * KV_HEADROOM), one_context * self.bytes_per_token)

    def describe(self) -> str:
        return f"{self.sequences} sequences x {self.tokens_per_sequence} tokens"


def demand_from_options(options: dict[str, Any], replicas: int, bytes_per_token: int,
                        context_tokens: int | None = None) -> KVDemand | None:
    """The demand of one replica from the ``workload`` option the pre-flight writes (``sequences`` of the whole
    step, ``tokens_per_sequence``), None when it is absent (an engine built outside a run)."""
    workload = options.get("workload") or {}
    sequences, tokens = workload.get("sequences"), workload.get("tokens_per_sequence")
    if not sequences or not tokens:
        return None
    return KVDemand(-(-int(sequences) // max(1, replicas)), int(tokens), int(bytes_per_token),
                    context_tokens=context_tokens)


def free_share(free_bytes: int, options: dict[str, Any]) -> int:
    """This replica's part of the memory free at its start: replicas side by side on one device
    (``pools.<name>.per_device``, passed as the workload's ``replicas_per_device``) start together, each reading
    the same free memory, so each sizes from its share."""
    replicas = int((options.get("workload") or {}).get("replicas_per_device", 1))
    return int(free_bytes) // max(1, replicas)


@dataclass
class KVSizing:
    """How the cache was sized: every term of the rule, for the log, the plan and the benchmark."""

    kv_bytes: int
    free_bytes: int
    weights_bytes: int
    overhead_bytes: int
    margin_bytes: int
    demand: KVDemand | None
    notes: list[str] = field(default_factory=list)

    @property
    def available_bytes(self) -> int:
        return self.free_bytes - self.weights_bytes - self.overhead_bytes - self.margin_bytes

    def as_dict(self) -> dict[str, Any]:
        out = {"kv_bytes": self.kv_bytes, "free_bytes": self.free_bytes, "weights_bytes": self.weights_bytes,
               "overhead_bytes": self.overhead_bytes, "margin_bytes": self.margin_bytes}
        if self.demand is not None:
            out.update(floor_bytes=self.demand.floor_bytes, target_bytes=self.demand.target_bytes,
                       sequences=self.demand.sequences, tokens_per_sequence=self.demand.tokens_per_sequence)
        return out


class KVCacheTooSmall(HybridRLError, RuntimeError):
    """The KV cache cannot hold the step's sequences in the memory left: raised before the engine starts (or
    right after, when the engine's own cache came out below the floor). ``report`` holds the numbers."""

    def __init__(self, message: str, report: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.report = dict(report or {})

    def __reduce__(self):  # keep the report through pickling (Ray hands it to the driver)
        return (type(self), (str(self), self.report))


#: what frees memory for the rollout's cache, cheapest first (the error lists them).
KV_FIXES = ("roles.ref.options.offload=all", "roles.actor.options.offload=optimizer",
            "roles.actor.options.offload=all", "roles.rollout.tensor_parallel=2 (more devices per engine)",
            "data.prompts_per_step lower (fewer sequences per step)",
            f"{UTILIZATION_KEY}=0.6 (a fixed share of the device: the engine queues the sequences that do not fit, "
            "and preempts running ones, to recompute them later, when they outgrow it)")


def size_kv_cache(demand: KVDemand | None, free_bytes: int, weights_bytes: int, overhead_bytes: int,
                  margin_bytes: int = KV_MARGIN_BYTES, device: str = "the device") -> KVSizing:
    """The cache for ``demand`` out of ``free_bytes``; without a demand, everything available."""
    sizing = KVSizing(0, int(free_bytes), int(weights_bytes), int(overhead_bytes), int(margin_bytes), demand)
    available = sizing.available_bytes
    if demand is None:
        if available <= 0:
            raise KVCacheTooSmall(f"{UTILIZATION_KEY}=auto: no memory left for a KV cache on {device} "
                                  f"({_breakdown(sizing)})", sizing.as_dict())
        sizing.kv_bytes = available
        sizing.notes.append("no workload given: the cache takes all the memory available")
        return sizing
    if available < demand.floor_bytes:
        raise KVCacheTooSmall(
            f"{UTILIZATION_KEY}=auto: the KV cache for the step's {demand.describe()} needs "
            f"{demand.floor_bytes / GIB:.2f} GiB, but only {max(available, 0) / GIB:.2f} GiB are left on {device} "
            f"after the trainers' resident state ({_breakdown(sizing)}). Fixes, cheapest first: "
            + "; ".join(KV_FIXES), sizing.as_dict())
    sizing.kv_bytes = min(demand.target_bytes, available)
    if sizing.kv_bytes < demand.target_bytes:
        sizing.notes.append(f"KV cache {sizing.kv_bytes / GIB:.2f} GiB, under the {demand.target_bytes / GIB:.2f} GiB "
                            "target but above the step's floor")
    return sizing


def _breakdown(sizing: KVSizing) -> str:
    return (f"free {sizing.free_bytes / GIB:.2f} GiB - engine weights {sizing.weights_bytes / GIB:.2f} GiB - engine "
            f"activations and CUDA graphs {sizing.overhead_bytes / GIB:.2f} GiB - margin "
            f"{sizing.margin_bytes / GIB:.2f} GiB")


def is_auto(value: Any) -> bool:
    """Whether a ``gpu_memory_utilization`` value asks for this rule (unset counts as auto)."""
    return value is None or (isinstance(value, str) and value.strip().lower() == AUTO)
