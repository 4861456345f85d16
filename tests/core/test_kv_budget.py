"""The KV cache sizing rule of ``gpu_memory_utilization: auto`` (``hybridrl.rollout.kv_budget``) and the share each
backend turns it into (vLLM: ``kv_cache_memory_bytes`` and a share of total memory that passes its start-up
check; SGLang 0.5.16: ``mem_fraction_static`` of the memory free at its start and ``max_total_tokens``)."""

from __future__ import annotations

import pickle

import pytest

from hybridrl.rollout.kv_budget import KV_HEADROOM, KVCacheTooSmall, KVDemand, demand_from_options, size_kv_cache

GIB = 2**30


def test_the_floor_is_the_steps_sequences_in_whole_blocks():
    demand = KVDemand(sequences=512, tokens_per_sequence=384, bytes_per_token=24576)
    assert demand.tokens == 512 * 384  # 384 is 24 blocks of 16
    odd = KVDemand(sequences=3, tokens_per_sequence=17, bytes_per_token=10)
    assert odd.tokens == 3 * 32 and odd.floor_bytes == 960
    assert demand.target_bytes == pytest.approx(demand.floor_bytes * KV_HEADROOM, abs=1)
    long_context = KVDemand(2, 10, 100, context_tokens=10_000)  # the engine needs room for one full context
    assert long_context.target_bytes == (10_000 + 16) * 100


def test_the_cache_is_the_target_when_memory_allows_and_never_more_than_is_left():
    demand = KVDemand(512, 384, 24576)
    roomy = size_kv_cache(demand, free_bytes=100 * GIB, weights_bytes=GIB, overhead_bytes=2 * GIB)
    assert roomy.kv_bytes == demand.target_bytes
    tight_free = demand.floor_bytes + GIB + 2 * GIB + roomy.margin_bytes + 1000  # the floor and a little more
    tight = size_kv_cache(demand, tight_free, GIB, 2 * GIB)
    assert tight.kv_bytes == tight.available_bytes and demand.floor_bytes <= tight.kv_bytes < demand.target_bytes
    assert tight.notes and "above the step's floor" in tight.notes[0]


def test_below_the_floor_is_an_error_with_the_key_and_the_numbers():
    demand = KVDemand(512, 384, 57344)  # 7B: 10.5 GiB for the step
    with pytest.raises(KVCacheTooSmall) as info:
        size_kv_cache(demand, free_bytes=20 * GIB, weights_bytes=15 * GIB, overhead_bytes=3 * GIB, device="cuda:0")
    message = str(info.value)
    assert "roles.rollout.options.gpu_memory_utilization=auto" in message
    assert "512 sequences x 384 tokens" in message and "10.50 GiB" in message and "cuda:0" in message
    assert "free 20.00 GiB - engine weights 15.00 GiB" in message
    assert message.index("roles.ref.options.offload=all") < message.index("roles.actor.options.offload=optimizer")
    again = pickle.loads(pickle.dumps(info.value))  # crosses Ray with its numbers
    assert str(again) == message and again.report["floor_bytes"] == demand.floor_bytes


def test_without_a_workload_the_cache_takes_what_is_left():
    sizing = size_kv_cache(None, free_bytes=50 * GIB, weights_bytes=GIB, overhead_bytes=GIB)
    assert sizing.kv_bytes == 50 * GIB - 2 * GIB - sizing.margin_bytes
    with pytest.raises(KVCacheTooSmall, match="no memory left"):
        size_kv_cache(None, free_bytes=GIB, weights_bytes=GIB, overhead_bytes=GIB)


def test_demand_from_the_workload_option_is_per_replica():
    options = {"workload": {"sequences": 512, "tokens_per_sequence": 384}}
    assert demand_from_options(options, replicas=2, bytes_per_token=100).sequences == 256
    assert demand_from_options(options, replicas=3, bytes_per_token=100).sequences == 171  # rounded up
    assert demand_from_options({}, replicas=1, bytes_per_token=100) is None
