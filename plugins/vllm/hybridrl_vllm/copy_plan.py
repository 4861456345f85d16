"""Direct weight copies into vLLM's live parameters (engine-free: works on any ``nn.Module``).

``model.load_weights`` resolves every incoming tensor by name through Python (stacked-parameter tables,
per-parameter ``weight_loader``s): for a 0.5B model that is ~300 small calls and some 60 ms per sync, against
about 1 ms for one device copy of the same bytes. Where vLLM keeps the checkpoint's layout (unquantized, one
tensor-parallel rank, CUDA), the place of each Hugging Face tensor is a fixed slice of one parameter: the
parameter of the same name, or a slice along dim 0 of a packed one (``qkv_proj`` <- q, k, v;
``gate_up_proj`` <- gate, up, in the model's ``packed_modules_mapping`` order). A ``CopyPlan`` maps each name
to that slice once, is checked against what ``load_weights`` actually wrote (``verify``), and afterwards a
bucket is one ``torch._foreach_copy_`` (casting on the fly), with ``load_weights`` only for names it could
not place.

Even fused, ~300 copies cost more in launches than in bytes at this size. On CUDA, ``GraphedCopies`` records
a bucket's copies into a CUDA graph the second time the same bucket (same names at the same source and
destination addresses) arrives and replays it from then on: one launch per bucket. The addresses are stable:
a colocated trainer updates its parameters in place, and vLLM's sleep maps the weights back at the same
virtual addresses. Which kernels the graph holds is measured, not assumed: the multi-tensor copy launches
few kernels but moves a large matrix in small fixed chunks, a plain copy streams one tensor at full width,
the fused Triton kernel (``fused_copy``) covers every tensor of the bucket in one grid; the bucket is recorded
in each of ``COPY_LAYOUTS`` that applies and the one that replays fastest on this device is kept (on an H200,
the fused kernel for the 0.5B model's buckets of many tensors: 0.72 ms for all of them against 0.86 ms).

Working out a bucket's key (names, addresses, dtypes: ~1 us a tensor in Python's C calls) is itself host
work the device waits for between buckets. A bucket the exporter hands out again as the same object
(``ReusedBucket``: FSDP's kept views of its live shards) is known by identity once its graph exists: the
same items, their tensors at the same addresses, and its graph is replayed at once.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass, field
from functools import partial
from operator import attrgetter, is_, itemgetter
from typing import Any, Callable, Hashable, Iterable, Mapping

import torch
from torch import nn

from hybridrl_vllm import fused_copy

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
class CopyPlan:
    """HF name -> destination view, built from the names/shapes of one full update."""

    views: dict[str, torch.Tensor]
    unplaced: list[str] = field(default_factory=list)
    _layouts: dict[tuple[str, ...], "_Layout"] = field(default_factory=dict, repr=False)

    MAX_LAYOUTS = 256  # buckets of ever new name lists (an exporter without a fixed order) must not pile up

    @classmethod
    def build(cls, model: nn.Module, shapes: Mapping[str, tuple[int, ...]]) -> "CopyPlan":
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

    def split(self, bucket: Iterable[tuple[str, torch.Tensor]]
              ) -> tuple[list[torch.Tensor], list[torch.Tensor], WeightBucket, tuple[str, ...]]:
        """(destinations, sources, rest, placed names) of a bucket: the placed pairs, what ``load_weights``
        must take, and the names of the pairs in order. Which name goes where is worked out once per bucket
        layout (the same names in the same order: a trainer exports the same buckets every update) and kept."""
        layout, srcs, rest = self._split(list(bucket))
        return layout.dsts, srcs, rest, layout.names

    def _split(self, bucket: list[tuple[str, torch.Tensor]]) -> tuple["_Layout", list[torch.Tensor], WeightBucket]:
        # Runs for every bucket of every update, ~300 tensors a sync: per-tensor work stays in C (map over
        # itemgetters and tensor methods), about a quarter of a Python loop's cost.
        names = tuple(map(_NAME, bucket))
        layout = self._layouts.get(names)
        if layout is None:
            layout = self._layout(bucket, names)
        srcs = list(map(_TENSOR, bucket)) if not layout.rest else [bucket[i][1] for i in layout.placed]
        if list(map(_SHAPE, srcs)) != layout.shapes:  # not the layout it was made for
            layout = self._layout(bucket, names, keep=False)
            srcs = [bucket[i][1] for i in layout.placed]
        if srcs and set(map(torch.Tensor.get_device, srcs)) != {layout.device_index}:
            srcs = [src if src.device == dst.device else src.to(dst.device, non_blocking=True)
                    for src, dst in zip(srcs, layout.dsts)]
        return layout, srcs, [bucket[i] for i in layout.rest]

    def _layout(self, bucket: list[tuple[str, torch.Tensor]], names: tuple[str, ...], keep: bool = True) -> "_Layout":
        placed, rest = [], []
        for i, (name, tensor) in enumerate(bucket):
            view = self.views.get(name)
            (rest if view is None or view.shape != tensor.shape else placed).append(i)
        dsts = [self.views[bucket[i][0]] for i in placed]
        layout = _Layout(placed, rest, dsts, tuple(bucket[i][0] for i in placed), [d.shape for d in dsts],
                         tuple(map(_DATA_PTR, dsts)), dsts[0].get_device() if dsts else -1)
        if keep:
            if len(self._layouts) >= self.MAX_LAYOUTS:
                self._layouts.clear()
            self._layouts[names] = layout
        return layout

    def copy(self, bucket: Iterable[tuple[str, torch.Tensor]], graphs: "GraphedCopies | None" = None) -> WeightBucket:
        """Copy the placed tensors of ``bucket`` (one fused multi-tensor copy, casting; replayed from a CUDA
        graph when ``graphs`` has one for it, at once when it knows the bucket by identity); return the rest."""
        if graphs is not None and graphs.replay_reused(bucket):
            return []
        items = bucket if isinstance(bucket, list) else list(bucket)
        layout, srcs, rest = self._split(items)
        if not srcs:
            return rest
        if graphs is None:
            torch._foreach_copy_(layout.dsts, srcs)
        else:  # ``_split`` put every source on the destinations' device already
            key = _key(layout.names, layout.dst_ptrs, srcs) if layout.dsts[0].is_cuda else None
            graphs.copy(key, layout.dsts, srcs)
            if key is not None:
                graphs.remember_reused(items, srcs, key)
        return rest


_NAME, _TENSOR = itemgetter(0), itemgetter(1)
_SHAPE, _DTYPE = attrgetter("shape"), attrgetter("dtype")
_DATA_PTR = torch.Tensor.data_ptr


@dataclass
class _Layout:
    """Where the tensors of one bucket layout go: positions placed by the plan (and their views, shapes,
    addresses, device index: -1 for the host) and positions left to ``load_weights``."""

    placed: list[int]
    rest: list[int]
    dsts: list[torch.Tensor]
    names: tuple[str, ...]
    shapes: list[torch.Size]
    dst_ptrs: tuple[int, ...]
    device_index: int = -1


#: How a bucket's copies can be laid out in kernels: all in one multi-tensor copy; tensors of at least
#: ``LARGE_COPY_NUMEL`` values each in a copy of its own and the rest in one multi-tensor copy; every tensor
#: in a copy of its own; all in one grid of one Triton kernel (``fused_copy``: CUDA, contiguous pairs).
COPY_LAYOUTS = ("multi_tensor", "large_alone", "per_tensor", "fused")
LARGE_COPY_NUMEL = 1 << 20


def copier(dsts: list[torch.Tensor], srcs: list[torch.Tensor], layout: str = "multi_tensor") -> Callable[[], None]:
    """A call that does ``dst.copy_(src)`` for every pair (casting) in the kernels ``layout`` names; the values
    written do not depend on it. The host work a layout needs (the fused kernel's tables) is done here, so the
    call only launches kernels and can be recorded in a CUDA graph once it has run (Triton compiles then)."""
    if layout == "multi_tensor":
        return partial(torch._foreach_copy_, dsts, srcs)
    if layout == "per_tensor":
        return partial(_copy_each, dsts, srcs)
    if layout == "large_alone":
        large = [i for i, src in enumerate(srcs) if src.numel() >= LARGE_COPY_NUMEL]
        small = [i for i, src in enumerate(srcs) if src.numel() < LARGE_COPY_NUMEL]
        plain = partial(_copy_each, [dsts[i] for i in large], [srcs[i] for i in large])
        if not small:
            return plain
        multi = partial(torch._foreach_copy_, [dsts[i] for i in small], [srcs[i] for i in small])
        return lambda: (plain(), multi())
    if layout == "fused":
        return fused_copy.FusedCopy(dsts, srcs)
    raise ValueError(f"unknown copy layout {layout!r}; one of {COPY_LAYOUTS}")


def _copy_each(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    for dst, src in zip(dsts, srcs):
        dst.copy_(src)


def copy_tensors(dsts: list[torch.Tensor], srcs: list[torch.Tensor], layout: str = "multi_tensor") -> None:
    """``dst.copy_(src)`` for every pair (casting), in the kernels ``layout`` names, at once."""
    copier(dsts, srcs, layout)()


def distinct_layouts(srcs: list[torch.Tensor], dsts: list[torch.Tensor] | None = None) -> tuple[str, ...]:
    """The layouts of ``COPY_LAYOUTS`` that launch different kernels for these sources (no tensor large
    enough: ``large_alone`` is ``multi_tensor``; all large: it is ``per_tensor``). One tensor still has two:
    the multi-tensor copy cuts it into fixed chunks over several kernels, a plain copy is one. ``fused`` only
    with ``dsts`` given and every pair fit for it (``fused_copy.supports``)."""
    if not srcs:
        return ("multi_tensor",)
    large = sum(1 for src in srcs if src.numel() >= LARGE_COPY_NUMEL)
    layouts = ("multi_tensor", "per_tensor") if large in (0, len(srcs)) else ("multi_tensor", "large_alone", "per_tensor")
    if dsts is not None and fused_copy.supports(dsts, srcs):
        layouts += ("fused",)
    return layouts


def copy_key(names: tuple[str, ...], dsts: list[torch.Tensor], srcs: list[torch.Tensor],
             dst_ptrs: tuple[int, ...] | None = None) -> Hashable | None:
    """What a recorded copy depends on: the names and, for each pair, both addresses and the source dtype
    (the destinations' shapes and dtypes follow from the names). None unless every tensor is on one CUDA
    device (a graph cannot read host memory). ``dst_ptrs``: the destinations' addresses when known."""
    if not dsts or len(names) != len(dsts) or not dsts[0].is_cuda:
        return None
    if set(map(torch.Tensor.get_device, srcs)) != {dsts[0].get_device()}:
        return None
    return _key(names, dst_ptrs if dst_ptrs is not None else tuple(map(_DATA_PTR, dsts)), srcs)


def _key(names: tuple[str, ...], dst_ptrs: tuple[int, ...], srcs: list[torch.Tensor]) -> Hashable:
    return names, dst_ptrs, tuple(map(_DATA_PTR, srcs)), tuple(map(_DTYPE, srcs))


class GraphedCopies:
    """Per-bucket CUDA graphs of a bucket's copies (``copy_tensors``), keyed by ``copy_key``.

    A key seen for the first time is copied eagerly and remembered; the second time it is recorded in each
    distinct layout, the fastest to replay is kept, and it is replayed from then on. Any capture failure turns
    recording off for good (eager copies are always correct). A ``ReusedBucket`` whose copies have a graph is
    remembered by identity (``remember_reused``), weakly, and replayed without its key (``replay_reused``).
    ``stats`` counts what happened (``reused``: replays known by identity, also counted in ``replayed``), and
    how many kept graphs use each layout (``layout_<name>``)."""

    MAX_KEYS = 256  # unseen keys every update (fresh receive buffers) must not grow without bound
    MAX_GRAPHS = 64  # graphs of addresses that keep moving (a trainer offloaded between syncs) are dropped
    TIMING_ROUNDS = 3  # replays of each candidate when choosing (the copies are idempotent: same values)
    _fused_failed = False  # the fused kernel could not be built in this process: not tried again

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._graphs: dict[Hashable, Any] = {}
        self._seen: set[Hashable] = set()
        self._reused: dict[int, _Reused] = {}  # id(bucket) -> what it held when its graph was found
        self.stats = {"eager": 0, "captured": 0, "replayed": 0, "reused": 0, "failed": 0,
                      **{f"layout_{name}": 0 for name in COPY_LAYOUTS}}

    def remember_reused(self, bucket: list[tuple[str, torch.Tensor]], srcs: list[torch.Tensor], key: Hashable) -> None:
        """Know ``bucket`` by identity from now on, if it is a ``ReusedBucket`` (weakly referenceable: a
        plain list is made afresh per update), ``key`` has a graph, and the graph reads the bucket's own
        tensors (``srcs``: every one placed, none moved to another device first)."""
        graph = self._graphs.get(key)
        if graph is None or id(bucket) in self._reused:
            return
        if len(srcs) != len(bucket) or not all(map(is_, srcs, map(_TENSOR, bucket))):
            return
        try:
            ref = weakref.ref(bucket, partial(self._forget, id(bucket)))
        except TypeError:
            return
        self._reused[id(bucket)] = _Reused(ref, tuple(bucket), tuple(map(_DATA_PTR, srcs)), graph)

    def replay_reused(self, bucket: Any) -> bool:
        """Replay the graph of a remembered bucket that still holds the same items (names and tensor objects)
        at the same addresses; False (and forgotten) otherwise."""
        reused = self._reused.get(id(bucket))
        if reused is None or reused.ref() is not bucket:
            return False
        if (len(bucket) != len(reused.items) or not all(map(is_, bucket, reused.items))
                or tuple(map(_DATA_PTR, map(_TENSOR, bucket))) != reused.src_ptrs):
            del self._reused[id(bucket)]
            return False
        reused.graph.replay()
        self.stats["replayed"] += 1
        self.stats["reused"] += 1
        return True

    @property
    def remembered_buckets(self) -> int:
        """How many buckets are known by identity now."""
        return len(self._reused)

    def _forget(self, ident: int, ref: weakref.ref) -> None:
        """A remembered bucket was freed: drop its entry (and its references to the tensors)."""
        reused = self._reused.get(ident)
        if reused is not None and reused.ref is ref:
            del self._reused[ident]

    def copy(self, key: Hashable | None, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        graph = self._graphs.get(key) if key is not None else None
        if graph is not None:
            graph.replay()
            self.stats["replayed"] += 1
            return
        if self.enabled and key is not None and key in self._seen:
            try:
                layout, graph = self._capture(dsts, srcs)
            except Exception as exc:  # noqa: BLE001 - recording is an optimisation: fall back, say why once
                self.enabled = False
                self.stats["failed"] += 1
                log.warning("recording the weight copies into a CUDA graph failed (%s); copying eagerly", exc)
            else:
                if len(self._graphs) >= self.MAX_GRAPHS:
                    self._graphs.clear()
                    self._reused.clear()
                self._graphs[key] = graph
                graph.replay()
                self.stats["captured"] += 1
                self.stats[f"layout_{layout}"] += 1
                return
        torch._foreach_copy_(dsts, srcs)
        self.stats["eager"] += 1
        if self.enabled and key is not None:
            if len(self._seen) >= self.MAX_KEYS:
                self._seen.clear()
            self._seen.add(key)

    @classmethod
    def _capture(cls, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> tuple[str, Any]:
        """(layout, graph) of the fastest recording of these copies on this device. Each layout runs once
        before it is recorded (the copies are idempotent: the same values; Triton compiles then). A fused
        kernel that cannot be built here is left out, for good, and the other layouts still compete."""
        torch.cuda.synchronize()
        candidates = {}
        for layout in distinct_layouts(srcs, dsts):
            if layout == "fused" and cls._fused_failed:
                continue
            try:
                run = copier(dsts, srcs, layout)
                run()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - an optional kernel; say why once
                if layout != "fused":
                    raise
                cls._fused_failed = True
                log.warning("the fused copy kernel failed here (%s); choosing among the other layouts", exc)
                continue
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                run()
            # only the fused copy's tables must outlive the capture; the other calls hold the bucket's tensors,
            # which a kept graph must not keep alive (the fused copy holds no tensor of the pairs)
            candidates[layout] = graph if layout != "fused" else _Recorded(graph, run)
        if len(candidates) == 1:
            return next(iter(candidates.items()))
        best = fastest(candidates, cls.TIMING_ROUNDS)
        return best, candidates[best]


@dataclass
class _Recorded:
    """A graph together with what its kernels read besides the bucket's tensors (the fused copy's tables),
    which must live as long as it can be replayed."""

    graph: Any
    keep: Any

    def replay(self) -> None:
        self.graph.replay()


def fastest(graphs: Mapping[str, Any], rounds: int) -> str:
    """The name of the graph with the shortest replay, from the call to the end of its kernels: launching a
    graph of many multi-tensor kernels (each with kilobytes of arguments) takes host time a sync waits for too.
    Best of ``rounds``, taken in turns so that a slow moment of the device falls on every candidate alike."""
    best: dict[str, float] = {}
    for _ in range(rounds):
        for name, graph in graphs.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            graph.replay()
            torch.cuda.synchronize()
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - start)
    return min(best, key=best.__getitem__)


@dataclass
class _Reused:
    """A remembered ``ReusedBucket``: a weak reference to it, its items and their tensors' addresses when its
    graph was found, and the graph."""

    ref: weakref.ref
    items: tuple[tuple[str, torch.Tensor], ...]
    src_ptrs: tuple[int, ...]
    graph: Any

