"""Everything that touches SGLang itself, and so everything that may differ between its versions, in one place.

Written against SGLang 0.5.16 (the GPU host's; its torch pin matches the host's torch). The rest of the plugin
calls these functions and never imports SGLang. Differences handled here: ``ServerArgs`` fields that a version
lacks are dropped with a warning (e.g. ``cuda_graph_backend_prefill``, new in the 0.5 line), and a version
without the ``flattened_bucket`` load format falls back to one IPC handle per tensor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Iterator, Sequence
from functools import lru_cache
from typing import Any

import torch
from packaging.version import Version

from hybridrl_sglang.buckets import FlatEntry

log = logging.getLogger(__name__)

#: the oldest SGLang this plugin supports (the registration's ``requires`` says the same).
MIN_VERSION = Version("0.5.16")


@lru_cache(maxsize=1)
def version() -> Version:
    import sglang

    return Version(str(sglang.__version__).split("+")[0])


def check_version() -> None:
    if version() < MIN_VERSION:
        raise RuntimeError(f"hybridrl-sglang needs SGLang >= {MIN_VERSION}, found {version()}")


#: the newest version seen failing on float32 models (sgl-kernel's rmsnorm has no float32 path on CUDA).
NO_FLOAT32_UP_TO = Version("0.5.16")


def check_dtype(dtype: str) -> None:
    """Refuse a float32 engine where it is known to die in its first forward: on the H200, SGLang 0.5.16 with
    Triton attention failed with ``rmsnorm(...) failed to dispatch data type Float``. Newer versions may try."""
    if dtype in ("float32", "float") and version() <= NO_FLOAT32_UP_TO:
        raise RuntimeError(f"SGLang {version()} cannot run a float32 model on CUDA (its rmsnorm kernel has no "
                           "float32 path); set model.dtype to bfloat16 (or float16) for the SGLang rollout")


@lru_cache(maxsize=1)
def server_arg_names() -> frozenset[str]:
    """Field names of this version's ``ServerArgs`` (what ``sglang.Engine(**kwargs)`` accepts)."""
    try:
        from sglang.srt.server_args import ServerArgs

        return frozenset(f.name for f in dataclasses.fields(ServerArgs))
    except Exception:  # noqa: BLE001 - unknown layout: accept everything, SGLang will complain itself
        return frozenset()


@contextlib.contextmanager
def _visible_devices(devices: str | None) -> Iterator[None]:
    """Set ``CUDA_VISIBLE_DEVICES`` while the engine starts its scheduler processes (they inherit it)."""
    if devices is None:
        yield
        return
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = devices
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old


#: ``model_type`` of checkpoints whose SGLang (0.5.16) model always has a head of its own: it loads
#: ``lm_head.weight`` and ignores ``tie_word_embeddings``, so a tied checkpoint (which saves no head) would
#: generate from an uninitialised head while routing and every layer below it look right.
UNTIED_HEAD_ONLY = ("qwen3_moe",)


def check_architecture(text_config: Any, model_path: str) -> None:
    """Refuse, before the engine starts, a checkpoint SGLang's model for it would load wrongly."""
    model_type = str(getattr(text_config, "model_type", "")).lower()
    if model_type in UNTIED_HEAD_ONLY and getattr(text_config, "tie_word_embeddings", False):
        raise ValueError(f"model.path: '{model_path}' is a {model_type} checkpoint with tie_word_embeddings, which "
                         f"SGLang's {model_type} model ignores (it loads lm_head.weight, which a tied "
                         "checkpoint does not hold): untie the head, or use roles.rollout.backend=vllm")


def start_engine(kwargs: dict[str, Any], visible_devices: str | None = None) -> Any:
    """``sglang.Engine(**kwargs)`` in this process (its scheduler and detokenizer run as child processes)."""
    from hybridrl_sglang.options import split_known

    accepted, dropped = split_known(kwargs, server_arg_names())
    if dropped:
        log.warning("SGLang %s has no server argument(s) %s; starting without them", version(), ", ".join(dropped))
    import sglang

    with _visible_devices(visible_devices):
        return sglang.Engine(**accepted)


def current_device() -> torch.device:
    """The GPU of this process (the buffers handed to the schedulers live there)."""
    return torch.device("cuda", torch.cuda.current_device())


def synchronize() -> None:
    """Finish this process's pending copies before another process reads the memory."""
    torch.cuda.current_stream().synchronize()


def ipc_collect() -> None:
    """Free buffers the schedulers have released (torch keeps shared CUDA blocks until then)."""
    torch.cuda.ipc_collect()


def generate(engine: Any, input_ids: list[list[int]], sampling_params: list[dict[str, Any]],
             top_logprobs: int = 0, logprobs: bool = True, routing: bool = False) -> list[dict[str, Any]]:
    """One batched request, results in the order of ``input_ids``, with the sampled tokens' log-probs unless
    ``logprobs`` is off (computing them costs the sampler a full log-softmax per token); ``routing``: each fed
    token's experts too (``meta_info["routed_experts"]``, an engine started to record them)."""
    kwargs: dict[str, Any] = {"input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": logprobs}
    if top_logprobs > 0:
        kwargs["top_logprobs_num"] = int(top_logprobs)
    if routing:
        kwargs["return_routed_experts"] = True
    out = engine.generate(**kwargs)
    return [out] if isinstance(out, dict) else list(out)


async def async_generate(engine: Any, input_ids: list[int], sampling_params: dict[str, Any], top_logprobs: int = 0,
                         logprobs: bool = True) -> dict[str, Any]:
    """One request through ``Engine.async_generate`` (awaited on the engine's loop, see ``run_on_loop``)."""
    kwargs: dict[str, Any] = {"input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": logprobs}
    if top_logprobs > 0:
        kwargs["top_logprobs_num"] = int(top_logprobs)
    out = await engine.async_generate(**kwargs)
    return out[0] if isinstance(out, list) else out


def run_on_loop(engine: Any, coroutine: Any) -> Any:
    """Run a coroutine on the event loop the engine made at start (its tokenizer manager's), as its own
    ``generate`` does."""
    return engine.loop.run_until_complete(coroutine)


def context_length(engine: Any) -> int | None:
    manager = getattr(engine, "tokenizer_manager", None)
    value = getattr(manager, "context_len", None)
    return int(value) if value else None


def device_memory() -> tuple[int, int]:
    """(free, total) bytes of this process's GPU, all processes counted (the schedulers' too)."""
    free, total = torch.cuda.mem_get_info()
    return int(free), int(total)


def pool_tokens(engine: Any) -> int | None:
    """Tokens the engine's KV pool holds (``max_total_num_tokens`` of its first scheduler; None: unknown)."""
    try:
        return int(engine._scheduler_init_result.scheduler_infos[0]["max_total_num_tokens"])
    except (AttributeError, IndexError, KeyError, TypeError, ValueError):
        return None


def release(engine: Any, tags: Sequence[str]) -> None:
    if tags:
        engine.release_memory_occupation(tags=list(tags))


def resume(engine: Any, tags: Sequence[str]) -> None:
    """Resume one tag per call, in the order given (weights before the KV cache)."""
    for tag in tags:
        engine.resume_memory_occupation(tags=[tag])


def flush_cache(engine: Any) -> None:
    engine.flush_cache()


def _check(result: Any, what: str) -> None:
    """SGLang's update calls answer ``(success, message)`` (or an object with those fields)."""
    if isinstance(result, tuple) and result:
        ok, message = bool(result[0]), (result[1] if len(result) > 1 else "")
    else:
        ok, message = bool(getattr(result, "success", True)), getattr(result, "message", "")
    if not ok:
        raise RuntimeError(f"SGLang {what} failed: {message}")


@lru_cache(maxsize=1)
def supports_flattened_bucket() -> bool:
    try:
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata  # noqa: F401
    except ImportError:
        return False
    return bool(getattr(FlattenedTensorBucket, "supports_multi_dtypes", False))


def _serializer() -> Any:
    """SGLang's serializer, with torch's CUDA-IPC reductions patched to name devices by UUID (so a scheduler
    that numbers GPUs differently opens the right one); must be applied before serialising."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    monkey_patch_torch_reductions()
    return MultiprocessingSerializer


def update_flat(engine: Any, flat: torch.Tensor, entries: Sequence[FlatEntry], tp_size: int) -> None:
    """Load one flattened bucket into every tensor-parallel rank of the engine (CUDA IPC, no copy here)."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

    metadata = [FlattenedTensorMetadata(name=e.name, shape=torch.Size(e.shape), dtype=e.dtype, start_idx=e.start,
                                        end_idx=e.end, numel=e.numel) for e in entries]
    payload = _serializer().serialize({"flattened_tensor": flat, "metadata": metadata})
    result = engine.update_weights_from_tensor(named_tensors=[payload] * int(tp_size),
                                               load_format="flattened_bucket", flush_cache=False)
    _check(result, "update_weights_from_tensor (flattened_bucket)")


def update_tensors(engine: Any, named: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Fallback: one IPC handle per tensor (versions without the flattened format)."""
    _serializer()
    result = engine.update_weights_from_tensor(named_tensors=list(named), flush_cache=False)
    _check(result, "update_weights_from_tensor")


def shutdown(engine: Any) -> None:
    """Stop the engine's processes (SGLang kills the child processes of this process)."""
    engine.shutdown()


# --- split mode: SGLang's own weight-update group (``hybridrl_sglang.distributed``) ---------------------------
def init_update_group(engine: Any, host: str, port: int, rank_offset: int, world_size: int, group_name: str,
                      backend: str) -> None:
    result = engine.init_weights_update_group(master_address=host, master_port=int(port), rank_offset=int(rank_offset),
                                              world_size=int(world_size), group_name=group_name, backend=backend)
    _check(result, "init_weights_update_group")


def update_from_distributed(engine: Any, entries: Sequence[tuple[str, str, list[int]]], group_name: str) -> None:
    """Receive one bucket broadcast from rank 0 of the group, in SGLang's flattened layout."""
    names = [n for n, _, _ in entries]
    dtypes = [d for _, d, _ in entries]
    shapes = [list(s) for _, _, s in entries]
    result = engine.update_weights_from_distributed(names=names, dtypes=dtypes, shapes=shapes, group_name=group_name,
                                                    flush_cache=False, load_format="flattened_bucket")
    _check(result, "update_weights_from_distributed")


def destroy_update_group(engine: Any, group_name: str) -> None:
    with contextlib.suppress(Exception):
        engine.destroy_weights_update_group(group_name=group_name)
