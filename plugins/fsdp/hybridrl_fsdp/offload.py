"""Moving a train engine's state to host memory while other roles use the device, and back (``options.offload``).

``HostCopy`` holds a set of tensors whose *storage* goes to host memory: the bytes are copied into host
buffers (pinned when the device is a GPU, allocated once, exactly the size asked, and reused: ``host_buffer``),
then the device storage is resized to
nothing; coming back, it is resized and the bytes copied in. The tensor objects themselves never change, so
every view of them (FSDP2's DTensor shards are views of a padded flat buffer, AdamW's moments are looked up by
parameter) stays valid; only their device addresses may differ after ``onload``. The same code runs on a CPU
engine, where the "device" storage is host memory too (a CPU run has nothing to gain from it, but the moves
are real and tested there).

``OffloadPolicy`` says what an engine keeps off the device between its phases: ``none``; ``optimizer`` (the
AdamW moments, streamed through the device one param group at a time for the optimizer step); ``all`` (the
moments and the weights: a frozen role's weights come back for its forward passes only, a trained role's for
its update and the weight export that follows it).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch

MODES = ("none", "optimizer", "all")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor holding the data: a DTensor's local shard, else the tensor itself."""
    local = getattr(tensor, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else tensor


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A 1-D uint8 tensor over the whole of ``storage``."""
    out = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return out.set_(storage, 0, (storage.nbytes(),), (1,))


def host_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """A host byte buffer of exactly ``nbytes``, page-locked when ``pin`` (asynchronous copies to and from a GPU).

    Not ``torch.empty(..., pin_memory=True)``: PyTorch's pinned allocator rounds every request up to a power of
    two, so a 7B model's AdamW moments (56.7 GiB, tensors of 272 MB rounded to 512 MB) would take about 110 GiB;
    the 7B run on a 125 GiB host lost its worker to the kernel while it loaded. A plain allocation registered
    with CUDA is pinned at its own size; it is unregistered when the buffer is collected."""
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    if not pin or nbytes == 0:
        return buffer
    cudart = torch.cuda.cudart()
    pointer = buffer.data_ptr()
    error = cudart.cudaHostRegister(pointer, nbytes, 1)  # cudaHostRegisterPortable
    if int(error) != 0:  # registration refused (a locked-memory limit): PyTorch's pinned allocator, rounded up
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    weakref.finalize(buffer, cudart.cudaHostUnregister, pointer)
    return buffer


class HostCopy:
    """The storages of ``tensors`` (each once, however many tensors view it), movable to host memory and back."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        self._holders: list[torch.Tensor] = []
        seen: set[int] = set()
        for tensor in tensors:
            local = _local(tensor)
            storage = local.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            self._holders.append(local)
        self._host: list[torch.Tensor | None] = [None] * len(self._holders)
        self._sizes = [t.untyped_storage().nbytes() for t in self._holders]
        self.on_device = True

    @property
    def nbytes(self) -> int:
        return sum(self._sizes)

    def _device(self) -> torch.device | None:
        return self._holders[0].device if self._holders else None

    def offload(self) -> None:
        """Copy the bytes to host buffers, then release the device storage."""
        if not self.on_device or not self._holders:
            self.on_device = False
            return
        pin = self._device().type == "cuda"
        for i, holder in enumerate(self._holders):
            if self._host[i] is None:
                self._host[i] = host_buffer(self._sizes[i], pin)
            self._host[i].copy_(_bytes_of(holder.untyped_storage()), non_blocking=pin)
        _synchronize(self._device())
        for holder in self._holders:
            holder.untyped_storage().resize_(0)
        self.on_device = False

    def onload(self) -> None:
        """Give the storages their size back and copy the bytes in."""
        if self.on_device:
            return
        pin = self._device() is not None and self._device().type == "cuda"
        for i, holder in enumerate(self._holders):
            storage = holder.untyped_storage()
            storage.resize_(self._sizes[i])
            _bytes_of(storage).copy_(self._host[i], non_blocking=pin)
        _synchronize(self._device())
        self.on_device = True


def _synchronize(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


@dataclass
class OffloadPolicy:
    """What one engine keeps off the device between its phases, and the copies that do it."""

    mode: str
    weights: HostCopy | None = None
    optimizer_groups: list[HostCopy] | None = None

    @property
    def optimizer(self) -> bool:
        return self.mode in ("optimizer", "all") and self.optimizer_groups is not None

    @classmethod
    def build(cls, mode: str, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer | None,
              optimizer_groups: list[HostCopy] | None = None) -> OffloadPolicy:
        """The copies for ``mode`` over the engine's parameters and its optimizer's state (which must exist:
        the engine creates it at start; ``optimizer_groups``: copies already made, one per param group).
        Nothing is moved here."""
        if mode not in MODES:
            raise ValueError(f"offload must be one of {MODES}, got {mode!r}")
        policy = cls(mode)
        if mode == "all":
            policy.weights = HostCopy(params)
        if mode in ("optimizer", "all") and optimizer is not None:
            policy.optimizer_groups = optimizer_groups if optimizer_groups is not None else [
                HostCopy(optimizer_state_tensors(optimizer, group)) for group in optimizer.param_groups]
        return policy

    def release_weights(self) -> None:
        if self.weights is not None:
            self.weights.offload()

    def ensure_weights(self) -> None:
        if self.weights is not None:
            self.weights.onload()

    def release_optimizer(self) -> None:
        for group in self.optimizer_groups or ():
            group.offload()

    def ensure_optimizer(self) -> None:
        for group in self.optimizer_groups or ():
            group.onload()


def optimizer_state_tensors(optimizer: torch.optim.Optimizer, group: dict) -> list[torch.Tensor]:
    """The per-parameter state tensors of one param group (AdamW's moments; the CPU ``step`` counters stay)."""
    return [value for param in group["params"] for key, value in optimizer.state.get(param, {}).items()
            if isinstance(value, torch.Tensor) and key != "step"]


def step_group_by_group(optimizer: torch.optim.Optimizer, groups: list[HostCopy]) -> None:
    """``optimizer.step()`` with each param group's state brought to the device just for its own step: the
    device holds one group's moments at a time (the same arithmetic as one step over all groups: AdamW's
    update of a parameter reads only that parameter's state)."""
    all_groups = optimizer.param_groups
    try:
        for group, copy in zip(all_groups, groups):
            copy.onload()
            optimizer.param_groups = [group]
            optimizer.step()
            optimizer.param_groups = all_groups
            copy.offload()
    finally:
        optimizer.param_groups = all_groups
