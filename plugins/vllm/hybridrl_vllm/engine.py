"""``VLLMRollout``: the rollout engine on vLLM, in the host worker's own process.

One engine per tensor-parallel group of the pool (``parallel.ReplicaLayout``). The engine lives in the
process of the Ray worker that hosts the role (vLLM's in-process engine), so:

* colocated with the trainer (same pool, same process), weights go from the trainer's export straight into
  ``model.load_weights`` without a copy through the host, and the engine sleeps while the trainer works
  (``hybridrl_vllm.sleep`` decides the level and what each wake brings back);
* on its own pool (split), it receives buckets from the bridge (object store or collective broadcast) through
  the same ``import_weights``.

vLLM joins the process group the host made (gloo on CPU, NCCL on GPU) as an *external launcher*: each group of
``tensor_parallel`` consecutive ranks is one engine, the others are independent replicas.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import Iterator
from typing import Any

import torch

from hybridrl.engines import (
    DataParallelInfo,
    EngineContext,
    GeneratedTokens,
    NamedTensor,
    RolloutEngine,
    SamplingParams,
    WeightBucket,
)
from hybridrl.engines.batch import (
    FINISHED,
    GROUP_INDEX,
    PROMPT_IDS,
    PROMPT_MASK,
    Batch,
    groups_to_complete,
)
from hybridrl.engines.rollout_kit import (
    GroupCompletion,
    ReplicaLayout,
    attach_routing,
    check_context,
    engine_seed,
    pack_responses,
    row_caps,
    running_groups,
    special_ids,
    unpad_prompts,
)
from hybridrl_vllm import compat
from hybridrl_vllm import lora as vllm_lora
from hybridrl_vllm.copy_plan import CopyPlan, GraphedCopies, checksum
from hybridrl_vllm.options import (
    StartMemory,
    VLLMOptions,
    check_weight_load,
    llm_kwargs,
    resolve_weight_load,
    start_memory,
)
from hybridrl_vllm.packing import sampled_logprobs
from hybridrl_vllm.requests import RequestPump
from hybridrl_vllm.sampling import per_request_kwargs, resolve_seed_mode
from hybridrl_vllm.sleep import KV_CACHE, KV_ONLY, SleepState
from hybridrl_vllm.weights import tied_aliases, with_aliases

log = logging.getLogger(__name__)


# --- functions run inside vLLM's worker (``collective_rpc``) --------------------------------------------------
def _load_direct(worker: Any, bucket: WeightBucket) -> None:
    compat.worker_model(worker).load_weights(bucket)


def _load_and_record(worker: Any, bucket: WeightBucket) -> None:
    """``load_weights``, noting each tensor's shape and what it must look like in the model's dtype, from which
    ``_build_copy_plan`` then makes and checks the direct-copy plan."""
    model = compat.worker_model(worker)
    model.load_weights(bucket)
    dtype = next(model.parameters()).dtype
    seen = worker.__dict__.setdefault("_hybridrl_seen", {})
    for name, tensor in bucket:
        seen[name] = (tuple(tensor.shape), checksum(tensor.to(dtype)))


def _build_copy_plan(worker: Any, record_graphs: bool) -> dict[str, Any]:
    seen = worker.__dict__.pop("_hybridrl_seen", {})
    plan = CopyPlan.build(compat.worker_model(worker), {n: shape for n, (shape, _) in seen.items()})
    wrong = plan.verify({n: c for n, (_, c) in seen.items()})
    worker._hybridrl_copy_plan = None if wrong or not plan.views else plan
    worker._hybridrl_copy_graphs = GraphedCopies(enabled=record_graphs)
    return {"placed": len(plan.views), "unplaced": plan.unplaced, "wrong": wrong}


def _load_planned(worker: Any, bucket: WeightBucket) -> None:
    rest = worker._hybridrl_copy_plan.copy(bucket, worker._hybridrl_copy_graphs)
    if rest:
        compat.worker_model(worker).load_weights(rest)


def _end_planned_update(worker: Any) -> None:
    worker._hybridrl_copy_graphs.end_update()


def _copy_graph_stats(worker: Any) -> dict[str, int]:
    graphs = getattr(worker, "_hybridrl_copy_graphs", None)
    return dict(graphs.stats) if graphs is not None else {}


def _reload_begin(worker: Any) -> None:
    initialize, _ = compat.layerwise_reload()
    initialize(compat.worker_model(worker))


def _reload_end(worker: Any, model_config: Any) -> None:
    _, finalize = compat.layerwise_reload()
    model = compat.worker_model(worker)
    finalize(model, model_config)
    compat.prepack_cpu_experts(model)


class _RandomState:
    """Save and restore the process's global RNGs around engine construction: vLLM seeds them, and in our
    process they also drive the trainer."""

    def __enter__(self) -> _RandomState:
        self.py = random.getstate()
        self.torch = torch.random.get_rng_state()
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        self.cuda = torch.cuda.get_rng_state_all() if cuda else None
        try:
            import numpy as np

            self.np = np.random.get_state()
        except ImportError:
            self.np = None
        return self

    def __exit__(self, *exc: Any) -> None:
        random.setstate(self.py)
        torch.random.set_rng_state(self.torch)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        if self.np is not None:
            import numpy as np

            np.random.set_state(self.np)


class VLLMRollout(RolloutEngine):
    """Token-in/token-out generation on vLLM, with sleep/wake and bucketed weight import.

    ``ctx.options``: see ``hybridrl_vllm.options`` (``tensor_parallel``, ``gpu_memory_utilization``,
    ``sleep_level``, ``seed_mode``, ``weight_load``, ``engine_kwargs`` ...)."""

    def __init__(self, ctx: EngineContext) -> None:
        super().__init__(ctx)
        import torch.distributed as dist

        self.opts = VLLMOptions.from_options(ctx.options)
        self.layout = ReplicaLayout(ctx.rank, ctx.world_size, self.opts.tensor_parallel)
        distributed = dist.is_available() and dist.is_initialized()
        if ctx.world_size > 1 and not distributed:
            raise RuntimeError("VLLMRollout on several ranks needs the host's process group (init it first)")
        if distributed and dist.get_world_size() != ctx.world_size:
            raise RuntimeError(f"the process group has {dist.get_world_size()} ranks, the rollout pool "
                               f"{ctx.world_size}: vLLM must join a group of exactly its pool")
        self.device = "cuda" if str(ctx.device).startswith("cuda") else "cpu"
        check_weight_load(self.opts.weight_load, self.device)  # before the engine starts
        compat.prepare_process(self.device, ctx.rank, distributed)
        compat.check_version()
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(ctx.model_path)
        self.eos_ids, self.pad_id = special_ids(ctx.model_path, hf_config)
        #: LoRA with ``sync: adapter``: the engine serves the adapters each sync sends (``hybridrl_vllm.lora``)
        self.lora = (vllm_lora.AdapterSync(ctx.lora, ctx.model_path)
                     if ctx.lora is not None and ctx.lora.sends_adapters else None)
        sleep_level = vllm_lora.sleep_level(self.opts.sleep_level) if self.lora is not None else self.opts.sleep_level
        #: an MoE model's experts per fed token, recorded from the start when the run asks for them (resolved by
        #: the core: ``roles.rollout.return_routing``, auto with ``algorithm.routing_replay``)
        self.return_routing = ctx.options.get("return_routing") is True
        if self.return_routing and self.device != "cuda":
            raise ValueError("roles.rollout.return_routing: vLLM records routed experts in its GPU model runner "
                             "only; on CPU use roles.rollout.backend=hf")
        self.memory: StartMemory | None = self._start_memory(ctx) if self.device == "cuda" else None
        kwargs = llm_kwargs(self.opts, model_path=ctx.model_path, dtype=ctx.dtype, device=self.device,
                            seed=engine_seed(ctx.seed, self.layout.replica), distributed=distributed,
                            logprobs_kwargs=compat.logprobs_kwargs(), memory=self.memory,
                            return_routing=self.return_routing,
                            sequences=self.demand.sequences if getattr(self, "demand", None) else None)
        if self.lora is not None:
            kwargs = {**vllm_lora.engine_kwargs(ctx.lora), **kwargs}
        start = time.perf_counter()
        with _RandomState():
            self.llm = compat.llm_class(self.device)(**kwargs)
        self.start_seconds = time.perf_counter() - start
        if self.memory is not None:
            self._check_kv_cache()
        self.context_length = compat.context_length(self.llm)
        self.weight_load = resolve_weight_load(self.opts.weight_load, self.device, compat.quantized(self.llm))
        # The layerwise reload processes the tied output head only when it receives the matrix by its own name.
        layerwise = self.weight_load == "layerwise"
        self.aliases = tied_aliases(hf_config, ctx.options.get("tied_weights")) if layerwise else {}
        self.flat_logprobs = compat.supports_flat_logprobs()
        self.can_sleep = compat.sleep_supported(self.device) and bool(kwargs.get("enable_sleep_mode"))
        self.seed_mode = resolve_seed_mode(self.opts.seed_mode, self.device)
        self.state = SleepState(sleep_level)
        self.importing = False
        self.weight_version = 0
        # direct loads: the first update goes through load_weights and teaches the copy plan (copy_plan.py)
        self.copy_plan = ("learn" if self.weight_load == "direct" and self.opts.fast_import and self.lora is None
                          else "off")
        self.copy_plan_report: dict[str, Any] = {}
        self.generate_timing: dict[str, float] = {}
        self._import_marks: list[float] = []  # the last update's begin, woken, loaded, closed (import_stats)
        self.prefix_reset = True  # whether the last update had to reset the prefix cache
        self.last_sleep_level: str | int | None = None  # how the engine last slept (wake undoes exactly that)
        self._pump: RequestPump | None = None  # single requests (generate_request), one per run_requests

    def data_parallel(self) -> DataParallelInfo:
        return self.layout.data_parallel()

    # --- memory at start ----------------------------------------------------------------------------------
    def _start_memory(self, ctx: EngineContext) -> StartMemory:
        """The KV cache from what is free now: the trainers of this process are built and hold their resident
        state (``gpu_memory_utilization: auto``, ``hybridrl.rollout.kv_budget``)."""
        from hybridrl.engines.train_kit import release_cached_device_memory
        from hybridrl.placement.memory import DTYPE_BYTES, read_hf_config, shape_from_hf_config
        from hybridrl.rollout.kv_budget import demand_from_options, free_share
        from hybridrl_vllm.memory import VLLM_MEMORY

        release_cached_device_memory(collect=True)
        free, total = torch.cuda.mem_get_info()
        free = free_share(free, ctx.options)
        shape = shape_from_hf_config(read_hf_config(ctx.model_path))
        dtype_bytes = DTYPE_BYTES.get(ctx.dtype, 2)
        tp = self.opts.tensor_parallel
        self.kv_bytes_per_token = shape.kv_bytes_per_token(dtype_bytes) // tp
        self.demand = demand_from_options(ctx.options, self.layout.replicas, self.kv_bytes_per_token,
                                          context_tokens=self.opts.max_model_len or shape.max_positions)
        activations, graphs = VLLM_MEMORY.overhead_bytes(shape, dtype_bytes, dict(ctx.options), total, tp)
        memory = start_memory(self.opts, int(free), int(total), int(shape.param_count() * dtype_bytes // tp),
                              int(activations + graphs), self.demand, device=f"cuda:{torch.cuda.current_device()}")
        if memory.sizing is not None:
            log.info("vLLM KV cache: %.2f GiB for %s (free %.1f GiB of %.1f GiB at start)",
                     memory.sizing.kv_bytes / 2**30,
                     self.demand.describe() if self.demand else "no workload", free / 2**30, total / 2**30)
        return memory

    def _check_kv_cache(self) -> None:
        """The cache vLLM made must hold the step's sequences (vLLM rounds to blocks and may keep fewer)."""
        from hybridrl.rollout.kv_budget import UTILIZATION_KEY, KVCacheTooSmall

        self.kv_cache_bytes = compat.kv_cache_bytes(self.llm, getattr(self, "kv_bytes_per_token", 0))
        demand = getattr(self, "demand", None)
        if demand is not None and self.kv_cache_bytes is not None and self.kv_cache_bytes < demand.floor_bytes:
            raise KVCacheTooSmall(f"{UTILIZATION_KEY}: vLLM's KV cache holds {self.kv_cache_bytes / 2**30:.2f} GiB, "
                                  "less "
                                  f"than the {demand.floor_bytes / 2**30:.2f} GiB of the step's {demand.describe()}",
                                  {"kv_bytes": self.kv_cache_bytes, "floor_bytes": demand.floor_bytes})

    # --- generation ---------------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, batch: Batch, params: SamplingParams) -> Batch:
        """See ``RolloutEngine.generate``. Rows are unpadded into ``TokensPrompt``s (one request each; a GRPO
        group's shared prompt is reused through vLLM's prefix cache), sampled with the model's EOS ids as stop
        tokens (the engine core stepped directly, ``compat.generate_tokens``), and packed back to
        ``max_new_tokens`` columns. ``params.seed`` is mixed with the replica index and the row
        (``seed_mode="request"``), so rows and replicas draw distinct streams and tensor-parallel peers the same
        one. A batch with ``max_new_tokens`` caps gives each request its row's cap (the width stays)."""
        if self.importing:
            raise RuntimeError("VLLMRollout.generate called during a weight import (finish_weight_import first)")
        self.state.on_generate()
        start = time.perf_counter()
        width = int(params.max_new_tokens)
        prompts = unpad_prompts(batch[PROMPT_IDS], batch[PROMPT_MASK])
        if not prompts:
            return pack_responses([], [], width, self.pad_id)
        routing = self._routing_lists(params, len(prompts))
        caps = row_caps(batch, width)
        if caps is not None:
            return self._with_routing(self._generate_capped(prompts, caps, params, routing), batch, routing)
        check_context(prompts, width, self.context_length)
        rows = per_request_kwargs(params, self.eos_ids, len(prompts), self.layout.replica, self.seed_mode,
                                  self.flat_logprobs)
        requests, sampling = compat.tokens_prompts(prompts), compat.make_sampling_params(rows)
        engine_start = time.perf_counter()
        results = compat.generate_tokens(self.llm, requests, sampling,
                                         lora_request=self.lora.request() if self.lora is not None else None,
                                         routing=routing)
        tokens = [ids for ids, _ in results]
        logps = [lp for _, lp in results] if params.logprobs else None
        engine_end = time.perf_counter()
        packed = self._with_routing(pack_responses(tokens, logps, width, self.pad_id), batch, routing)
        # what this wrapper adds around vLLM's own generate (the benchmark's measure of the plugin's overhead)
        self.generate_timing = {"prepare_s": engine_start - start, "engine_s": engine_end - engine_start,
                                "pack_s": time.perf_counter() - engine_end}
        return packed

    def _routing_lists(self, params: SamplingParams, rows: int) -> list[list[Any]] | None:
        """One list per row for the engine's routing chunks when ``params.return_routing`` (None otherwise)."""
        if not params.return_routing:
            return None
        if not self.return_routing:
            raise ValueError("return_routing: this vLLM engine was started without recording routing "
                             "(its options' return_routing was not true)")
        return [[] for _ in range(rows)]

    @staticmethod
    def _with_routing(packed: Batch, batch: Batch, routing: list[list[Any]] | None) -> Batch:
        """``packed`` with ``routed_experts`` and ``prompt_routed_experts`` from the rows' routing chunks."""
        if routing is None:
            return packed
        arrays = [torch.cat([torch.as_tensor(c) for c in chunks]) if chunks else torch.zeros(0, dtype=torch.long)
                  for chunks in routing]
        return attach_routing(packed, batch[PROMPT_MASK], arrays)

    def _generate_capped(self, prompts: list[list[int]], caps: list[int], params: SamplingParams,
                         routing: list[list[Any]] | None = None) -> Batch:
        """``generate`` with each row's own budget; a row of budget 0 gets no request and no token."""
        width = int(params.max_new_tokens)
        check_context(prompts, caps, self.context_length)
        kwargs = per_request_kwargs(params, self.eos_ids, len(prompts), self.layout.replica, self.seed_mode,
                                    self.flat_logprobs, caps=caps)
        live = [i for i, cap in enumerate(caps) if cap > 0]
        tokens: list[list[int]] = [[] for _ in prompts]
        logps: list[list[float]] = [[] for _ in prompts]
        if live:
            live_routing = [routing[i] for i in live] if routing is not None else None
            results = compat.generate_tokens(self.llm, compat.tokens_prompts([prompts[i] for i in live]),
                                             compat.make_sampling_params([kwargs[i] for i in live]),
                                             lora_request=self.lora.request() if self.lora is not None else None,
                                             routing=live_routing)
            for i, (ids, lps) in zip(live, results):
                tokens[i], logps[i] = ids, lps or []
        return pack_responses(tokens, logps if params.logprobs else None, width, self.pad_id)

    @torch.inference_mode()
    def generate_until(self, batch: Batch, params: SamplingParams, share: float, running: float = 1.0) -> Batch:
        """See ``RolloutEngine.generate_until``. The rows of the running groups are queued (with ``generate``'s
        seeds and their own caps) and the engine is stepped; as requests end, the groups whose rows have all
        ended are counted and each lets a waiting group's rows join the running batch (``GroupCompletion``);
        after the step that completes enough groups the other requests are aborted, keeping their tokens and
        log-probs so far. No request of the call stays in the engine; the prefix cache stays valid (the aborted
        rows' blocks hold KV of these weights: a row resumed before the next update reuses them)."""
        if self.importing:
            raise RuntimeError("VLLMRollout.generate_until called during a weight import")
        if GROUP_INDEX not in batch:
            raise ValueError(f"generate_until needs '{GROUP_INDEX}' (B,): which rows sample one prompt")
        if params.return_routing:  # refused in pre-flight too: a resumed row would lose its earlier routing
            raise ValueError("return_routing with generate_until (groups in flight) is not supported")
        self.state.on_generate()
        width = int(params.max_new_tokens)
        prompts = unpad_prompts(batch[PROMPT_IDS], batch[PROMPT_MASK])
        caps = row_caps(batch, width) or [width] * len(prompts)
        check_context(prompts, caps, self.context_length)
        schedule = GroupCompletion(batch[GROUP_INDEX].tolist(), groups_to_complete(batch[GROUP_INDEX], share),
                                   running_groups(batch[GROUP_INDEX], running))
        for i, cap in enumerate(caps):
            if cap <= 0:
                schedule.finish(i)
        tokens: list[list[int]] = [[] for _ in prompts]
        logps: list[list[float]] = [[] for _ in prompts]
        if any(cap > 0 for cap in caps) and not schedule.done:
            kwargs = per_request_kwargs(params, self.eos_ids, len(prompts), self.layout.replica, self.seed_mode,
                                        self.flat_logprobs, caps=[max(1, cap) for cap in caps])  # 0: never queued
            results, _ = compat.generate_tokens_until(
                self.llm, compat.tokens_prompts(prompts), compat.make_sampling_params(kwargs), schedule,
                lora_request=self.lora.request() if self.lora is not None else None)
            for i, (ids, lps) in enumerate(results):
                tokens[i], logps[i] = ids, lps or []
        out = pack_responses(tokens, logps if params.logprobs else None, width, self.pad_id)
        out.set(FINISHED, torch.tensor(schedule.finished, dtype=torch.bool))
        return out

    # --- single requests (multi-turn episodes) ---------------------------------------------------------------
    def generate_episodes(self, batch: Batch, params: SamplingParams, environment: Any) -> Batch:
        """See ``RolloutEngine.generate_episodes``. With tensor parallelism every rank of a replica runs the
        engine (vLLM's external launcher) and must schedule the same requests in the same order, which
        environments finishing at their own pace would break: such a replica plays batched rounds instead."""
        if self.layout.tp > 1 and environment.mode != "batched":
            if environment.mode == "requests":
                log.info("vLLM with tensor_parallel=%d plays episodes in batched rounds (its ranks must schedule "
                         "identically)", self.layout.tp)
            environment = dataclasses.replace(environment, mode="batched")
        return super().generate_episodes(batch, params, environment)

    def run_requests(self, coroutine: Any) -> Any:
        """Run the episode runner's coroutine with a request pump of its own (``hybridrl_vllm.requests``)."""
        self._pump = self._request_pump()
        try:
            return asyncio.run(coroutine)
        finally:
            self._pump = None

    def _request_pump(self) -> RequestPump:
        """Single requests through the engine's step loop (with the run's adapter under ``sync: adapter``)."""
        def add(rid: str, prompt: Any, sampling: Any) -> None:
            compat.add_request(self.llm, rid, prompt, sampling,
                               lora_request=self.lora.request() if self.lora is not None else None)

        return RequestPump(add, lambda: compat.step(self.llm), lambda ids: compat.abort_requests(self.llm, ids))

    async def generate_request(self, prompt_ids: list[int], params: SamplingParams) -> GeneratedTokens:
        """See ``RolloutEngine.generate_request``: one request through the engine's step loop, decoded in the
        same forwards as every other request in flight. Same sampling settings as ``generate`` (the request's
        seed mixed with the replica index, ``seed_mode="request"``)."""
        if self.importing:
            raise RuntimeError("VLLMRollout.generate_request called during a weight import")
        self.state.on_generate()
        if self._pump is None:  # awaited outside run_requests
            self._pump = self._request_pump()
        check_context([prompt_ids], int(params.max_new_tokens), self.context_length)
        kwargs = per_request_kwargs(params, self.eos_ids, 1, self.layout.replica, self.seed_mode, self.flat_logprobs)
        sampling = compat.final_only(compat.make_sampling_params(kwargs))
        out = await self._pump.generate(compat.tokens_prompts([prompt_ids])[0], sampling)
        completion = out.outputs[0]
        ids = list(completion.token_ids)
        return GeneratedTokens(ids, sampled_logprobs(ids, completion.logprobs) if params.logprobs else None)

    # --- weights ------------------------------------------------------------------------------------------
    def _begin_import(self) -> None:
        self._import_marks = [time.perf_counter()]
        tags = self.state.on_import_begin() if self.can_sleep else []
        if tags:
            self._make_room(tags)
            compat.wake_up(self.llm, tags)
        self._import_marks.append(time.perf_counter())
        if self.weight_load == "layerwise" and self.lora is None:
            compat.run_on_workers(self.llm, _reload_begin)
        self.importing = True

    @torch.no_grad()
    def import_weights(self, bucket: WeightBucket) -> None:
        """Load HF-named tensors with the model's own ``load_weights`` (it stacks q/k/v and gate/up, shards for
        tensor parallelism, casts, and skips a tied ``lm_head``). The first bucket of an update wakes the
        weights (only them) when asleep. Tensors may live on any device and may be views of a receive
        buffer: the layerwise path keeps references to a layer's tensors until the layer is complete."""
        if not self.importing:
            self._begin_import()
        if not bucket:
            return
        if self.lora is not None:  # adapters alone: loaded together once the last bucket is in
            self.lora.stage(bucket)
            return
        if self.copy_plan == "learn":
            compat.run_on_workers(self.llm, _load_and_record, bucket)
        elif self.copy_plan == "on":
            compat.run_on_workers(self.llm, _load_planned, bucket)
        else:
            compat.run_on_workers(self.llm, _load_direct, with_aliases(bucket, self.aliases))

    def finish_weight_import(self) -> None:
        """Close the update: finish the layerwise reload, drop cached prefixes (their KV came from the old
        weights), count the version."""
        if not self.importing:  # an update with no bucket at all
            self._begin_import()
        if self.lora is not None:
            self.lora.load(self.llm)
        elif self.weight_load == "layerwise":
            compat.run_on_workers(self.llm, _reload_end, compat.model_config(self.llm))
        if self.copy_plan == "learn":
            record = self.device == "cuda" and self.opts.copy_graphs
            reports = compat.run_on_workers(self.llm, _build_copy_plan, record)
            self.copy_plan_report = reports[0] if reports else {}
            usable = bool(reports) and all(r["placed"] and not r["wrong"] for r in reports)
            self.copy_plan = "on" if usable else "off"
            log.info("vLLM direct-copy plan: %s (%s)", self.copy_plan, self.copy_plan_report)
        elif self.copy_plan == "on":
            compat.run_on_workers(self.llm, _end_planned_update)
        if self.device == "cuda":
            torch.cuda.synchronize()
        self._import_marks.append(time.perf_counter())
        # Cached prefixes hold KV computed with the old weights. An engine asleep since its last generation has
        # none: vLLM's sleep cleared the prefix cache when it dropped the KV cache (a sweep over every block,
        # slow on a large cache), and nothing was cached since.
        self.prefix_reset = not (self.can_sleep and self.state.kv_asleep and compat.sleep_clears_prefix_cache())
        if self.prefix_reset:
            compat.reset_prefix_cache(self.llm)
        self._import_marks.append(time.perf_counter())
        self.importing = False
        if self.can_sleep:
            self.state.on_import_end()
        self.weight_version += 1

    def imports_without_staging(self) -> bool:
        """With the direct-copy plan in use each tensor is copied straight into vLLM's parameter (a view of
        it), with no buffer of the bucket's size; the learning update and ``load_weights`` keep the buckets."""
        return self.copy_plan == "on"

    def import_stats(self) -> dict[str, float]:
        """Where the last update's time went: waking the weights, loading (copies included, up to the device
        sync), and closing (prefix-cache reset, when one was needed); and how the copies ran."""
        marks = self._import_marks
        if len(marks) != 4:
            return {}
        stats = {"wake_weights_s": marks[1] - marks[0], "load_s": marks[2] - marks[1], "close_s": marks[3] - marks[2],
                 "copy_plan": 1.0 if self.copy_plan == "on" else 0.0,
                 "prefix_reset": 1.0 if self.prefix_reset else 0.0}
        if self.lora is not None:
            stats.update(self.lora.timing)
        if self.copy_plan == "on":
            graphs = compat.run_on_workers(self.llm, _copy_graph_stats)
            stats.update({f"copy_graphs_{k}": float(v) for k, v in (graphs[0] if graphs else {}).items()})
        return stats

    # --- memory -------------------------------------------------------------------------------------------
    def sleep(self) -> None:
        """Release the KV cache and the weights (level 1: to host memory; level 2: discarded, the next import
        brings them; ``kv_cache``: the KV cache alone). On CPU a no-op: vLLM has no sleep mode there and the
        memory is host memory already."""
        if not self.can_sleep:
            return
        level = self.state.on_sleep()
        if level == KV_ONLY:
            compat.release_kv_cache(self.llm)
        elif level is not None:
            compat.sleep(self.llm, level)
        if level is not None:
            self.last_sleep_level = level

    def wake(self) -> None:
        """Bring back what ``sleep`` released and a weight import did not (KV cache, offloaded weights)."""
        if not self.can_sleep:
            return
        tags = self.state.on_wake()
        if tags:
            self._make_room(tags)
        if tags and self.last_sleep_level == KV_ONLY:  # how it slept, not how it is set now
            if tags != [KV_CACHE]:
                raise RuntimeError(f"sleep_level=kv_cache keeps the weights resident, yet {tags} must wake")
            compat.resume_kv_cache(self.llm)
        elif tags:
            compat.wake_up(self.llm, tags)

    def _make_room(self, tags: list[str]) -> None:
        """Before mapping ``tags`` back: give the caching allocator's free blocks back to the device (the
        trainers' activations and logits of the phases just run, cached in this same process), and refuse
        with the numbers, instead of failing inside vLLM's allocator, when what must come back is not free."""
        from hybridrl.engines.train_kit import release_cached_device_memory

        release_cached_device_memory()
        need = compat.asleep_bytes(self.llm, tags)
        free = torch.cuda.mem_get_info()[0]
        if need > free:  # lingering references (a traceback, a cycle) may hold tensors: collect, then look again
            release_cached_device_memory(collect=True)
            free = torch.cuda.mem_get_info()[0]
        if need > free:
            raise torch.OutOfMemoryError(
                f"waking the vLLM engine maps back {need / 2**30:.2f} GiB ({', '.join(tags)}) but only "
                f"{free / 2**30:.2f} GiB are free on cuda:{torch.cuda.current_device()} with the trainers' state "
                f"resident ({torch.cuda.memory_allocated() / 2**30:.2f} GiB allocated by torch)")

    def named_weights(self) -> Iterator[NamedTensor]:
        raise NotImplementedError("VLLMRollout keeps weights in vLLM's fused layout (qkv_proj, gate_up_proj; "
                                  "repacked on CPU); compare generations instead")
