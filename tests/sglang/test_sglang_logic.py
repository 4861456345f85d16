"""The SGLang plugin's engine-free logic, on CPU, without SGLang: argument and sampling translation, output
parsing and log-prob renormalisation, bucket flattening, memory stages, rank layout, the split-mode wire
format, and the engine's orchestration against a fake ``sglang.Engine`` that behaves as SGLang 0.5.16 does
(log-probs before top-k/top-p truncation, ``logit_bias`` applied before sampling, EOS stops unless ignored).

Expected values are computed independently of the code under test (by hand, or with transformers-style
torch code such as ``hybridrl.rollout.hf.filter_logits``)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridrl.engines import EngineContext, SamplingParams
from hybridrl.engines.batch import (
    PROMPT_IDS,
    PROMPT_MASK,
    RESPONSE_IDS,
    RESPONSE_MASK,
    ROLLOUT_LOG_PROBS,
    Batch,
    left_pad,
)
from hybridrl.engines.rollout_kit import (
    ReplicaLayout,
    check_context,
    engine_seed,
    mix_seed,
    pack_responses,
    unpad_prompts,
)
from hybridrl.rollout.hf import filter_logits
from hybridrl.runtime.distributed import free_port
from hybridrl.runtime.group import Result
from hybridrl.weights.buckets import describe_bucket, pack_bucket, unpack_bucket
from hybridrl_sglang import buckets as bk
from hybridrl_sglang import compat
from hybridrl_sglang.distributed import SGLangBroadcastBridge, flat_nbytes, pack_flat, receive_layout
from hybridrl_sglang.options import SGLangOptions, engine_kwargs, split_known
from hybridrl_sglang.packing import parse_output, renormalise, routed_experts
from hybridrl_sglang.parallel import engine_devices
from hybridrl_sglang.sampling import (
    BAN,
    Phase,
    per_request,
    phase_budgets,
    phase_sampling,
    phases,
    top_logprobs_wanted,
)
from hybridrl_sglang.sleep import KV_CACHE, WEIGHTS, MemoryState


# --- options ------------------------------------------------------------------------------------------------
def test_default_engine_kwargs():
    kwargs = engine_kwargs(SGLangOptions.from_options({}), model_path="/m", dtype="bfloat16", seed=7)
    assert kwargs == {"model_path": "/m", "dtype": "bfloat16", "tp_size": 1, "mem_fraction_static": 0.5,
                      "random_seed": 7, "skip_tokenizer_init": True, "enable_memory_saver": True,
                      "log_level": "error", "cuda_graph_backend_prefill": "disabled"}


def test_vllm_style_keys_map_to_server_args_and_engine_kwargs_win():
    opts = SGLangOptions.from_options({
        "tensor_parallel": 2, "gpu_memory_utilization": 0.3, "max_model_len": 4096, "max_num_seqs": 64,
        "max_num_batched_tokens": 2048, "enable_prefix_caching": False, "sleep_mode": False,
        "weights_cpu_backup": True, "seed_mode": "request",
        # keys of the typed role config and of other backends are ignored
        "max_new_tokens": 32, "temperature": 1.0, "sleep_level": 2, "weight_load": "layerwise",
        "engine_kwargs": {"attention_backend": "triton", "mem_fraction_static": 0.25}})
    kwargs = engine_kwargs(opts, model_path="/m", dtype="float32", seed=1)
    assert kwargs["tp_size"] == 2 and kwargs["context_length"] == 4096
    assert kwargs["max_running_requests"] == 64 and kwargs["chunked_prefill_size"] == 2048
    assert kwargs["disable_radix_cache"] is True and kwargs["enable_memory_saver"] is False
    assert kwargs["enable_weights_cpu_backup"] is True and kwargs["enable_deterministic_inference"] is True
    assert kwargs["attention_backend"] == "triton" and kwargs["mem_fraction_static"] == 0.25
    assert engine_kwargs(SGLangOptions(), model_path="/m", dtype="float32", seed=0)["attention_backend"] == "triton"
    assert "attention_backend" not in engine_kwargs(SGLangOptions(), model_path="/m", dtype="bfloat16", seed=0)
    assert "sleep_level" not in kwargs and "max_new_tokens" not in kwargs


def test_enforce_eager_disables_every_graph_instead_of_the_prefill_one():
    kwargs = engine_kwargs(SGLangOptions.from_options({"enforce_eager": True}), model_path="/m", dtype="bfloat16",
                           seed=0)
    assert kwargs["disable_cuda_graph"] is True and "cuda_graph_backend_prefill" not in kwargs
    kwargs = engine_kwargs(SGLangOptions.from_options({"prefill_cuda_graph": True}), model_path="/m",
                           dtype="bfloat16", seed=0)
    assert "cuda_graph_backend_prefill" not in kwargs and "disable_cuda_graph" not in kwargs


@pytest.mark.parametrize("bad,match", [({"tensor_parallel": 0}, "tensor_parallel"),
                                       ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
                                       ({"seed_mode": "row"}, "seed_mode"), ({"weight_sync": "ipc"}, "weight_sync"),
                                       ({"logprob_top_n": 0}, "logprob_top_n")])
def test_bad_options_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        SGLangOptions.from_options(bad)


def test_split_known_drops_arguments_the_version_lacks():
    accepted, dropped = split_known({"a": 1, "b": 2, "c": 3}, frozenset({"a", "c"}))
    assert accepted == {"a": 1, "c": 3} and dropped == ["b"]
    assert split_known({"a": 1}, frozenset()) == ({"a": 1}, [])


# --- sampling -----------------------------------------------------------------------------------------------
def test_greedy_sampling_params():
    params = SamplingParams(temperature=0.0, top_k=5, top_p=0.5, max_new_tokens=9)
    [phase] = phases(params)
    assert phase_sampling(params, phase, [2, 1]) == {"temperature": 0.0, "max_new_tokens": 9,
                                                     "skip_special_tokens": False, "stop_token_ids": [1, 2]}


def test_sampled_params_translate_top_k_off_to_minus_one():
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=4)
    got = phase_sampling(params, phases(params)[0], [3])
    assert got == {"temperature": 0.7, "top_p": 0.9, "top_k": -1, "max_new_tokens": 4, "skip_special_tokens": False,
                   "stop_token_ids": [3]}
    assert phase_sampling(SamplingParams(top_k=8), Phase(4, False), [3])["top_k"] == 8


def test_ignore_eos_sends_no_stop_tokens():
    params = SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True, min_new_tokens=2)
    assert phases(params) == [Phase(4, False)]
    got = phase_sampling(params, phases(params)[0], [3])
    assert got["ignore_eos"] is True and "stop_token_ids" not in got and "logit_bias" not in got


def test_min_new_tokens_runs_a_banned_phase_then_the_rest():
    params = SamplingParams(temperature=0.0, max_new_tokens=8, min_new_tokens=3)
    assert phases(params) == [Phase(3, True), Phase(5, False)]
    banned = phase_sampling(params, Phase(3, True), [7, 1])
    assert banned["logit_bias"] == {"1": BAN, "7": BAN} and banned["ignore_eos"] is True
    assert banned["max_new_tokens"] == 3 and "stop_token_ids" not in banned
    assert phases(SamplingParams(max_new_tokens=4, min_new_tokens=4)) == [Phase(4, True)]
    with pytest.raises(ValueError, match="exceeds"):
        phases(SamplingParams(max_new_tokens=4, min_new_tokens=5))
    with pytest.raises(ValueError, match="max_new_tokens"):
        phases(SamplingParams(max_new_tokens=0))


def test_request_seeds_differ_by_row_and_replica_and_repeat():
    params = SamplingParams(temperature=1.0, max_new_tokens=2, seed=11)
    rows = per_request(params, Phase(2, False), [1], 4, replica=0, seed_mode="request")
    seeds = [r["sampling_seed"] for r in rows]
    assert len(set(seeds)) == 4 and all(0 <= s < 2**63 for s in seeds)
    again = [r["sampling_seed"] for r in per_request(params, Phase(2, False), [1], 4, 0, "request")]
    other = [r["sampling_seed"] for r in per_request(params, Phase(2, False), [1], 4, 1, "request")]
    assert seeds == again and not set(seeds) & set(other)
    assert all("sampling_seed" not in r for r in per_request(params, Phase(2, False), [1], 4, 0, "engine"))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=2, seed=11)
    assert all("sampling_seed" not in r for r in per_request(greedy, Phase(2, False), [1], 4, 0, "request"))
    assert engine_seed(0, 0) != engine_seed(0, 1) and 0 <= engine_seed(5, 3) < 2**31 - 1
    assert mix_seed(1, 2) != mix_seed(2, 1)


def test_top_logprobs_wanted():
    assert top_logprobs_wanted(SamplingParams(temperature=0.0, top_k=5), 64) == 0
    assert top_logprobs_wanted(SamplingParams(temperature=1.0), 64) == 0
    assert top_logprobs_wanted(SamplingParams(temperature=1.0, top_k=5), 64) == 5
    assert top_logprobs_wanted(SamplingParams(temperature=1.0, top_k=5, top_p=0.8), 64) == 5
    assert top_logprobs_wanted(SamplingParams(temperature=1.0, top_p=0.8), 64) == 64
    # never past the vocabulary (SGLang 0.5.16's scheduler died on topk(64) over a 47-token vocabulary on the H200)
    assert top_logprobs_wanted(SamplingParams(temperature=1.0, top_p=0.8), 64, vocab_size=47) == 47
    assert top_logprobs_wanted(SamplingParams(temperature=1.0, top_k=100), 64, vocab_size=47) == 47
    assert top_logprobs_wanted(SamplingParams(temperature=1.0, top_k=5), 64, vocab_size=47) == 5


# --- packing ------------------------------------------------------------------------------------------------
def test_unpad_prompts_and_refusals():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert unpad_prompts(ids, mask) == [[5, 6, 7], [8]]
    mask[1] = 0
    with pytest.raises(ValueError, match="row 1: empty prompt"):
        unpad_prompts(ids, mask)
    with pytest.raises(ValueError, match="row 1: prompt of 5 tokens"):
        check_context([[1], [1] * 5], 4, 8)
    check_context([[1] * 4], 4, 8)
    check_context([[1] * 40], 4, None)


def test_a_tied_qwen3_moe_is_refused_naming_the_model_path():
    from types import SimpleNamespace

    with pytest.raises(ValueError, match="model.path: '/m' is a qwen3_moe checkpoint with tie_word_embeddings"):
        compat.check_architecture(SimpleNamespace(model_type="qwen3_moe", tie_word_embeddings=True), "/m")
    compat.check_architecture(SimpleNamespace(model_type="qwen3_moe", tie_word_embeddings=False), "/m")
    compat.check_architecture(SimpleNamespace(model_type="qwen2", tie_word_embeddings=True), "/m")


def test_the_tiny_moe_has_a_head_of_its_own():
    """SGLang's Qwen3-MoE loads lm_head.weight whatever the config says, as every Qwen3-MoE checkpoint has one."""
    from hybridrl.config import TinyModelConfig
    from hybridrl.model.tiny import tiny_hf_config

    config = tiny_hf_config(TinyModelConfig(num_experts=4, experts_per_token=2))
    assert config.model_type == "qwen3_moe" and config.tie_word_embeddings is False
    compat.check_architecture(config, "tiny")


def test_routing_is_recorded_from_the_start_only_when_the_run_asks():
    assert "enable_return_routed_experts" not in engine_kwargs(SGLangOptions(), model_path="m", dtype="bfloat16",
                                                               seed=0)
    kwargs = engine_kwargs(SGLangOptions.from_options({"return_routing": True}), model_path="m", dtype="bfloat16",
                           seed=0)
    assert kwargs["enable_return_routed_experts"] is True


def test_routed_experts_decode_sglangs_base64_int32_per_fed_token():
    import base64

    want = torch.arange(5 * 2 * 3, dtype=torch.int32).reshape(5, 2, 3)
    out = {"meta_info": {"routed_experts": base64.b64encode(want.numpy().tobytes()).decode()}}
    got = routed_experts(out, 0, layers=2, top_k=3, fed=5)
    assert torch.equal(got, want)
    # a list answer (no detokenizer) reads the same
    assert torch.equal(routed_experts({"meta_info": {"routed_experts": want.tolist()}}, 0, 2, 3, 5), want)
    with pytest.raises(ValueError, match="row 4: 30 routed expert ids, not 6 fed tokens"):
        routed_experts(out, 4, layers=2, top_k=3, fed=6)
    with pytest.raises(ValueError, match="row 1: SGLang returned no routed_experts"):
        routed_experts({"meta_info": {}}, 1, 2, 3, 5)


def test_parse_output_checks_token_ids():
    out = {"output_ids": [4, 9, 1], "meta_info": {
        "output_token_logprobs": [(-0.5, 4, None), (-1.25, 9, None), (-2.0, 1, None)],
        "output_top_logprobs": [[(-0.5, 4, None), (-1.0, 3, None)], [(-1.25, 9, None)], [(-2.0, 1, None)]]}}
    done = parse_output(out, 0)
    assert done.token_ids == [4, 9, 1] and done.logprobs == [-0.5, -1.25, -2.0]
    assert done.top[0] == [(-0.5, 4), (-1.0, 3)]
    shifted = {"output_ids": [4, 9], "meta_info": {"output_token_logprobs": [(-0.5, 9, None), (-1.0, 4, None)]}}
    with pytest.raises(ValueError, match="row 3, position 0"):
        parse_output(shifted, 3)
    with pytest.raises(ValueError, match="2 output ids but 1 log-probs"):
        parse_output({"output_ids": [4, 9], "meta_info": {"output_token_logprobs": [(-0.5, 4, None)]}}, 0)
    with pytest.raises(ValueError, match="no output_token_logprobs"):
        parse_output({"output_ids": [4], "meta_info": {}}, 0)


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.8), (5, 0.6), (1, 1.0), (0, 0.3)])
def test_renormalise_equals_log_softmax_of_the_filtered_logits(top_k, top_p):
    gen = torch.Generator().manual_seed(top_k * 10 + int(top_p * 10))
    logits = torch.randn(6, 40, generator=gen, dtype=torch.float64) * 2.5
    temperature = 0.7
    scaled = logits / temperature
    full = torch.log_softmax(scaled, dim=-1)  # what SGLang returns: before truncation
    expected = torch.log_softmax(filter_logits(scaled, top_k, top_p), dim=-1)
    for row in range(6):
        top = [(float(v), int(i)) for v, i in zip(*full[row].topk(40 if top_k == 0 else top_k))]
        kept = torch.isfinite(expected[row]).nonzero().flatten().tolist()
        for tok in kept:
            value, exact = renormalise(float(full[row, tok]), top, top_k, top_p, joint=False)
            assert exact
            assert math.isclose(value, float(expected[row, tok]), abs_tol=1e-9)


def _sglang_support(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """SGLang 0.5.16's ``top_k_top_p_min_p_sampling_from_probs_torch`` mask: sort the full distribution, drop
    ranks >= top_k and tokens whose mass before them exceeds top_p (both on the unfiltered probabilities)."""
    probs = torch.softmax(logits, -1)
    probs_sort, probs_idx = probs.sort(dim=-1, descending=True)
    probs_sum = torch.cumsum(probs_sort, dim=-1)
    keep = torch.ones_like(probs_sort, dtype=torch.bool)
    if top_k > 0:
        keep &= torch.arange(probs.shape[-1])[None] < top_k
    keep &= (probs_sum - probs_sort) <= top_p
    return torch.zeros_like(keep).scatter(-1, probs_idx, keep)


@pytest.mark.parametrize("top_k,top_p", [(8, 0.5), (3, 0.9), (20, 0.7), (0, 0.6), (6, 1.0)])
def test_renormalise_joint_matches_sglangs_sampler_support(top_k, top_p):
    gen = torch.Generator().manual_seed(7 + top_k)
    scaled = torch.randn(5, 40, generator=gen, dtype=torch.float64) * 2.0
    full = torch.log_softmax(scaled, -1)
    support = _sglang_support(scaled, top_k, top_p)
    expected = torch.log_softmax(scaled.masked_fill(~support, float("-inf")), -1)
    for row in range(5):
        top = [(float(v), int(i)) for v, i in zip(*full[row].topk(top_k or 40))]
        for tok in support[row].nonzero().flatten().tolist():
            value, exact = renormalise(float(full[row, tok]), top, top_k, top_p)
            assert exact and math.isclose(value, float(expected[row, tok]), abs_tol=1e-9)


def test_renormalise_without_truncation_and_with_too_few_entries():
    assert renormalise(-1.5, [], 0, 1.0) == (-1.5, True)
    # the nucleus needs more than the two entries returned: not exact
    lp = math.log(0.2)
    value, exact = renormalise(lp, [(lp, 1), (math.log(0.2), 2)], 0, 0.9)
    assert not exact and math.isclose(value, lp - math.log(0.4))
    assert renormalise(lp, [(lp, 1)], 5, 1.0)[1] is False


def test_pack_responses_pads_and_masks():
    out = pack_responses([[4, 1], [], [5, 6, 7]], [[-0.5, -1.0], [], [-0.1, -0.2, -0.3]], 3, pad_id=0)
    assert out[RESPONSE_IDS].tolist() == [[4, 1, 0], [0, 0, 0], [5, 6, 7]]
    assert out[RESPONSE_MASK].tolist() == [[1, 1, 0], [0, 0, 0], [1, 1, 1]]
    torch.testing.assert_close(out[ROLLOUT_LOG_PROBS], torch.tensor([[-0.5, -1.0, 0], [0, 0, 0], [-0.1, -0.2, -0.3]]))
    with pytest.raises(ValueError, match="row 0: 4 tokens returned"):
        pack_responses([[1, 2, 3, 4]], [[0.0] * 4], 3, 0)


# --- buckets ------------------------------------------------------------------------------------------------
def _bucket() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [("w", torch.randn(3, 5, generator=g)), ("b", torch.randn(7, generator=g)),
            ("ids", torch.arange(3, dtype=torch.int64)), ("h", torch.randn(2, 2, generator=g).to(torch.float16))]


def test_packed_layout_is_aligned_and_casts_floats_only():
    entries, total = bk.plan_packed(_bucket(), torch.bfloat16)
    assert [(e.name, e.dtype, e.start, e.end) for e in entries] == [
        ("w", torch.bfloat16, 0, 30), ("b", torch.bfloat16, 64, 78), ("ids", torch.int64, 128, 152),
        ("h", torch.bfloat16, 192, 200)]
    assert total == 256 and entries[1].numel == 14


def test_pack_then_sglang_reconstruction_gives_the_cast_tensors():
    bucket = _bucket()
    flat, entries = bk.pack(bucket, torch.bfloat16, "cpu")
    assert flat.dtype == torch.uint8
    # SGLang 0.5.16 FlattenedTensorBucket.reconstruct_tensors: flat[start:end].view(dtype).reshape(shape)
    rebuilt = {e.name: flat[e.start:e.end].view(e.dtype).reshape(e.shape) for e in entries}
    for name, tensor in bucket:
        want = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert torch.equal(rebuilt[name], want), name


def test_views_of_one_receive_buffer_are_sent_without_a_copy():
    bucket = _bucket()
    spec = describe_bucket(bucket)
    buffer = pack_bucket(bucket, spec, "cpu")  # the broadcast bridge's receive buffer
    views = unpack_bucket(buffer, spec)
    flat, entries, shared = bk.flatten(views, torch.bfloat16, "cpu")
    assert shared and flat.data_ptr() == buffer.data_ptr() and flat.numel() == buffer.numel()
    for (_name, tensor), e in zip(bucket, entries):
        assert e.dtype == tensor.dtype  # sent as they are; SGLang casts on load
        assert torch.equal(flat[e.start:e.end].view(e.dtype).reshape(e.shape), tensor)
    assert bk.rebuild(flat, entries)[0][0] == "w"


def test_separate_or_strided_tensors_are_packed():
    bucket = _bucket()
    assert bk.shared_storage(bucket) is None
    base = torch.randn(4, 6)
    assert bk.shared_storage([("t", base.t())]) is None  # not contiguous
    assert bk.shared_storage([("a", base[:2]), ("b", base[2:])]) is not None
    _, _, shared = bk.flatten(bucket, torch.float32, "cpu")
    assert not shared
    assert bk.shared_storage([]) is None


# --- memory stages ------------------------------------------------------------------------------------------
def test_rl_loop_releases_weights_only_once_imports_refill_them():
    s = MemoryState()
    assert s.on_sleep() == [KV_CACHE]  # initial weights are fresh: kept
    assert s.on_sleep() == []  # already asleep
    assert s.on_wake() == [KV_CACHE]
    s.on_generate()
    assert s.on_sleep() == [KV_CACHE]  # no import seen while asleep yet
    assert s.on_import_begin() == []
    s.on_import_end()
    assert s.on_wake() == [KV_CACHE]
    s.on_generate()
    assert s.on_sleep() == [KV_CACHE, WEIGHTS]  # now the loop is known to resync
    assert s.on_import_begin() == [WEIGHTS]  # weights alone, KV cache still released
    s.on_import_end()
    assert s.on_wake() == [KV_CACHE]


def test_cpu_backup_releases_weights_every_time_and_wakes_weights_first():
    s = MemoryState(cpu_backup=True)
    assert s.on_sleep() == [KV_CACHE, WEIGHTS]
    assert s.on_wake() == [WEIGHTS, KV_CACHE]


def test_waking_released_weights_without_an_import_raises():
    s = MemoryState(weights="released", kv_released=True)
    with pytest.raises(RuntimeError, match="weights_cpu_backup"):
        s.on_wake()
    with pytest.raises(RuntimeError, match="asleep"):
        MemoryState(kv_released=True).on_generate()


# --- rank layout --------------------------------------------------------------------------------------------
def test_replica_layout():
    lay = ReplicaLayout(rank=5, world_size=6, tp=2)
    assert (lay.replica, lay.replicas, lay.tp_rank, lay.leader, lay.peers) == (2, 3, 1, False, [4, 5])
    info = lay.data_parallel()
    assert (info.dp_rank, info.dp_size, info.returns_output) == (2, 3, False)
    assert ReplicaLayout(4, 6, 2).data_parallel().returns_output
    with pytest.raises(ValueError, match="not a multiple"):
        ReplicaLayout(0, 3, 2)


def test_engine_devices_for_the_leader():
    visible = ["3", "5", "0", "1"]
    assert engine_devices(ReplicaLayout(0, 4, 2), visible) == "3,5"
    assert engine_devices(ReplicaLayout(2, 4, 2), visible) == "0,1"
    assert engine_devices(ReplicaLayout(0, 4, 1), visible) is None
    assert engine_devices(ReplicaLayout(0, 2, 2), [None, None]) is None
    with pytest.raises(ValueError, match="share GPUs"):
        engine_devices(ReplicaLayout(0, 2, 2), ["0", "0"])
    with pytest.raises(ValueError, match="some ranks"):
        engine_devices(ReplicaLayout(0, 2, 2), ["0", None])


# --- split mode wire format ---------------------------------------------------------------------------------
def test_receive_layout_sorts_by_element_size_and_casts_floats():
    bucket = [("h", torch.zeros(3, dtype=torch.float16)), ("w", torch.zeros(2, 3)),
              ("ids", torch.zeros(5, dtype=torch.int64)), ("m", torch.zeros(1, dtype=torch.bool))]
    [entries] = receive_layout([describe_bucket(bucket)], "bfloat16")
    assert entries == [("ids", "int64", [5]), ("h", "bfloat16", [3]), ("w", "bfloat16", [2, 3]), ("m", "bool", [1])]
    assert flat_nbytes(entries) == 40 + 6 + 12 + 1


def test_pack_flat_is_sglangs_flattened_tensor_bucket():
    bucket = _bucket()
    [entries] = receive_layout([describe_bucket(bucket)], "bfloat16")
    flat = pack_flat(bucket, entries, "cpu")
    tensors = dict(bucket)
    # FlattenedTensorBucket(named_tensors=...): torch.cat of each tensor's flatten().view(uint8), in order
    want = torch.cat([(tensors[n].to(getattr(torch, d)) if tensors[n].is_floating_point() else tensors[n])
                      .flatten().view(torch.uint8) for n, d, _ in entries])
    assert torch.equal(flat, want)
    with pytest.raises(ValueError, match="bucket holds"):
        pack_flat(bucket[:2], entries, "cpu")


def test_split_protocol_over_gloo_against_sglangs_receiver(tmp_path: Path):
    worker = Path(__file__).with_name("_dist_worker.py")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, str(worker), role, str(port), str(tmp_path / f"{role}.json"),
                               "bfloat16"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for role in ("sender", "receiver")]
    for p in procs:
        out, _ = p.communicate(timeout=240)
        assert p.returncode == 0, out[-4000:]
    sys.path.insert(0, str(worker.parent))
    try:
        from _dist_worker import _bucket_state
    finally:
        sys.path.pop(0)
    got = json.loads((tmp_path / "receiver.json").read_text())
    expected = {n: t for b in _bucket_state(0) for n, t in b}
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        want = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert got[name]["dtype"] == str(want.dtype) and got[name]["shape"] == list(want.shape)
        assert got[name]["values"] == want.to(torch.float64).flatten().tolist(), name
    assert json.loads((tmp_path / "sender.json").read_text())["sent"] > 0


def test_bridge_defaults_to_the_core_broadcast_bridge():
    calls = []

    class Group:
        def broadcast(self, role, method, *args):
            calls.append((role, method, args))
            return Result(["channel"], 0.0)

    bridge = SGLangBroadcastBridge()
    bridge.fallback = type("F", (), {"sync": lambda self, *a: calls.append(("fallback", a)) or {"bytes": 1.0}})()
    assert bridge.sync(Group(), "actor", Group(), "rollout", 64) == {"bytes": 1.0}
    assert calls[0] == ("rollout", "weight_sync_mode", ()) and calls[1][0] == "fallback"


# --- the engine against a fake sglang.Engine -----------------------------------------------------------------
VOCAB, EOS, PAD = 24, 1, 0


class FakeSGLang:
    """Behaves as ``sglang.Engine`` 0.5.16 for what the plugin uses: next-token logits from a fixed table
    indexed by the last token; ``logit_bias`` added before sampling and log-probs; log-probs of
    ``softmax(logits / T)`` before top-k/top-p; stop at ``stop_token_ids`` unless ``ignore_eos``."""

    def __init__(self, table: torch.Tensor, context_len: int = 64) -> None:
        self.table = table
        self.tokenizer_manager = type("TM", (), {"context_len": context_len})()
        self.calls: list[tuple] = []
        self.top_asked: list[int | None] = []
        self.gen = torch.Generator().manual_seed(0)
        import asyncio

        self.loop = asyncio.new_event_loop()  # as Engine.__init__ makes one

    def generate(self, input_ids, sampling_params, return_logprob, top_logprobs_num=None):
        self.calls.append(("generate", [list(i) for i in input_ids], [dict(s) for s in sampling_params],
                           return_logprob))
        self.top_asked.append(top_logprobs_num)
        outs = []
        for ids, sp in zip(input_ids, sampling_params):
            last, toks, lps, tops = ids[-1], [], [], []
            for _ in range(sp["max_new_tokens"]):
                logits = self.table[last].clone()
                for key, bias in (sp.get("logit_bias") or {}).items():
                    logits[int(key)] += bias
                if sp["temperature"] == 0.0:
                    tok = int(logits.argmax())
                    logp = torch.log_softmax(logits, -1)
                else:
                    scaled = logits / sp["temperature"]
                    logp = torch.log_softmax(scaled, -1)
                    k = sp.get("top_k", -1)
                    probs = torch.softmax(filter_logits(scaled[None], k if k > 0 else 0, sp.get("top_p", 1.0))[0], -1)
                    tok = int(torch.multinomial(probs, 1, generator=self.gen))
                toks.append(tok)
                lps.append((float(logp[tok]), tok, None))
                if top_logprobs_num:
                    v, i = logp.topk(min(top_logprobs_num, logp.numel()))
                    tops.append([(float(a), int(b), None) for a, b in zip(v, i)])
                last = tok
                if not sp.get("ignore_eos") and tok in (sp.get("stop_token_ids") or []):
                    break
            meta = {"output_token_logprobs": lps} if return_logprob else {}
            if top_logprobs_num and return_logprob:
                meta["output_top_logprobs"] = tops
            outs.append({"output_ids": toks, "meta_info": meta})
        return outs

    async def async_generate(self, input_ids, sampling_params, return_logprob, top_logprobs_num=None):
        """One request, as ``Engine.async_generate``; it yields first, so requests interleave."""
        import asyncio

        assert asyncio.get_running_loop() is self.loop, "async_generate awaited off the engine's loop"
        await asyncio.sleep(0)
        return self.generate([input_ids], [sampling_params], return_logprob, top_logprobs_num)[0]

    def release_memory_occupation(self, tags):
        self.calls.append(("release", list(tags)))

    def resume_memory_occupation(self, tags):
        self.calls.append(("resume", list(tags)))

    def flush_cache(self):
        self.calls.append(("flush",))

    def shutdown(self):
        self.calls.append(("shutdown",))


@pytest.fixture
def fake_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from transformers import GenerationConfig, Qwen2Config

    Qwen2Config(vocab_size=VOCAB, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1,
                num_key_value_heads=1, eos_token_id=EOS, pad_token_id=PAD).save_pretrained(tmp_path)
    GenerationConfig(eos_token_id=EOS, pad_token_id=PAD).save_pretrained(tmp_path)
    table = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 3
    table[:, EOS] += 2.0  # EOS is often the argmax: stops happen
    fake = FakeSGLang(table)
    flats: list = []
    started: list = []
    monkeypatch.setattr(compat, "check_version", lambda: None)
    monkeypatch.setattr(compat, "version", lambda: compat.Version("0.5.16"))
    monkeypatch.setattr(compat, "start_engine", lambda kwargs, devices: started.append((kwargs, devices)) or fake)
    monkeypatch.setattr(compat, "current_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(compat, "device_memory", lambda: (100 * 2**30, 140 * 2**30))  # (free, total) of a GPU
    monkeypatch.setattr(compat, "synchronize", lambda: None)
    monkeypatch.setattr(compat, "ipc_collect", lambda: None)
    monkeypatch.setattr(compat, "supports_flattened_bucket", lambda: True)
    monkeypatch.setattr(compat, "update_flat", lambda engine, flat, entries, tp: flats.append(
        (tp, {e.name: flat[e.start:e.end].view(e.dtype).reshape(e.shape).clone() for e in entries}, flat)))
    from hybridrl_sglang.engine import SGLangRollout

    def make(dtype="bfloat16", **options):
        ctx = EngineContext(role="rollout", backend="sglang", model_path=str(tmp_path), rank=0, world_size=1,
                            device="cuda", dtype=dtype, seed=0, trainable=False, options=options)
        return SGLangRollout(ctx)

    return {"make": make, "fake": fake, "flats": flats, "started": started, "table": table}


PROMPTS = [[3, 4, 5], [7], [9, 2]]


def _prompts() -> Batch:
    ids, mask = left_pad(PROMPTS, pad_id=PAD)
    return Batch.from_tensors({PROMPT_IDS: ids, PROMPT_MASK: mask})


def _greedy(table: torch.Tensor, prompt: list[int], width: int, min_new: int = 0, ignore_eos: bool = False):
    toks, lps, last = [], [], prompt[-1]
    for step in range(width):
        logits = table[last].clone()
        if step < min_new:
            logits[EOS] = float("-inf")
        logp = torch.log_softmax(logits, -1)
        tok = int(logits.argmax())
        toks.append(tok)
        lps.append(float(logp[tok]))
        last = tok
        if tok == EOS and not ignore_eos:
            break
    return toks, lps


def test_engine_start_arguments(fake_engine):
    engine = fake_engine["make"](gpu_memory_utilization=0.4)
    kwargs, devices = fake_engine["started"][0]
    assert kwargs["mem_fraction_static"] == 0.4 and kwargs["dtype"] == "bfloat16" and devices is None
    assert engine.eos_ids == [EOS] and engine.pad_id == PAD and engine.context_length == 64


@pytest.mark.parametrize("min_new,ignore_eos", [(0, False), (4, False), (0, True)])
def test_engine_greedy_outputs_follow_the_model(fake_engine, min_new, ignore_eos):
    engine, table = fake_engine["make"](), fake_engine["table"]
    width = 6
    out = engine.generate(_prompts(), SamplingParams(temperature=0.0, max_new_tokens=width, min_new_tokens=min_new,
                                                     ignore_eos=ignore_eos))
    stopped = 0
    for i, prompt in enumerate(PROMPTS):
        toks, lps = _greedy(table, prompt, width, min_new, ignore_eos)
        n = len(toks)
        stopped += n < width
        assert out[RESPONSE_IDS][i, :n].tolist() == toks and (out[RESPONSE_IDS][i, n:] == PAD).all()
        assert out[RESPONSE_MASK][i].tolist() == [1] * n + [0] * (width - n)
        torch.testing.assert_close(out[ROLLOUT_LOG_PROBS][i, :n], torch.tensor(lps, dtype=torch.float32))
    if min_new == 0 and not ignore_eos:
        assert stopped, "no row stopped: the EOS path is untested"
    if min_new:
        assert (out[RESPONSE_MASK].sum(1) >= min_new).all()
        assert len([c for c in fake_engine["fake"].calls if c[0] == "generate"]) == 2


def test_phase_budgets_cut_each_phase_to_the_rows_cap():
    ban, rest = phases(SamplingParams(max_new_tokens=8, min_new_tokens=3))
    assert phase_budgets(ban, [8, 2, 5], [0, 0, 0]) == [3, 2, 3]  # a cap below min_new_tokens ends in the ban
    assert phase_budgets(rest, [8, 2, 5], [3, 2, 3]) == [5, 0, 2]
    rows = per_request(SamplingParams(max_new_tokens=8, seed=4, temperature=1.0), rest, [1], 3, 0, "request",
                       budgets=[5, 0, 2])
    assert [r["max_new_tokens"] for r in rows] == [5, 0, 2]
    assert [r["sampling_seed"] for r in rows] == [r["sampling_seed"] for r in per_request(
        SamplingParams(max_new_tokens=8, seed=4, temperature=1.0), rest, [1], 3, 0, "request")]


@pytest.mark.parametrize("min_new,ignore_eos", [(0, False), (4, False), (0, True)])
def test_engine_honours_per_row_caps(fake_engine, min_new, ignore_eos):
    """On the fake engine (the logic around SGLang, not SGLang): each row the first ``cap`` tokens of its
    uncapped run, at the call's width; a spent row sends no request."""
    from hybridrl.engines.batch import MAX_NEW_TOKENS

    engine, fake = fake_engine["make"](), fake_engine["fake"]
    width = 6
    params = SamplingParams(temperature=0.0, max_new_tokens=width, min_new_tokens=min_new, ignore_eos=ignore_eos)
    full = engine.generate(_prompts(), params)
    caps = [2, 0, 5]
    batch = _prompts()
    batch.set(MAX_NEW_TOKENS, torch.tensor(caps))
    fake.calls.clear()
    out = engine.generate(batch, params)
    assert out[RESPONSE_IDS].shape == (3, width)
    for i, cap in enumerate(caps):
        n = min(cap, int(full[RESPONSE_MASK][i].sum()))
        assert out[RESPONSE_MASK][i].tolist() == [1] * n + [0] * (width - n)
        assert out[RESPONSE_IDS][i, :n].tolist() == full[RESPONSE_IDS][i, :n].tolist()
        torch.testing.assert_close(out[ROLLOUT_LOG_PROBS][i, :n], full[ROLLOUT_LOG_PROBS][i, :n])
    sent = [row for call in fake.calls if call[0] == "generate" for row in call[1]]
    assert sent and all(s[:len(PROMPTS[1])] != PROMPTS[1] for s in sent)  # row 1 (cap 0) asked nothing


def test_engine_refuses_float32_before_starting_sglang(fake_engine):
    with pytest.raises(RuntimeError, match="cannot run a float32 model.*bfloat16"):
        fake_engine["make"](dtype="float32")
    assert fake_engine["started"] == []  # refused before any engine process was started


def test_engine_asks_for_no_more_top_log_probs_than_the_vocabulary(fake_engine):
    engine = fake_engine["make"](logprob_top_n=64)
    assert engine.vocab_size == VOCAB
    engine.generate(_prompts(), SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=3))
    assert fake_engine["fake"].top_asked[-1] == VOCAB


def test_engine_without_log_probs_does_not_ask_for_them(fake_engine):
    engine, table = fake_engine["make"](), fake_engine["table"]
    out = engine.generate(_prompts(), SamplingParams(temperature=0.0, max_new_tokens=6, logprobs=False, top_k=4))
    assert ROLLOUT_LOG_PROBS not in out
    call = [c for c in fake_engine["fake"].calls if c[0] == "generate"][-1]
    assert call[3] is False  # return_logprob off: the engine skips the log-softmax
    for i, prompt in enumerate(PROMPTS):
        toks, _ = _greedy(table, prompt, 6)
        assert out[RESPONSE_IDS][i, :len(toks)].tolist() == toks


@pytest.mark.parametrize("top_k,top_p", [(4, 1.0), (0, 0.7)])
def test_engine_sampled_log_probs_are_of_the_truncated_distribution(fake_engine, top_k, top_p):
    engine, table = fake_engine["make"](), fake_engine["table"]
    temperature = 0.8
    out = engine.generate(_prompts(), SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                                                     max_new_tokens=5, ignore_eos=True))
    for i, prompt in enumerate(PROMPTS):
        history = prompt + out[RESPONSE_IDS][i].tolist()
        for pos in range(5):
            last, tok = history[len(prompt) - 1 + pos], history[len(prompt) + pos]
            want = torch.log_softmax(filter_logits((table[last] / temperature)[None], top_k, top_p)[0], -1)[tok]
            assert math.isclose(float(out[ROLLOUT_LOG_PROBS][i, pos]), float(want), rel_tol=1e-5, abs_tol=1e-5)
    assert engine.inexact_logprobs == 0


def test_engine_refuses_bad_rows_before_generating(fake_engine):
    engine = fake_engine["make"]()
    ids, mask = left_pad([[3], [4] * 60], pad_id=PAD)
    with pytest.raises(ValueError, match="row 1: prompt of 60 tokens"):
        engine.generate(Batch.from_tensors({PROMPT_IDS: ids, PROMPT_MASK: mask}),
                        SamplingParams(temperature=0.0, max_new_tokens=8))
    assert not fake_engine["fake"].calls


def test_engine_import_flattens_each_bucket_and_flushes_once(fake_engine):
    engine = fake_engine["make"]()
    bucket = _bucket()
    engine.import_weights(bucket[:2])
    engine.import_weights(bucket[2:])
    engine.finish_weight_import()
    assert len(fake_engine["flats"]) == 2 and fake_engine["fake"].calls == [("flush",)]
    got = {**fake_engine["flats"][0][1], **fake_engine["flats"][1][1]}
    for name, tensor in bucket:
        want = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert torch.equal(got[name], want)
    assert engine.weight_version == 1 and engine.import_counters["shared"] == 0
    # the broadcast bridge's receive buffer goes as it is
    spec = describe_bucket(bucket)
    buffer = pack_bucket(bucket, spec, "cpu")
    engine.import_weights(unpack_bucket(buffer, spec))
    engine.finish_weight_import()
    assert fake_engine["flats"][-1][2].data_ptr() == buffer.data_ptr() and engine.import_counters["shared"] == 1


def test_engine_memory_stages_in_the_training_loop(fake_engine):
    engine, fake = fake_engine["make"](), fake_engine["fake"]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=2)

    def step_calls(fn):
        fake.calls.clear()
        fn()
        return [c for c in fake.calls if c[0] != "generate"]

    assert step_calls(engine.sleep) == [("release", [KV_CACHE])]
    assert step_calls(engine.wake) == [("resume", [KV_CACHE])]
    engine.generate(_prompts(), greedy)
    assert step_calls(engine.sleep) == [("release", [KV_CACHE])]

    def sync():
        engine.import_weights(_bucket())
        engine.finish_weight_import()

    assert step_calls(sync) == [("flush",)]
    assert step_calls(engine.wake) == [("resume", [KV_CACHE])]
    engine.generate(_prompts(), greedy)
    assert step_calls(engine.sleep) == [("release", [KV_CACHE, WEIGHTS])]
    assert step_calls(sync) == [("resume", [WEIGHTS]), ("flush",)]  # weights first, before the update
    assert step_calls(engine.wake) == [("resume", [KV_CACHE])]
    with pytest.raises(RuntimeError, match="during a weight import"):
        engine.import_weights(_bucket())
        engine.generate(_prompts(), greedy)


def test_engine_without_sleep_mode_never_releases(fake_engine):
    engine, fake = fake_engine["make"](sleep_mode=False), fake_engine["fake"]
    engine.sleep()
    engine.wake()
    assert fake.calls == [] and fake_engine["started"][0][0]["enable_memory_saver"] is False


def test_engine_close_shuts_sglang_down(fake_engine):
    engine = fake_engine["make"]()
    engine.close()
    engine.close()
    assert fake_engine["fake"].calls == [("shutdown",)]


# --- gpu_memory_utilization: auto (hybridrl.rollout.kv_budget) ------------------------------------------
from hybridrl.rollout.kv_budget import KVCacheTooSmall, KVDemand  # noqa: E402

GIB = 2**30

def test_sglang_auto_fraction_makes_the_pool_the_target():
    from hybridrl_sglang.options import (
        LOAD_EXTRA_BYTES,
        SCHEDULER_START_BYTES,
        SGLangOptions,
        auto_fraction,
        engine_kwargs,
    )

    assert SGLangOptions.from_options({}).gpu_memory_utilization == "auto"
    demand = KVDemand(512, 384, 28672)  # 1.5B
    free, weights = 100 * GIB, 3 * GIB
    memory = auto_fraction(free, weights, overhead_bytes=3 * GIB, bytes_per_token=28672, demand=demand)
    pre = free - SCHEDULER_START_BYTES
    # SGLang 0.5.16: pool = (pre - weights - what loading adds) - pre x (1 - fraction) >= the target; the cap trims it
    pool = (pre - weights - LOAD_EXTRA_BYTES) - pre * (1 - memory.fraction)
    assert pool >= demand.target_bytes
    assert memory.max_total_tokens == demand.target_bytes // 28672 >= demand.tokens
    # what SGLang leaves outside its static share covers its graphs and activations
    assert pre * (1 - memory.fraction) >= 3 * GIB
    kwargs = engine_kwargs(SGLangOptions.from_options({}), model_path="/m", dtype="bfloat16", seed=0, memory=memory)
    assert kwargs["mem_fraction_static"] == memory.fraction and kwargs["max_total_tokens"] == memory.max_total_tokens


def test_sglang_numeric_fraction_must_hold_the_weights():
    from hybridrl_sglang.options import check_fraction

    check_fraction(0.5, free_bytes=60 * GIB, weights_bytes=15 * GIB)
    with pytest.raises(KVCacheTooSmall, match="gpu_memory_utilization=0.2 gives SGLang"):
        check_fraction(0.2, free_bytes=60 * GIB, weights_bytes=15 * GIB)


# --- single requests (multi-turn episodes) on the fake engine ------------------------------------------------
@pytest.mark.parametrize("min_new", [0, 4])
def test_a_request_runs_the_phases_of_generate(fake_engine, min_new):
    import asyncio

    engine, table = fake_engine["make"](), fake_engine["table"]
    params = SamplingParams(temperature=0.0, max_new_tokens=6, min_new_tokens=min_new)

    async def all_requests():
        return await asyncio.gather(*(engine.generate_request(p, params) for p in PROMPTS))

    outs = engine.run_requests(all_requests())
    for prompt, out in zip(PROMPTS, outs):
        toks, lps = _greedy(table, prompt, 6, min_new)
        assert out.token_ids == toks
        torch.testing.assert_close(torch.tensor(out.log_probs, dtype=torch.float64),
                                   torch.tensor(lps, dtype=torch.float64))
    singles = [c for c in fake_engine["fake"].calls if c[0] == "generate"]
    assert len(singles) == len(PROMPTS) * (2 if min_new else 1)  # one call per request and phase


def test_episodes_per_request_equal_batched_rounds(fake_engine, tmp_path):
    from dataclasses import replace

    from hybridrl.environments.runner import run_episodes
    from hybridrl.environments.spec import EnvironmentSpec
    from hybridrl.environments.trajectory import NUM_TURNS
    from hybridrl.model.tokenizer import build_char_tokenizer
    from hybridrl.plugins.discovery import get_registry

    assert get_registry().backend("rollout", "sglang").can("requests")
    engine = fake_engine["make"]()
    build_char_tokenizer().save_pretrained(engine.ctx.model_path)  # the runner decodes turns with it
    batch = _prompts()
    batch.set("prompt", ["a", "b", "c"])
    batch.set("meta", [{}, {}, {}])
    spec = EnvironmentSpec(name="tools", max_turns=3, max_total_tokens=20, tools=("calculator",), tool_parser="arith",
                           plain_template="{content}")
    params = SamplingParams(temperature=0.0, max_new_tokens=5)
    per_request = run_episodes(engine, batch, params, replace(spec, mode="requests"))
    batched = run_episodes(engine, batch, params, replace(spec, mode="batched"))
    for key in (RESPONSE_IDS, RESPONSE_MASK, ROLLOUT_LOG_PROBS, NUM_TURNS):
        assert torch.equal(per_request[key], batched[key]), key
