"""What megatron-core needs to run on a CPU-only PyTorch build, supplied at run time inside this plugin.

megatron-core is written for CUDA. With ``use_cpu_initialization=True`` and the local (non-Transformer-Engine)
layer spec most of it is device-agnostic, but a few places still talk to CUDA directly:

* ``torch.cuda.current_device()`` picks the device of tensors made in forward/backward (tensor-parallel
  all-gathers, rotary frequencies, pipeline shape exchange) -> answers ``torch.device("cpu")``.
* ``torch.cuda.synchronize()`` after pipeline sends/receives -> a no-op (CPU ops are synchronous).
* literal ``device="cuda"`` / ``Tensor.cuda()`` (the schedules' token counter, the first/last-stage copy of
  tied embeddings under pipeline parallelism) -> redirected to the CPU by a ``TorchFunctionMode``.
* the CUDA RNG tracker (``tensor_parallel.get_cuda_rng_tracker``, forked around dropout) -> a tracker of
  CPU generator states with the same names and seeds.
* the MoE router's Transformer Engine GEMM, a name left unbound without Transformer Engine
  (``install_moe_fallbacks``).

Nothing in megatron-core is edited or patched on disk: the stand-ins are installed while ``cpu_megatron()``
is entered (re-entrant; the engine enters it around every call) and removed when the outermost block
exits, so code outside the engine sees the real ``torch.cuda``. The RNG tracker is process state of
Megatron's own module (``tensor_parallel.random``) and is installed once per process by ``install_rng_tracker``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_lock = threading.RLock()
_depth = 0
_saved: dict[str, Any] = {}


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


class _CudaToCpu(TorchFunctionMode):
    """Sends tensors that megatron-core asks for on ``"cuda"`` to the CPU instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        device = kwargs.get("device")
        if device is not None and (_is_cuda(device) or isinstance(device, int)):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and args and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _current_device() -> torch.device:
    return torch.device("cpu")


def _synchronize(device: Any = None) -> None:
    return None


@contextlib.contextmanager
def cpu_megatron() -> Iterator[None]:
    """Run the enclosed megatron-core code on the CPU (see the module docstring)."""
    global _depth
    with _lock:
        if _depth == 0:
            _saved["current_device"] = torch.cuda.current_device
            _saved["synchronize"] = torch.cuda.synchronize
            torch.cuda.current_device = _current_device  # type: ignore[assignment]
            torch.cuda.synchronize = _synchronize  # type: ignore[assignment]
        _depth += 1
    try:
        with _CudaToCpu():
            yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                torch.cuda.current_device = _saved.pop("current_device")  # type: ignore[assignment]
                torch.cuda.synchronize = _saved.pop("synchronize")  # type: ignore[assignment]


def maybe_cpu(device_type: str) -> contextlib.AbstractContextManager[None]:
    """``cpu_megatron()`` on the CPU, nothing on CUDA."""
    return cpu_megatron() if device_type == "cpu" else contextlib.nullcontext()


def install_rng_tracker(seed: int, tp_rank: int) -> None:
    """Give Megatron's tracker CPU generator states, seeded like ``model_parallel_cuda_manual_seed`` seeds
    the CUDA ones (data-parallel: ``seed``; tensor-parallel: ``seed + 2718 + tp_rank``; expert: ``seed + 1024``)."""
    from megatron.core.tensor_parallel import random as mrandom

    tracker = CpuRNGStatesTracker()
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024)
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


class CpuRNGStatesTracker:
    """Megatron's RNG tracker interface (``add``/``fork``/``get_states``/``set_states``/``reset``) over CPU
    generator states: ``fork(name)`` swaps the default CPU generator to that named stream and back."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._is_initialized = False

    def is_initialized(self) -> bool:
        return self._is_initialized

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_ or name in self.states_:
            raise RuntimeError(f"RNG state '{name}' or seed {seed} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise RuntimeError(f"RNG state '{name}' is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def install_moe_fallbacks() -> None:
    """megatron-core 0.16's MoE router reads the name ``te_general_gemm`` that its ``moe_utils`` binds only when
    Transformer Engine imports; without Transformer Engine (the local spec, every CPU run) the router's
    forward fails on the missing name. Binding it to None selects the plain ``torch.mm`` path the router
    already has for that case. Process state of Megatron's own module, set once, as ``install_rng_tracker``."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
