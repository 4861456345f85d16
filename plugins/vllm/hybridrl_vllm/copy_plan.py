"""Direct weight copies into vLLM's live parameters (engine-free: works on any ``nn.Module``).

``model.load_weights`` resolves every incoming tensor by name through Python (stacked-parameter tables,
per-parameter ``weight_loader``s): a few hundred small calls per sync for a small model, against one device
copy of the same bytes. Where vLLM keeps the checkpoint's layout (unquantized, one tensor-parallel rank,
CUDA), the place of each Hugging Face tensor is a fixed slice of one parameter: the parameter of the same
name, or a slice along dim 0 of a packed one (``qkv_proj`` <- q, k, v; ``gate_up_proj`` <- gate, up, in the
model's ``packed_modules_mapping`` order). A ``CopyPlan`` maps each name to that slice once, is checked
against what ``load_weights`` actually wrote (``verify``), and afterwards a bucket is one
``torch._foreach_copy_`` (casting on the fly), with ``load_weights`` only for names it could not place.

Even fused, a bucket's copies are many small kernels. On CUDA, ``GraphedCopies`` records them into one CUDA
graph when a bucket arrives again with the same names at the same source and destination addresses as at
the previous update, and replays it from then on: one launch per bucket. The addresses are stable where it
matters: a colocated trainer updates its parameters in place, and vLLM's sleep maps the weights back at the
same virtual addresses. (What this saves, and what the alternatives measured against it saved:
``benchmarks/results/`` and the README's vLLM section.)
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

WeightBucket = list[tuple[str, torch.Tensor]]
log = logging.getLogger(__name__)


def _packed_members(model: nn.Module) -> dict[str, tuple[str, list[str]]]:
    """``{member: (packed name, members in order)}`` from the model's ``packed_modules_mapping``."""
    packed = getattr(model, "packed_modules_mapping", None) or {}
    return {m: (name, list(members)) for name, members in packed.items() for m in members}


def place(name: str, shapes: Mapping[str, tuple[int, ...]], params: Mapping[str, torch.Tensor],
          members: Mapping[str, tuple[str, list[str]]]) -> torch.Tensor | None:
    """The view of ``params`` that HF tensor ``name`` (of shape ``shapes[name]``) fills, or None when its place
    is not a plain slice (other shapes: sharded, padded, transposed, quantized ...)."""
    shape = tuple(shapes[name])
    param = params.get(name)
    if param is not None:
        return param.data if tuple(param.shape) == shape else None
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part not in members:
            continue
        packed, order = members[part]
        siblings = [".".join(parts[:i] + [m] + parts[i + 1:]) for m in order]
        dst = params.get(".".join(parts[:i] + [packed] + parts[i + 1:]))
        if dst is None or not all(s in shapes for s in siblings):
            return None
        sizes = [tuple(shapes[s])[0] for s in siblings]
        if sum(sizes) != dst.shape[0] or any(tuple(shapes[s])[1:] != tuple(dst.shape[1:]) for s in siblings):
            return None
        pos = order.index(part)
        return dst.data.narrow(0, sum(sizes[:pos]), sizes[pos])
    return None


def checksum(tensor: torch.Tensor) -> float:
    """Fingerprint of a tensor's values and their order: the fp64 sum of the values weighted by position."""
    t = tensor.detach().double().reshape(-1)
    weights = torch.arange(1, t.numel() + 1, dtype=torch.float64, device=t.device) / max(t.numel(), 1)
    return float((t * weights).sum())


@dataclass
class SplitBucket:
    """A bucket as the plan sees it: the placed pairs (names, destination views, sources on the destinations'
    device) and the pairs ``load_weights`` must take."""

    names: tuple[str, ...]
    dsts: list[torch.Tensor]
    srcs: list[torch.Tensor]
    rest: WeightBucket


@dataclass
class CopyPlan:
    """HF name -> destination view, built from the names/shapes of one full update."""

    views: dict[str, torch.Tensor]
    unplaced: list[str] = field(default_factory=list)

    @classmethod
    def build(cls, model: nn.Module, shapes: Mapping[str, tuple[int, ...]]) -> CopyPlan:
        params = dict(model.named_parameters())
        members = _packed_members(model)
        views, unplaced = {}, []
        for name in shapes:
            view = place(name, shapes, params, members)
            if view is None:
                unplaced.append(name)
            else:
                views[name] = view
        return cls(views, unplaced)

    def verify(self, expected: Mapping[str, float]) -> list[str]:
        """Names whose destination does not hold what ``load_weights`` wrote (``expected``: ``checksum`` of
        each source cast to the destination dtype). Empty when the plan is right."""
        return [name for name, view in self.views.items()
                if name in expected and checksum(view) != expected[name]]

    def split(self, bucket: Iterable[tuple[str, torch.Tensor]]) -> SplitBucket:
        """The bucket's placed pairs and the rest. A tensor whose shape is not its view's (not the update the
        plan was made for) goes to the rest, never into the model."""
        names, dsts, srcs, rest = [], [], [], []
        for name, tensor in bucket:
            view = self.views.get(name)
            if view is None or view.shape != tensor.shape:
                rest.append((name, tensor))
                continue
            names.append(name)
            dsts.append(view)
            srcs.append(tensor if tensor.device == view.device else tensor.to(view.device, non_blocking=True))
        return SplitBucket(tuple(names), dsts, srcs, rest)

    def copy(self, bucket: Iterable[tuple[str, torch.Tensor]], graphs: GraphedCopies | None = None) -> WeightBucket:
        """Copy the placed tensors of ``bucket`` (one fused multi-tensor copy, casting; replayed from a CUDA
        graph when ``graphs`` has one for it); return the rest."""
        split = self.split(bucket)
        if split.srcs:
            if graphs is None:
                torch._foreach_copy_(split.dsts, split.srcs)
            else:
                graphs.copy(copy_key(split.names, split.dsts, split.srcs), split.dsts, split.srcs)
        return split.rest


def copy_key(names: tuple[str, ...], dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> Hashable | None:
    """What a recorded copy depends on: the names and, for each pair, both addresses and the source dtype
    (the destinations' shapes and dtypes follow from the names). None unless every tensor is on one CUDA
    device (a graph cannot read host memory)."""
    if not dsts or len(names) != len(dsts) or not dsts[0].is_cuda:
        return None
    device = dsts[0].get_device()
    if any(src.get_device() != device for src in srcs):
        return None
    return (names, tuple(d.data_ptr() for d in dsts), tuple(s.data_ptr() for s in srcs),
            tuple(s.dtype for s in srcs))


class GraphedCopies:
    """One CUDA graph per bucket of the planned copies, keyed by ``copy_key``.

    A bucket whose key was not seen at the previous update is copied eagerly; one that was is recorded (once)
    and replayed. ``end_update`` closes an update: only the keys seen in it are kept, so what is held is
    bounded by one update's buckets whatever the exporter does (moving addresses only cost eager copies).
    Any capture failure turns recording off for good (eager copies are always correct). ``stats`` counts what
    happened."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._previous: dict[Hashable, Any] = {}  # key -> its graph (None: seen, not recorded yet)
        self._current: dict[Hashable, Any] = {}
        self.stats = {"eager": 0, "captured": 0, "replayed": 0, "failed": 0}

    def copy(self, key: Hashable | None, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        if not self.enabled or key is None:
            torch._foreach_copy_(dsts, srcs)
            self.stats["eager"] += 1
            return
        graph = self._current.get(key, self._previous.get(key))
        if graph is None and key in self._previous:  # the same bucket as at the previous update: record it
            graph = self._capture(dsts, srcs)
        if graph is None:
            torch._foreach_copy_(dsts, srcs)
            self.stats["eager"] += 1
        else:
            graph.replay()
            self.stats["replayed"] += 1
        self._current[key] = graph

    def end_update(self) -> None:
        """The update is complete: keep what its buckets need for the next one, drop the rest."""
        self._previous, self._current = self._current, {}

    def _capture(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> Any:
        """A graph of the bucket's copies, or None (recording off for good) when capture fails."""
        try:
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                torch._foreach_copy_(dsts, srcs)
        except Exception as exc:  # noqa: BLE001 - recording is an optimisation: fall back, say why once
            self.enabled = False
            self.stats["failed"] += 1
            log.warning("recording the weight copies into a CUDA graph failed (%s); copying eagerly", exc)
            return None
        self.stats["captured"] += 1
        return graph
