"""``SGLangRollout`` on a real SGLang and GPU, against transformers: greedy outputs and log-probs are those of a
transformers model with the same weights, before and after weight syncs (CPU buckets, CUDA buckets, and the
views of one receive buffer the broadcast bridge hands over), across sleep/wake with the weights released, and
sampled tokens carry the log-probs of the distribution they were drawn from.

The comparison is the conformance kit's (``hybridrl.testing.checks.reference_problems``): one teacher-forced float32
transformers forward over each row's tokens; a greedy token must be the reference argmax or within a near-tie of it,
log-probs within a tolerance. The engine runs in bfloat16 (SGLang's own kernels; the weights are bfloat16 values, so
both sides hold the same ones) unless ``HYBRIDRL_SGLANG_TEST_DTYPE=float32`` (for a version that runs float32:
0.5.16 is refused, see ``compat.check_dtype``). The engines run without CUDA graphs (``enforce_eager``): they start
in seconds instead of minutes, and the graphs are exercised by the GRPO run and the rollout benchmark
(``benchmarks/vllm_rollout.py --backend sglang``), which check the rollout against the actor after every sync.
Skipped without SGLang or CUDA (``conftest.py``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hybridrl.engines import EngineContext, SamplingParams
from hybridrl.engines.batch import RESPONSE_IDS, RESPONSE_MASK, Batch
from hybridrl.rollout.hf import HFRollout
from hybridrl.testing.batches import prompt_batch
from hybridrl.testing.checks import reference_problems
from hybridrl.testing.models import set_eos
from hybridrl.testing.reference import ReferenceModel
from hybridrl.weights.buckets import describe_bucket, pack_bucket, unpack_bucket

pytestmark = [pytest.mark.sglang, pytest.mark.gpu]

DTYPE = os.environ.get("HYBRIDRL_SGLANG_TEST_DTYPE", "bfloat16")
#: (log-prob atol, greedy near-tie tolerance, widening per unit of the row's largest logit) against the float32
#: CPU reference. bfloat16 rounds relative to magnitude (2**-8 per operation): this wide-init model has logits up to
#: ~16, and on the H200 SGLang's log-probs differed from the reference by up to 0.29 with the right weights, while
#: the wrong weights (model A against B) differ by whole units; 2**-5 allows ~8 roundings of the largest logit.
TOLERANCE = {"bfloat16": (0.1, 0.05, 2**-5), "float32": (2e-3, 1e-4, 0.0)}[DTYPE]
CONTEXT = 128
PROMPTS = [[3, 5, 6, 7], [8, 9], [11, 12, 13, 14, 15], [20, 21, 22], [30, 4], [40, 41, 42, 43, 44, 45]]
WIDTH = 10
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=WIDTH)


def _bf16_values(t: torch.Tensor) -> torch.Tensor:
    """Round to bfloat16 and back: the engine (bf16) and the reference (fp32) then hold identical weights."""
    return t.to(torch.bfloat16).to(t.dtype) if t.is_floating_point() else t


def _save_qwen2(path: Path, seed: int) -> Path:
    """A 2-layer Qwen2 (head size 64, tied embeddings) with a wide init, so greedy continuations vary and
    near-ties are rare."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                         initializer_range=0.3, tie_word_embeddings=True, eos_token_id=1, pad_token_id=0,
                         use_sliding_window=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(_bf16_values(p))
    model.generation_config = GenerationConfig(eos_token_id=1, pad_token_id=0)
    model.save_pretrained(path)
    from hybridrl.model.tokenizer import build_char_tokenizer

    build_char_tokenizer().save_pretrained(path)
    return path


def _batch(prompts: list[list[int]]) -> Batch:
    return prompt_batch(prompts, pad_id=0)


def _ctx(path: Path, backend: str, device: str, dtype: str = DTYPE, **options) -> EngineContext:
    return EngineContext(role="rollout", backend=backend, model_path=str(path), rank=0, world_size=1, device=device,
                         dtype=dtype, seed=0, trainable=False, options=options)


def _buckets(state: dict[str, torch.Tensor], size: int = 3, device: str = "cpu"
             ) -> list[list[tuple[str, torch.Tensor]]]:
    """Like a trainer's export: each tensor once (the tied head only as the embedding), a few per bucket."""
    items = [(n, t.to(device)) for n, t in state.items() if n != "lm_head.weight"]
    return [items[i:i + size] for i in range(0, len(items), size)]


def _sync(engine, state: dict[str, torch.Tensor], device: str = "cpu") -> None:
    for bucket in _buckets(state, device=device):
        engine.import_weights(bucket)
    engine.finish_weight_import()


def _moved(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Every tensor moved, as by training (bf16 values; the tied head follows the embedding)."""
    gen = torch.Generator().manual_seed(seed)
    out = {n: _bf16_values(t + 0.05 * torch.randn(t.shape, generator=gen)) for n, t in state.items()}
    out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def _on_model_b(setup) -> None:
    """Engine and reference both on model B. The engine starts from model A and only the sync tests load B, so a
    test that relies on B (its EOS, its distributions) loads it itself: it then passes or fails alone, under ``-k``
    or after an earlier test failed half-way (which may leave moved weights in the engine or the reference)."""
    _sync(setup["engine"], setup["state_b"])
    setup["reference"].load(setup["state_b"].items())


def _problems(out: Batch, ref: ReferenceModel, params: SamplingParams, eos: int) -> list[str]:
    tokens, log_probs = reference_problems(out, PROMPTS, ref, params, [eos], *TOLERANCE)
    return tokens + log_probs


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Model A (the engine starts from it), model B (a different random init, synced in) as the float32 reference,
    and an EOS id that B's greedy continuations reach in some rows (set in both)."""
    from hybridrl_sglang.engine import SGLangRollout

    root = tmp_path_factory.mktemp("sglang-models")
    a = _save_qwen2(root / "a", seed=0)
    b = _save_qwen2(root / "b", seed=1)
    probe = HFRollout(_ctx(b, "hf", "cpu", "float32"))
    greedy = probe.generate(_batch(PROMPTS), SamplingParams(temperature=0.0, max_new_tokens=WIDTH, ignore_eos=True))
    rows = greedy[RESPONSE_IDS].tolist()
    firsts = {r[0] for r in rows}
    # the earliest token that is no row's first and not seen before in its row: that row stops there
    eos = min((k, r[k]) for r in rows for k in range(1, 6) if r[k] not in firsts and r[k] not in r[:k])[1]
    for folder in (a, b):
        set_eos(folder, eos)
    reference = ReferenceModel(b)
    engine = SGLangRollout(_ctx(a, "sglang", "cuda", gpu_memory_utilization=0.3, enforce_eager=True))
    state_b = {n: t.detach().clone() for n, t in reference.model.state_dict().items()}
    yield {"engine": engine, "reference": reference, "eos": eos, "state_b": state_b, "b": b}
    engine.close()


def test_greedy_equals_transformers_after_weight_sync(setup):
    engine, reference, eos = setup["engine"], setup["reference"], setup["eos"]
    batch = _batch(PROMPTS)
    assert _problems(engine.generate(batch, GREEDY), reference, GREEDY, eos), \
        "the engine (model A) already agrees with model B: the sync proves nothing"
    for state in (setup["state_b"], _moved(setup["state_b"], 0)):
        _sync(engine, state)
        reference.load(state.items())
        assert not _problems(engine.generate(batch, GREEDY), reference, GREEDY, eos)
    _sync(engine, setup["state_b"])  # back to B, whose greedy rows reach the EOS in some rows
    reference.load(setup["state_b"].items())
    got = engine.generate(batch, GREEDY)
    assert not _problems(got, reference, GREEDY, eos)
    lengths = got[RESPONSE_MASK].sum(1)
    stopped = [i for i in range(len(PROMPTS)) if lengths[i] < WIDTH]
    assert stopped, "no row reached the EOS"
    for i in stopped:
        assert got[RESPONSE_IDS][i, lengths[i] - 1] == eos
        assert (got[RESPONSE_IDS][i, lengths[i]:] == engine.pad_id).all()


def test_cuda_buckets_and_receive_buffer_views_sync_the_same(setup):
    engine, reference, eos = setup["engine"], setup["reference"], setup["eos"]
    batch = _batch(PROMPTS)
    moved = _moved(setup["state_b"], 1)
    _sync(engine, moved, device="cuda")  # a colocated trainer's export: CUDA tensors, packed and cast
    reference.load(moved.items())
    assert not _problems(engine.generate(batch, GREEDY), reference, GREEDY, eos)
    # the broadcast bridge's receive buffer: views of one CUDA buffer, sent without a copy
    shared_before = engine.import_counters["shared"]
    for bucket in _buckets(setup["state_b"]):
        spec = describe_bucket(bucket)
        engine.import_weights(unpack_bucket(pack_bucket(bucket, spec, "cuda"), spec))
    engine.finish_weight_import()
    reference.load(setup["state_b"].items())
    assert engine.import_counters["shared"] > shared_before
    assert not _problems(engine.generate(batch, GREEDY), reference, GREEDY, eos)


def test_release_and_resume_around_an_update(setup):
    """The training loop's order: sleep, import while asleep, wake, generate, sleep (now the weights are
    released too), import (weights resumed alone first), wake (KV cache), generate."""
    engine, reference, eos = setup["engine"], setup["reference"], setup["eos"]
    batch = _batch(PROMPTS)
    engine.generate(batch, GREEDY)
    free0, _ = torch.cuda.mem_get_info()
    engine.sleep()
    free1, _ = torch.cuda.mem_get_info()
    assert free1 > free0, "sleeping released no device memory"
    _sync(engine, setup["state_b"])
    engine.wake()
    engine.generate(batch, GREEDY)
    engine.sleep()
    assert engine.last_released == ["kv_cache", "weights"]
    moved = _moved(setup["state_b"], 2)
    _sync(engine, moved)
    engine.wake()
    reference.load(moved.items())
    assert not _problems(engine.generate(batch, GREEDY), reference, GREEDY, eos)
    _sync(engine, setup["state_b"])
    reference.load(setup["state_b"].items())


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.8, 8, 1.0), (1.3, 0, 1.0), (1.0, 0, 0.9)])
def test_sampled_logprobs_are_those_of_the_sampling_distribution(setup, temperature, top_k, top_p):
    engine, reference, eos = setup["engine"], setup["reference"], setup["eos"]
    _on_model_b(setup)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=WIDTH,
                            ignore_eos=True, seed=5)
    assert not _problems(engine.generate(_batch(PROMPTS), params), reference, params, eos)
    assert engine.inexact_logprobs == 0


def test_min_new_tokens_and_ignore_eos(setup):
    engine, reference, eos = setup["engine"], setup["reference"], setup["eos"]
    _on_model_b(setup)
    batch = _batch(PROMPTS)
    assert int(engine.generate(batch, GREEDY)[RESPONSE_MASK].sum(1).min()) < 4, \
        "no row stops early: min_new_tokens would be untested"
    for params in (SamplingParams(temperature=0.0, max_new_tokens=WIDTH, min_new_tokens=4),
                   SamplingParams(temperature=0.0, max_new_tokens=WIDTH, ignore_eos=True),
                   SamplingParams(temperature=1.0, max_new_tokens=WIDTH, min_new_tokens=WIDTH - 1, seed=3)):
        out = engine.generate(batch, params)
        assert not _problems(out, reference, params, eos), params
        lengths = out[RESPONSE_MASK].sum(1)
        assert (lengths >= max(params.min_new_tokens, 1)).all()
        if params.ignore_eos:
            assert (lengths == WIDTH).all()
        for i, row in enumerate(out[RESPONSE_IDS].tolist()):
            assert eos not in row[:params.min_new_tokens], f"row {i}: EOS inside min_new_tokens"


def test_refuses_a_prompt_past_the_context(setup):
    with pytest.raises(ValueError, match="row 1: prompt of 125 tokens"):
        setup["engine"].generate(_batch([[3, 4], [5] * 125]), GREEDY)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="split mode needs two GPUs (NCCL joins no two processes on one GPU)")
def test_split_mode_update_weights_from_distributed(setup):
    """SGLang's schedulers join a group with this process (the trainer side of ``hybridrl_sglang.distributed``)
    and receive the buckets with ``update_weights_from_distributed``; the engine runs on the second GPU."""
    import threading

    from hybridrl.runtime.distributed import free_port
    from hybridrl_sglang.distributed import GROUP_NAME, broadcast_buckets, open_group
    from hybridrl_sglang.engine import SGLangRollout

    setup["engine"].close()  # one engine at a time (this test runs last)
    reference, eos = setup["reference"], setup["eos"]
    engine = SGLangRollout(_ctx(setup["b"], "sglang", "cuda", gpu_memory_utilization=0.3, enforce_eager=True,
                                weight_sync="distributed", engine_kwargs={"base_gpu_id": 1}))
    try:
        moved = _moved(setup["state_b"], 3)
        buckets = _buckets(moved)
        layout = engine.distributed_layout([describe_bucket(b) for b in buckets])
        port = free_port()
        trainer: dict = {}

        def trainer_side() -> None:  # pure torch, as in the trainer's worker; the engine stays on this thread
            pg = open_group("127.0.0.1", port, 0, 2, GROUP_NAME, "nccl")
            trainer["sent"] = broadcast_buckets(pg, [[(n, t.cuda(0)) for n, t in b] for b in buckets], layout,
                                                "cuda:0")

        thread = threading.Thread(target=trainer_side)
        thread.start()
        engine.open_update_group("127.0.0.1", port, 1, 2, GROUP_NAME)
        engine.receive_distributed(layout, GROUP_NAME)
        thread.join(timeout=300)
        assert trainer.get("sent", 0) > 0
        reference.load(moved.items())
        assert not _problems(engine.generate(_batch(PROMPTS), GREEDY), reference, GREEDY, eos)
    finally:
        engine.close()
