"""``SGLangRollout``: the rollout engine on SGLang's offline ``sglang.Engine``.

One engine per tensor-parallel group of the pool (``parallel.ReplicaLayout``), started by the group's first rank
in the process of the Ray worker that hosts the role; SGLang runs its scheduler (one per tensor-parallel rank)
and detokenizer as child processes, so weights reach it through CUDA IPC:

* colocated with the trainer, the trainer's exported buckets are flattened into one buffer per bucket and
  handed over with ``update_weights_from_tensor(load_format="flattened_bucket")``; the engine sleeps while the
  trainer works (SGLang's memory saver, ``hybridrl_sglang.sleep`` decides what to release);
* on its own pool (split), the broadcast bridge's receive buffer arrives through the same ``import_weights``
  and is sent as it is (zero copy); ``hybridrl_sglang.distributed`` offers SGLang's own
  ``update_weights_from_distributed`` path instead.
"""

from __future__ import annotations

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
from hybridrl.engines.batch import PROMPT_IDS, PROMPT_MASK, Batch
from hybridrl.engines.rollout_kit import (
    ReplicaLayout,
    attach_routing,
    check_context,
    engine_seed,
    pack_responses,
    row_caps,
    special_ids,
    unpad_prompts,
)
from hybridrl_sglang import compat
from hybridrl_sglang.buckets import flatten
from hybridrl_sglang.options import PoolMemory, SGLangOptions, auto_fraction, check_fraction, engine_kwargs
from hybridrl_sglang.packing import Completion, ended, parse_output, renormalise, routed_experts
from hybridrl_sglang.parallel import engine_devices
from hybridrl_sglang.requests import generate_one_request
from hybridrl_sglang.sampling import per_request, phase_budgets, phases, top_logprobs_wanted
from hybridrl_sglang.sleep import MemoryState


def _gather_visible_devices(world_size: int) -> list[str | None]:
    """Every rank's ``CUDA_VISIBLE_DEVICES`` (collective over the host's process group)."""
    import os

    import torch.distributed as dist

    mine = os.environ.get("CUDA_VISIBLE_DEVICES")
    if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return [mine] * world_size
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, mine)
    return out


class SGLangRollout(RolloutEngine):
    """Token-in/token-out generation on SGLang, with memory-saver sleep/wake and flattened-bucket weight import.

    ``ctx.options``: see ``hybridrl_sglang.options`` (``tensor_parallel``, ``gpu_memory_utilization``,
    ``weights_cpu_backup``, ``seed_mode``, ``engine_kwargs`` ...)."""

    def __init__(self, ctx: EngineContext) -> None:
        super().__init__(ctx)
        if not str(ctx.device).startswith("cuda"):
            raise RuntimeError("SGLangRollout needs a CUDA device (SGLang has no CPU build)")
        self.opts = SGLangOptions.from_options(ctx.options)
        self.layout = ReplicaLayout(ctx.rank, ctx.world_size, self.opts.tensor_parallel)
        compat.check_version()
        compat.check_dtype(ctx.dtype)
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(ctx.model_path)
        text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        self.vocab_size = getattr(text_config, "vocab_size", None)
        compat.check_architecture(text_config, ctx.model_path)
        #: an MoE model's (layers, experts per token), for the routing SGLang records when the run asks for it
        #: (the core resolves ``roles.rollout.return_routing`` into the options; the engine starts recording)
        self.routing_shape = (int(getattr(text_config, "num_hidden_layers", 0) or 0),
                              int(getattr(text_config, "num_experts_per_tok", 0) or 0))
        self.eos_ids, self.pad_id = special_ids(ctx.model_path, hf_config)
        self.device = compat.current_device()
        self.engine_dtype = ctx.torch_dtype
        self.state = MemoryState(cpu_backup=self.opts.weights_cpu_backup)
        self.can_sleep = self.opts.sleep_mode
        self.importing = False
        self.weight_version = 0
        self.import_counters = {"buckets": 0, "shared": 0, "bytes": 0}  # since start
        self.engine: Any = None
        self.inexact_logprobs = 0
        self.last_released: list[str] = []
        devices = None
        if self.layout.tp > 1:  # the leader's engine must see its peers' GPUs (collective over the pool)
            devices = engine_devices(self.layout, _gather_visible_devices(ctx.world_size))
        if not self.layout.leader:
            self.start_seconds = 0.0
            self.context_length = None
            return
        self.memory = self._start_memory(ctx)
        kwargs = engine_kwargs(self.opts, model_path=ctx.model_path, dtype=ctx.dtype,
                               seed=engine_seed(ctx.seed, self.layout.replica), memory=self.memory)
        start = time.perf_counter()
        self.engine = compat.start_engine(kwargs, devices)
        self.start_seconds = time.perf_counter() - start
        self.context_length = compat.context_length(self.engine)
        self._check_pool()

    def data_parallel(self) -> DataParallelInfo:
        return self.layout.data_parallel()

    # --- memory at start ----------------------------------------------------------------------------------
    def _start_memory(self, ctx: EngineContext) -> PoolMemory | None:
        """``gpu_memory_utilization: auto``: the KV pool from what is free now, the trainers of this process
        built (``hybridrl.rollout.kv_budget``, ``options.auto_fraction``); a number is checked against it."""
        from hybridrl.engines.train_kit import release_cached_device_memory
        from hybridrl.placement.memory import DTYPE_BYTES, read_hf_config, shape_from_hf_config
        from hybridrl.rollout.kv_budget import AUTO, demand_from_options, free_share
        from hybridrl_sglang.memory import SGLANG_MEMORY

        release_cached_device_memory(collect=True)
        free, total = compat.device_memory()
        free = free_share(free, ctx.options)
        shape = shape_from_hf_config(read_hf_config(ctx.model_path))
        dtype_bytes = DTYPE_BYTES.get(ctx.dtype, 2)
        tp = self.opts.tensor_parallel
        self.kv_bytes_per_token = shape.kv_bytes_per_token(dtype_bytes) // tp
        self.weights_bytes = shape.param_count() * dtype_bytes // tp
        self.demand = demand_from_options(ctx.options, self.layout.replicas, self.kv_bytes_per_token,
                                          context_tokens=self.opts.max_model_len or shape.max_positions)
        device = str(self.device)
        if self.opts.gpu_memory_utilization != AUTO:
            check_fraction(float(self.opts.gpu_memory_utilization), int(free), int(self.weights_bytes), device)
            return None
        activations, graphs = SGLANG_MEMORY.overhead_bytes(shape, dtype_bytes, dict(ctx.options), total, tp)
        return auto_fraction(int(free), int(self.weights_bytes), int(activations + graphs), self.kv_bytes_per_token,
                             self.demand, device)

    def _check_pool(self) -> None:
        """The KV pool SGLang made must hold the step's sequences."""
        from hybridrl.rollout.kv_budget import UTILIZATION_KEY, KVCacheTooSmall

        tokens = compat.pool_tokens(self.engine)
        self.pool_bytes = tokens * self.kv_bytes_per_token if tokens else None
        demand = self.demand
        if demand is not None and tokens is not None and tokens < demand.tokens:
            raise KVCacheTooSmall(f"{UTILIZATION_KEY}: SGLang's KV pool holds {tokens} tokens, fewer than the "
                                  f"{demand.tokens} of the step's {demand.describe()}",
                                  {"pool_tokens": tokens, "floor_tokens": demand.tokens})

    def _make_room(self, tags: list[str]) -> None:
        """Before the memory saver maps ``tags`` back: the caching allocator's free blocks of this process (the
        trainers' activations and logits) go back to the device, and what must come back has to be free."""
        from hybridrl.engines.train_kit import release_cached_device_memory

        release_cached_device_memory()
        need = (getattr(self, "pool_bytes", None) or 0) * ("kv_cache" in tags) + \
            getattr(self, "weights_bytes", 0) * ("weights" in tags)
        free = compat.device_memory()[0]
        if need > free:
            release_cached_device_memory(collect=True)
            free = compat.device_memory()[0]
        if need > free:
            raise torch.OutOfMemoryError(
                f"waking the SGLang engine maps back {need / 2**30:.2f} GiB ({', '.join(tags)}) but only "
                f"{free / 2**30:.2f} GiB are free on {self.device} with the trainers' state resident")

    # --- generation ---------------------------------------------------------------------------------------
    def generate(self, batch: Batch, params: SamplingParams) -> Batch:
        """See ``RolloutEngine.generate``. Rows are unpadded into ``input_ids`` lists (one request each; a GRPO
        group's shared prompt is reused through the radix cache) and packed back to ``max_new_tokens`` columns;
        a batch with ``max_new_tokens`` caps gives each request its row's cap (``phase_budgets``).
        Non-leader ranks of a tensor-parallel replica return zeros (the driver ignores them)."""
        if self.importing:
            raise RuntimeError("SGLangRollout.generate called during a weight import (finish_weight_import first)")
        self.state.on_generate()
        width = int(params.max_new_tokens)
        prompts = unpad_prompts(batch[PROMPT_IDS], batch[PROMPT_MASK])
        want = bool(params.logprobs)
        if not prompts or self.engine is None:
            return pack_responses([[] for _ in prompts], [[] for _ in prompts] if want else None, width, self.pad_id)
        caps = row_caps(batch, width)
        check_context(prompts, width if caps is None else caps, self.context_length)
        top_n = top_logprobs_wanted(params, self.opts.logprob_top_n, self.vocab_size) if want else 0
        routing = self._check_routing(params)
        tokens: list[list[int]] = [[] for _ in prompts]
        logps: list[list[float]] = [[] for _ in prompts]
        routes: list[torch.Tensor] = [torch.zeros(0, dtype=torch.int32) for _ in prompts]
        self.inexact_logprobs = 0
        for phase in phases(params):
            budgets = phase_budgets(phase, caps, [len(t) for t in tokens]) if caps is not None else None
            rows = [i for i in range(len(prompts)) if (not ended(tokens[i], self.eos_ids) or params.ignore_eos)
                    and (budgets is None or budgets[i] > 0)]
            if not rows:
                break
            sampling = per_request(params, phase, self.eos_ids, len(prompts), self.layout.replica, self.opts.seed_mode,
                                   budgets)
            outputs = compat.generate(self.engine, [prompts[i] + tokens[i] for i in rows],
                                      [sampling[i] for i in rows], top_n, logprobs=want, routing=routing)
            if len(outputs) != len(rows):
                raise RuntimeError(f"SGLang returned {len(outputs)} outputs for {len(rows)} prompts")
            for i, out in zip(rows, outputs):
                done = parse_output(out, i, logprobs=want)
                fed = len(prompts[i]) + len(tokens[i]) + len(done.token_ids) - 1
                tokens[i].extend(done.token_ids)
                if want:
                    logps[i].extend(self._sampling_logprobs(done, params))
                if routing:  # a later phase re-feeds the earlier tokens: its answer covers the whole row
                    routes[i] = routed_experts(out, i, *self.routing_shape, fed=fed)
        packed = pack_responses(tokens, logps if want else None, width, self.pad_id)
        return attach_routing(packed, batch[PROMPT_MASK], routes) if routing else packed

    def _check_routing(self, params: SamplingParams) -> bool:
        """Whether this call returns ``routed_experts``: asked, and the engine records them from its start."""
        if not params.return_routing:
            return False
        if not self.opts.return_routing:
            raise ValueError("return_routing: this SGLang engine was started without recording routing (its "
                             "options' return_routing was not true)")
        if not all(self.routing_shape):
            raise ValueError("return_routing: the model has no MoE router (a dense model routes nothing)")
        return True

    # --- single requests (multi-turn episodes) ---------------------------------------------------------------
    def generate_episodes(self, batch: Batch, params: SamplingParams, environment: Any) -> Batch:
        """See ``RolloutEngine.generate_episodes``; the other ranks of a tensor-parallel replica hold no engine
        (the leader's serves them all) and return an empty batch the driver ignores."""
        if self.engine is None:
            return Batch.from_tensors({})
        return super().generate_episodes(batch, params, environment)

    def run_requests(self, coroutine: Any) -> Any:
        """On the engine's own event loop (its tokenizer manager lives there)."""
        return compat.run_on_loop(self.engine, coroutine)

    async def generate_request(self, prompt_ids: list[int], params: SamplingParams) -> GeneratedTokens:
        """See ``RolloutEngine.generate_request``: the phases of ``generate`` for one request
        (``hybridrl_sglang.requests``), awaited while other requests decode in the same scheduler batches."""
        if self.importing:
            raise RuntimeError("SGLangRollout.generate_request called during a weight import")
        if self.engine is None:
            raise RuntimeError("SGLangRollout.generate_request on a rank without an engine (not a replica's leader)")
        self.state.on_generate()
        check_context([prompt_ids], int(params.max_new_tokens), self.context_length)
        want = bool(params.logprobs)
        top_n = top_logprobs_wanted(params, self.opts.logprob_top_n, self.vocab_size) if want else 0

        async def one(input_ids: list[int], sampling: dict[str, Any]) -> dict[str, Any]:
            return await compat.async_generate(self.engine, input_ids, sampling, top_n, logprobs=want)

        return await generate_one_request(one, prompt_ids, params, self.eos_ids, self.layout.replica,
                                          self.opts.seed_mode, lambda done: self._sampling_logprobs(done, params))

    def _sampling_logprobs(self, done: Completion, params: SamplingParams) -> list[float]:
        """The tokens' log-probs under the truncated distribution they were drawn from."""
        if params.greedy or (not params.top_k and params.top_p >= 1.0):
            return done.logprobs
        out = []
        for pos, lp in enumerate(done.logprobs):
            value, exact = renormalise(lp, done.top[pos] if pos < len(done.top) else [], params.top_k, params.top_p)
            self.inexact_logprobs += int(not exact)
            out.append(value)
        return out

    # --- weights ------------------------------------------------------------------------------------------
    def _begin_import(self) -> None:
        self._import_marks = [time.perf_counter()]
        tags = self.state.on_import_begin() if self.can_sleep else []
        if tags and self.engine is not None:
            self._make_room(tags)
            compat.resume(self.engine, tags)
        self._import_marks.append(time.perf_counter())
        self.importing = True

    @torch.no_grad()
    def import_weights(self, bucket: WeightBucket) -> None:
        """Hand one bucket of HF-named tensors to every scheduler of the replica (SGLang's ``load_weights``
        stacks q/k/v and gate/up, shards for tensor parallelism, casts, and skips a tied ``lm_head``). The
        first bucket of an update wakes the weights alone when asleep. SGLang copies during the call, so the
        caller may reuse the bucket's memory afterwards."""
        if not self.importing:
            self._begin_import()
        if not bucket or self.engine is None:
            return
        if compat.supports_flattened_bucket():
            flat, entries, shared = flatten(bucket, self.engine_dtype, self.device)
            compat.synchronize()  # the schedulers read the buffer on their own streams
            compat.update_flat(self.engine, flat, entries, self.opts.tensor_parallel)
            self.import_counters["shared"] += int(shared)
            self.import_counters["bytes"] += sum(e.numel for e in entries)
        else:
            named = [(n, t.detach().to(self.device)) for n, t in bucket]
            compat.synchronize()
            compat.update_tensors(self.engine, named)
        self.import_counters["buckets"] += 1

    def finish_weight_import(self) -> None:
        """Close the update: drop cached prefixes (their KV came from the old weights), count the version."""
        if not self.importing:
            self._begin_import()
        compat.synchronize()
        self._import_marks.append(time.perf_counter())
        if self.engine is not None:
            compat.flush_cache(self.engine)
        compat.ipc_collect()
        self._import_marks.append(time.perf_counter())
        self.importing = False
        self.state.on_import_end()
        self.weight_version += 1

    def import_stats(self) -> dict[str, float]:
        """Where the last update's time went: resuming the weights' memory, loading (up to the device sync),
        and closing (cache flush, IPC handles collected)."""
        marks = getattr(self, "_import_marks", [])
        if len(marks) != 4:
            return {}
        return {"wake_weights_s": marks[1] - marks[0], "load_s": marks[2] - marks[1], "close_s": marks[3] - marks[2]}

    # --- split mode through SGLang's weight-update group (``hybridrl_sglang.distributed``) -----------------
    def weight_sync_mode(self) -> str:
        return self.opts.weight_sync

    def engine_ranks(self) -> int:
        """Ranks this worker's engine adds to the weight-update group (its tensor-parallel size; 0: no engine)."""
        return self.opts.tensor_parallel if self.engine is not None else 0

    def distributed_layout(self, specs: list) -> list:
        """The flat layout of each bucket of the trainer's manifest, in this engine's dtype."""
        from hybridrl_sglang.distributed import receive_layout

        return receive_layout(specs, self.ctx.dtype)

    def open_update_group(self, host: str, port: int, rank_offset: int, world_size: int, group_name: str) -> None:
        if self.engine is not None:
            compat.init_update_group(self.engine, host, port, rank_offset, world_size, group_name, "nccl")
            self.update_group = group_name

    def receive_distributed(self, layout: list, group_name: str) -> None:
        """Receive every bucket (broadcast by the trainer) straight into the schedulers, then close the update."""
        self._begin_import()
        if self.engine is not None:
            for entries in layout:
                compat.update_from_distributed(self.engine, entries, group_name)
                self.import_counters["buckets"] += 1
        self.finish_weight_import()

    # --- memory -------------------------------------------------------------------------------------------
    def sleep(self) -> None:
        """Release the KV cache (and the weights when safe, see ``hybridrl_sglang.sleep``)."""
        if not self.can_sleep:
            return
        tags = self.state.on_sleep()
        if tags and self.engine is not None:
            compat.release(self.engine, tags)
        self.last_released = tags

    def wake(self) -> None:
        """Bring back what ``sleep`` released and an import did not: weights first, then the KV cache."""
        if not self.can_sleep:
            return
        tags = self.state.on_wake()
        if tags and self.engine is not None:
            self._make_room(tags)
            compat.resume(self.engine, tags)

    def named_weights(self) -> Iterator[NamedTensor]:
        raise NotImplementedError("SGLangRollout keeps weights in the scheduler processes, in SGLang's fused layout "
                                  "(qkv_proj, gate_up_proj); compare generations instead")

    # --- lifetime -----------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the engine's processes and free its GPU memory."""
        engine, self.engine = self.engine, None
        if engine is not None:
            if getattr(self, "update_group", None):
                compat.destroy_update_group(engine, self.update_group)
            compat.shutdown(engine)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
