"""The vLLM backend's engine-free logic, without vLLM: sampling-argument translation, prompt unpadding,
output packing, replica layout, the sleep/wake state machine, options and tied-weight aliases."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hybridrl.engines import SamplingParams
from hybridrl.engines.batch import RESPONSE_IDS, RESPONSE_MASK, ROLLOUT_LOG_PROBS, left_pad
from hybridrl.engines.rollout_kit import (
    ReplicaLayout,
    check_context,
    engine_seed,
    mix_seed,
    pack_responses,
    request_seeds,
    unpad_prompts,
)
from hybridrl_vllm.options import VLLMOptions, llm_kwargs, resolve_weight_load
from hybridrl_vllm.packing import sampled_logprobs
from hybridrl_vllm.sampling import per_request_kwargs, sampling_kwargs
from hybridrl_vllm.sleep import KV_CACHE, WEIGHTS, SleepState
from hybridrl_vllm.weights import tied_aliases, with_aliases


# --- prompts in ----------------------------------------------------------------------------------------------
def test_unpad_prompts_inverts_left_pad():
    rows = [[5, 6, 7], [8], [9, 10, 11, 12], [0, 3]]  # a real token may equal the pad id (0)
    ids, mask = left_pad(rows, pad_id=0)
    assert unpad_prompts(ids, mask) == rows


def test_unpad_prompts_refuses_an_empty_row():
    ids = torch.tensor([[0, 0, 4], [0, 0, 0]])
    mask = torch.tensor([[0, 0, 1], [0, 0, 0]])
    with pytest.raises(ValueError, match="row 1: empty prompt"):
        unpad_prompts(ids, mask)


def test_check_context_names_the_row_that_does_not_fit():
    check_context([[1] * 10, [1] * 20], max_new_tokens=12, context_length=32)  # 20 + 12 = 32 fits
    with pytest.raises(ValueError, match="row 1: prompt of 21 tokens"):
        check_context([[1] * 10, [1] * 21], max_new_tokens=12, context_length=32)
    check_context([[1] * 100], max_new_tokens=100, context_length=None)


# --- outputs back --------------------------------------------------------------------------------------------
def test_pack_responses_pads_to_width_with_stop_token_in_mask():
    eos, pad = 2, 0
    out = pack_responses([[5, 6, eos], [7, 8, 9, 10], []], [[-0.1, -0.2, -0.3], [-1.0, -2.0, -3.0, -4.0], []],
                         width=4, pad_id=pad)
    assert out[RESPONSE_IDS].tolist() == [[5, 6, eos, pad], [7, 8, 9, 10], [pad] * 4]
    assert out[RESPONSE_MASK].tolist() == [[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]]
    assert out[ROLLOUT_LOG_PROBS].dtype == torch.float32
    assert torch.allclose(out[ROLLOUT_LOG_PROBS], torch.tensor([[-0.1, -0.2, -0.3, 0.0], [-1.0, -2.0, -3.0, -4.0],
                                                                [0.0] * 4]))


def test_pack_responses_refuses_overlong_or_mismatched_rows():
    with pytest.raises(ValueError, match="row 0: 3 tokens returned, at most 2"):
        pack_responses([[1, 2, 3]], [[0.0, 0.0, 0.0]], width=2, pad_id=0)
    with pytest.raises(ValueError, match="row 0: 2 tokens but 1 log-probs"):
        pack_responses([[1, 2]], [[0.0]], width=2, pad_id=0)


def _logprob(value: float) -> SimpleNamespace:
    return SimpleNamespace(logprob=value, rank=1)


def test_sampled_logprobs_from_per_token_dicts():
    # logprobs=0 gives the sampled token; a top-k request may add others (and the sampled one may be among them)
    logprobs = [{4: _logprob(-0.5)}, {9: _logprob(-0.1), 7: _logprob(-2.0)}, {3: _logprob(-1.5)}]
    assert sampled_logprobs([4, 7, 3], logprobs) == [-0.5, -2.0, -1.5]


def test_sampled_logprobs_from_flat_lists():
    # the FlatLogprobs layout: position i spans [start_indices[i], end_indices[i])
    one_each = SimpleNamespace(start_indices=[0, 1, 2], end_indices=[1, 2, 3], token_ids=[4, 7, 3],
                               logprobs=[-0.5, -2.0, -1.5])
    assert sampled_logprobs([4, 7, 3], one_each) == [-0.5, -2.0, -1.5]
    with_extra = SimpleNamespace(start_indices=[0, 2], end_indices=[2, 3], token_ids=[9, 4, 7],
                                 logprobs=[-0.1, -0.5, -2.0])
    assert sampled_logprobs([4, 7], with_extra) == [-0.5, -2.0]


def test_sampled_logprobs_refuses_missing_entries():
    with pytest.raises(ValueError, match="logprobs=0"):
        sampled_logprobs([1], None)
    with pytest.raises(ValueError, match="position 1: no log-prob for the sampled token 5"):
        sampled_logprobs([1, 5], [{1: _logprob(-1.0)}, {6: _logprob(-1.0)}])
    with pytest.raises(ValueError, match="for 1 of 2 tokens"):
        sampled_logprobs([1, 5], [{1: _logprob(-1.0)}])


# --- sampling parameters -------------------------------------------------------------------------------------
def test_sampling_kwargs_translate_every_field():
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=64, min_new_tokens=3)
    kw = sampling_kwargs(params, eos_ids=[2, 5], flat_logprobs=True)
    assert kw == {"n": 1, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "max_tokens": 64, "min_tokens": 3,
                  "logprobs": 0, "detokenize": False, "skip_special_tokens": False, "ignore_eos": False,
                  "stop_token_ids": [2, 5], "flat_logprobs": True}


def test_sampling_kwargs_edge_cases():
    # top_k=0 means off in both; greedy leaves top-k/top-p out; ignore_eos drops the stop tokens (vLLM stops
    # at stop_token_ids even with ignore_eos)
    kw = sampling_kwargs(SamplingParams(temperature=1.0, top_k=0, max_new_tokens=4), eos_ids=[2])
    assert kw["top_k"] == 0 and "flat_logprobs" not in kw
    greedy = sampling_kwargs(SamplingParams(temperature=0.0, top_p=0.5, top_k=3, max_new_tokens=4), eos_ids=[2])
    assert greedy["temperature"] == 0.0 and "top_p" not in greedy and "top_k" not in greedy
    free = sampling_kwargs(SamplingParams(ignore_eos=True, max_new_tokens=4), eos_ids=[2])
    assert free["ignore_eos"] is True and "stop_token_ids" not in free
    with pytest.raises(ValueError, match="min_new_tokens=5 exceeds"):
        sampling_kwargs(SamplingParams(max_new_tokens=4, min_new_tokens=5), eos_ids=[2])


def test_request_seeds_differ_by_row_replica_and_step_and_are_reproducible():
    a = request_seeds(7, replica=0, rows=64)
    assert a == request_seeds(7, replica=0, rows=64)
    assert len(set(a)) == 64  # identical prompts of a GRPO group draw different responses
    b = request_seeds(7, replica=1, rows=64)
    c = request_seeds(8, replica=0, rows=64)
    assert not set(a) & set(b) and not set(a) & set(c)
    assert all(0 <= s < 2**63 for s in a + b + c)
    assert request_seeds(None, 0, 4) is None


def test_per_request_kwargs_seed_modes():
    params = SamplingParams(temperature=1.0, max_new_tokens=4, seed=11)
    rows = per_request_kwargs(params, [2], rows=3, replica=1, seed_mode="request")
    assert [r["seed"] for r in rows] == request_seeds(11, 1, 3)
    assert all({k: v for k, v in r.items() if k != "seed"} == sampling_kwargs(params, [2]) for r in rows)
    shared = per_request_kwargs(params, [2], rows=3, replica=1, seed_mode="engine")
    assert all("seed" not in r for r in shared) and all(r is shared[0] for r in shared)
    greedy = per_request_kwargs(SamplingParams(temperature=0.0, max_new_tokens=4, seed=11), [2], 2, 0)
    assert all("seed" not in r for r in greedy)
    with pytest.raises(ValueError, match="seed_mode"):
        per_request_kwargs(params, [2], 1, 0, seed_mode="nope")


def test_per_request_kwargs_caps_each_row():
    params = SamplingParams(temperature=1.0, max_new_tokens=6, min_new_tokens=3, seed=11)
    rows = per_request_kwargs(params, [2], rows=3, replica=0, caps=[6, 2, 4])
    assert [r["max_tokens"] for r in rows] == [6, 2, 4]
    assert [r["min_tokens"] for r in rows] == [3, 2, 3]  # vLLM refuses min_tokens above max_tokens
    assert [r["seed"] for r in rows] == request_seeds(11, 0, 3)  # the seeds of an uncapped call
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    same = per_request_kwargs(greedy, [2], rows=2, replica=0, caps=[6, 6])
    assert same[0] == same[1] == sampling_kwargs(greedy, [2])
    with pytest.raises(ValueError, match="2 max_new_tokens caps for 3 rows"):
        per_request_kwargs(greedy, [2], rows=3, replica=0, caps=[1, 2])


def test_engine_seed_depends_on_replica_only():
    assert engine_seed(3, 0) == engine_seed(3, 0) != engine_seed(3, 1)
    assert 0 <= engine_seed(3, 5) < 2**31 - 1
    assert mix_seed(1, 2) != mix_seed(2, 1)


# --- replicas ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world,tp", [(1, 1), (4, 1), (4, 2), (8, 4)])
def test_replica_layout_groups_consecutive_ranks(world, tp):
    infos = [ReplicaLayout(r, world, tp).data_parallel() for r in range(world)]
    assert [i.dp_rank for i in infos] == [r // tp for r in range(world)]
    assert {i.dp_size for i in infos} == {world // tp}
    leaders = [r for r, i in enumerate(infos) if i.returns_output]
    assert leaders == list(range(0, world, tp))  # exactly one rank per replica returns


def test_replica_layout_refuses_a_pool_that_does_not_split():
    with pytest.raises(ValueError, match="not a multiple of tensor_parallel=2"):
        ReplicaLayout(0, 3, 2)


# --- sleep and wake ------------------------------------------------------------------------------------------
def test_sleep_state_follows_the_trainer_loop():
    s = SleepState("auto")
    # start: the engine holds fresh weights (initial sync), then sleeps: level 1 keeps them
    assert s.on_import_begin() == []
    s.on_import_end()
    assert s.on_sleep() == 1
    assert s.on_wake() == [WEIGHTS, KV_CACHE]
    s.on_generate()
    assert s.on_sleep() == 1  # no import has yet been seen arriving while asleep
    assert s.on_import_begin() == [WEIGHTS]  # wake the weights alone, load, keep the KV cache asleep
    s.on_import_end()
    assert s.on_wake() == [KV_CACHE]
    s.on_generate()
    # from now on the loop is known to resync while asleep: level 2 discards the used weights
    assert s.on_sleep() == 2
    assert s.on_sleep() is None  # already asleep
    assert s.on_import_begin() == [WEIGHTS]
    s.on_import_end()
    assert s.on_wake() == [KV_CACHE]
    assert s.on_wake() == []


def test_sleep_state_keeps_fresh_weights_and_refuses_garbage():
    s = SleepState("auto", imports_while_asleep=True)
    s.on_import_end()
    assert s.on_sleep() == 1  # fresh (never generated with) weights are kept even once level 2 is allowed
    s.on_wake()
    s.on_generate()
    assert s.on_sleep() == 2
    with pytest.raises(RuntimeError, match="no weights were imported"):
        s.on_wake()
    with pytest.raises(RuntimeError, match="asleep"):
        s.on_generate()


def test_sleep_state_fixed_levels():
    one, two = SleepState(1), SleepState(2)
    two.on_generate()
    assert one.on_sleep() == 1 and two.on_sleep() == 2
    assert one.on_wake() == [WEIGHTS, KV_CACHE]
    with pytest.raises(ValueError, match="sleep_level"):
        SleepState(3)


# --- options -------------------------------------------------------------------------------------------------
def test_llm_kwargs_for_a_colocated_gpu_rank():
    opts = VLLMOptions.from_options({"tensor_parallel": 2, "max_new_tokens": 64, "gpu_memory_utilization": 0.4,
                                     "max_num_seqs": 128, "engine_kwargs": {"enable_prefix_caching": False}})
    kw = llm_kwargs(opts, model_path="/m", dtype="bfloat16", device="cuda", seed=5, distributed=True,
                    logprobs_kwargs={"logprobs_mode": "processed_logprobs"})
    assert kw == {"model": "/m", "dtype": "bfloat16", "tensor_parallel_size": 2, "seed": 5,
                  "skip_tokenizer_init": True, "disable_log_stats": True, "enforce_eager": False,
                  "logprobs_mode": "processed_logprobs", "gpu_memory_utilization": 0.4, "enable_sleep_mode": True,
                  "distributed_executor_backend": "external_launcher", "max_num_seqs": 128,
                  "enable_prefix_caching": False}


def test_sleep_state_kv_only_keeps_weights_resident():
    s = SleepState("kv_cache")
    s.on_import_end()
    s.on_generate()
    assert s.on_sleep() == "kv_cache"
    assert s.on_sleep() is None  # already asleep
    assert s.on_import_begin() == []  # the weights never left: nothing to wake before loading
    s.on_import_end()
    with pytest.raises(RuntimeError, match="asleep"):
        s.on_generate()
    assert s.on_wake() == [KV_CACHE]
    s.on_generate()


def test_sleep_level_reads_yaml_strings_and_names_the_key():
    assert VLLMOptions.from_options({"sleep_level": "2"}).sleep_level == 2
    assert VLLMOptions.from_options({"sleep_level": "kv_cache"}).sleep_level == "kv_cache"
    with pytest.raises(ValueError, match="sleep_level"):
        VLLMOptions.from_options({"sleep_level": "weights"})


def test_cuda_graphs_cover_the_sequences_a_step_holds():
    opts = VLLMOptions.from_options({})
    def kwargs(options, sequences, device="cuda"):
        return llm_kwargs(VLLMOptions.from_options(options), model_path="/m", dtype="bfloat16", device=device,
                          seed=0, distributed=False, logprobs_kwargs={}, sequences=sequences)
    assert "compilation_config" not in kwargs({}, 512)  # vLLM's own capture covers 512
    assert kwargs({}, 640)["compilation_config"] == {"max_cudagraph_capture_size": 640}
    assert "max_num_seqs" not in kwargs({}, 640)
    big = kwargs({}, 1500)
    assert big["compilation_config"] == {"max_cudagraph_capture_size": 1504} and big["max_num_seqs"] == 1504
    assert kwargs({"graph_sequences": 256}, 640)["compilation_config"] == {"max_cudagraph_capture_size": 256}
    assert "compilation_config" not in kwargs({}, 640, device="cpu")  # eager on CPU
    assert "compilation_config" not in kwargs({"enforce_eager": True}, 640)
    mine = {"compilation_config": {"cudagraph_mode": "NONE"}}
    assert kwargs({"engine_kwargs": mine}, 640)["compilation_config"] == mine["compilation_config"]
    with pytest.raises(ValueError, match="graph_sequences"):
        VLLMOptions.from_options({"graph_sequences": 0})
    assert opts.graph_sequences is None


def test_llm_kwargs_on_cpu_without_process_group():
    kw = llm_kwargs(VLLMOptions.from_options({"kv_cache_gb": 0.5}), model_path="/m", dtype="float32",
                    device="cpu", seed=0, distributed=False, logprobs_kwargs={})
    assert kw["enforce_eager"] is True and kw["kv_cache_memory_bytes"] == 2**29
    assert "enable_sleep_mode" not in kw and "gpu_memory_utilization" not in kw
    assert "distributed_executor_backend" not in kw


@pytest.mark.parametrize("options,match", [({"sleep_level": 3}, "sleep_level"), ({"seed_mode": "x"}, "seed_mode"),
                                           ({"weight_load": "x"}, "weight_load"),
                                           ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization")])
def test_options_refuse_bad_values(options, match):
    with pytest.raises(ValueError, match=match):
        VLLMOptions.from_options(options)


def test_weight_load_choice():
    assert resolve_weight_load("auto", "cuda", quantized=False) == "direct"
    assert resolve_weight_load("auto", "cuda", quantized=True) == "layerwise"
    assert resolve_weight_load("auto", "cpu", quantized=False) == "layerwise"
    assert resolve_weight_load("direct", "cuda", quantized=False) == "direct"
    assert resolve_weight_load("layerwise", "cuda", quantized=False) == "layerwise"


def test_direct_weight_load_is_refused_where_it_cannot_work():
    """On CPU vLLM repacks the linear weights and ``load_weights`` dies at the first sync (no ``weight_loader``);
    a quantized model's weights are converted. Both are refused by name before any weights move."""
    with pytest.raises(ValueError, match="weight_load='direct' needs CUDA"):
        resolve_weight_load("direct", "cpu", quantized=False)
    with pytest.raises(ValueError, match="weight_load='direct' cannot load a quantized model"):
        resolve_weight_load("direct", "cuda", quantized=True)


def test_the_rollout_refuses_direct_loads_on_cpu_before_starting_an_engine(tmp_path):
    from hybridrl.engines import EngineContext
    from hybridrl_vllm.engine import VLLMRollout

    ctx = EngineContext(role="rollout", backend="vllm", model_path=str(tmp_path / "no-model"), rank=0, world_size=1,
                        device="cpu", dtype="float32", seed=0, trainable=False, options={"weight_load": "direct"})
    with pytest.raises(ValueError, match="weight_load='direct' needs CUDA"):  # not a missing model or vLLM
        VLLMRollout(ctx)


# --- tied weights --------------------------------------------------------------------------------------------
def test_tied_embedding_is_sent_under_the_head_name_too():
    emb, q = torch.randn(4, 2), torch.randn(2, 2)
    aliases = tied_aliases(SimpleNamespace(tie_word_embeddings=True))
    bucket = with_aliases([("model.embed_tokens.weight", emb), ("model.layers.0.q.weight", q)], aliases)
    assert [n for n, _ in bucket] == ["model.embed_tokens.weight", "model.layers.0.q.weight", "lm_head.weight"]
    assert bucket[2][1] is emb  # the same tensor, no copy
    both = [("model.embed_tokens.weight", emb), ("lm_head.weight", emb)]
    assert with_aliases(both, aliases) == both
    assert tied_aliases(SimpleNamespace(tie_word_embeddings=False)) == {}
    assert with_aliases([("a", q)], {}) == [("a", q)]


# --- gpu_memory_utilization: auto (hybridrl.rollout.kv_budget) ------------------------------------------
from hybridrl.rollout.kv_budget import KVCacheTooSmall, KVDemand  # noqa: E402

GIB = 2**30

def test_vllm_auto_passes_the_cache_and_a_share_of_what_is_free():
    from hybridrl_vllm.options import START_SLACK_BYTES, VLLMOptions, llm_kwargs, start_memory

    opts = VLLMOptions.from_options({})
    assert opts.gpu_memory_utilization == "auto" and opts.auto_memory
    demand = KVDemand(512, 384, 24576)
    free, total = 120 * GIB, 140 * GIB
    memory = start_memory(opts, free, total, weights_bytes=GIB, overhead_bytes=2 * GIB, demand=demand)
    assert memory.kv_cache_bytes == demand.target_bytes
    # vLLM 0.26 refuses to start unless free >= total x share; with kv_cache_memory_bytes the share does nothing else
    assert memory.utilization * total <= free - START_SLACK_BYTES + 1
    kwargs = llm_kwargs(opts, model_path="/m", dtype="bfloat16", device="cuda", seed=0, distributed=False,
                        logprobs_kwargs={}, memory=memory)
    assert kwargs["kv_cache_memory_bytes"] == demand.target_bytes
    assert kwargs["gpu_memory_utilization"] == memory.utilization


def test_vllm_numeric_share_must_be_free_at_start():
    from hybridrl_vllm.options import VLLMOptions, start_memory

    opts = VLLMOptions.from_options({"gpu_memory_utilization": 0.9})
    ok = start_memory(opts, free_bytes=130 * GIB, total_bytes=140 * GIB, weights_bytes=GIB, overhead_bytes=GIB,
                      demand=None)
    assert ok.utilization == 0.9 and ok.kv_cache_bytes is None  # vLLM sizes it from the share
    with pytest.raises(KVCacheTooSmall, match=r"gpu_memory_utilization=0.9 asks vLLM for 126.0 GiB .* at most 0.78"):
        start_memory(opts, free_bytes=110 * GIB, total_bytes=140 * GIB, weights_bytes=GIB, overhead_bytes=GIB,
                     demand=None)


