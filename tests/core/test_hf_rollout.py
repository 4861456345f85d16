import pytest
import torch

from hybridrl.config import TinyModelConfig
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
from hybridrl.model.tiny import build_tiny_model
from hybridrl.model.tokenizer import load_tokenizer
from hybridrl.rollout.hf import HFRollout, filter_logits

CFG = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                      max_position=64, seed=0)
PROMPTS = ["rev 47=", "rev 1234567=", "a", "rev 00=", "x 9="]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(CFG, tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def tok(model_dir):
    return load_tokenizer(model_dir)


def sharp_weights(engine, seed, std=0.3):
    """Random weights with a larger scale than the init (whose outputs are nearly uniform), so that greedy
    decoding and sampling give varied, input-dependent tokens. Norm weights are kept."""
    gen = torch.Generator().manual_seed(seed)
    return [(name, w.clone() if "norm" in name else torch.randn(w.shape, generator=gen) * std)
            for name, w in engine.named_weights()]


def make_engine(model_dir, seed=0):
    engine = HFRollout(EngineContext("rollout", "hf", str(model_dir), rank=0, world_size=1))
    engine.import_weights(sharp_weights(engine, seed))
    engine.finish_weight_import()
    return engine


@pytest.fixture(scope="module")
def engine(model_dir):
    return make_engine(model_dir)


def prompt_batch(tok, prompts=PROMPTS, width=None):
    ids, mask = left_pad([tok.encode(p) for p in prompts], tok.pad_token_id, width)
    return Batch.from_tensors({PROMPT_IDS: ids, PROMPT_MASK: mask})


def full_logits(model, prompt_ids, response_ids):
    """Next-token logits after ``prompt + response`` by one plain forward pass over the whole unpadded
    sequence (no cache, no padding)."""
    ids = torch.tensor([list(prompt_ids) + list(response_ids)])
    with torch.no_grad():
        return model(input_ids=ids).logits[0, -1].float()


def reference_greedy(model, prompt_ids, steps, eos_ids=()):
    out, logps = [], []
    for _ in range(steps):
        logits = full_logits(model, prompt_ids, out)
        token = int(logits.argmax())
        out.append(token)
        logps.append(float(torch.log_softmax(logits, -1)[token]))
        if token in eos_ids:
            break
    return out, logps


def first_new_token(row):
    """(position, token) of the first token of ``row`` not seen earlier in it, at position >= 2."""
    for k in range(2, len(row)):
        if row[k] not in row[:k]:
            return k, row[k]
    raise AssertionError(f"no fresh token in {row}")


# --- decoding -------------------------------------------------------------------------------------

def test_greedy_equals_stepwise_argmax_of_full_forward(engine, tok):
    params = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    out = engine.generate(prompt_batch(tok), params)
    assert out[RESPONSE_IDS].shape == out[RESPONSE_MASK].shape == out[ROLLOUT_LOG_PROBS].shape == (len(PROMPTS), 10)
    assert out[ROLLOUT_LOG_PROBS].dtype == torch.float32
    assert out[RESPONSE_MASK].eq(1).all()
    distinct = set()
    for i, prompt in enumerate(PROMPTS):
        ref, ref_logp = reference_greedy(engine.model, tok.encode(prompt), 10)
        assert out[RESPONSE_IDS][i].tolist() == ref, prompt
        torch.testing.assert_close(out[ROLLOUT_LOG_PROBS][i], torch.tensor(ref_logp), atol=1e-5, rtol=0)
        distinct.add(tuple(ref))
    assert len(distinct) > 1  # the test model does depend on its input


def test_left_padding_gives_the_same_response_as_each_prompt_alone(engine, tok):
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    together = engine.generate(prompt_batch(tok, width=16), params)  # extra all-pad columns too
    for i, prompt in enumerate(PROMPTS):
        alone = engine.generate(prompt_batch(tok, [prompt]), params)
        assert torch.equal(alone[RESPONSE_IDS][0], together[RESPONSE_IDS][i])
        assert torch.equal(alone[RESPONSE_MASK][0], together[RESPONSE_MASK][i])
        torch.testing.assert_close(alone[ROLLOUT_LOG_PROBS][0], together[ROLLOUT_LOG_PROBS][i], atol=1e-5, rtol=0)


def test_repeated_prompts_are_prefilled_once_and_generate_as_each_alone(engine, tok, monkeypatch):
    """A GRPO batch repeats each prompt: the prefill runs on the distinct prompts only, every row then decodes
    from a copy of its prompt's cache, and greedy rows equal those of a batch of the distinct prompts."""
    prompts = [PROMPTS[i] for i in (0, 1, 0, 2, 1, 0, 3, 4, 4)]
    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    rows_per_forward = []
    forward = engine._forward
    monkeypatch.setattr(engine, "_forward", lambda ids, *rest: rows_per_forward.append(len(ids)) or forward(ids, *rest))
    out = engine.generate(prompt_batch(tok, prompts), params)
    assert rows_per_forward[0] == len(PROMPTS) and set(rows_per_forward[1:]) == {len(prompts)}
    alone = engine.generate(prompt_batch(tok), params)
    for i, prompt in enumerate(prompts):
        j = PROMPTS.index(prompt)
        assert torch.equal(out[RESPONSE_IDS][i], alone[RESPONSE_IDS][j]), prompt
        torch.testing.assert_close(out[ROLLOUT_LOG_PROBS][i], alone[ROLLOUT_LOG_PROBS][j], atol=1e-5, rtol=0)


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (5, 1.0), (0, 0.8)])
def test_sampled_log_probs_match_full_forward(engine, tok, top_k, top_p):
    temperature = 0.7
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=8, seed=11)
    prompts = PROMPTS * 2
    out = engine.generate(prompt_batch(tok, prompts), params)
    eos = engine.eos_ids
    for i, prompt in enumerate(prompts):
        ids, mask, logp = (out[k][i].tolist() for k in (RESPONSE_IDS, RESPONSE_MASK, ROLLOUT_LOG_PROBS))
        n = sum(mask)
        assert mask == [1] * n + [0] * (len(mask) - n)
        assert all(x == 0.0 for x in logp[n:]) and all(x == tok.pad_token_id for x in ids[n:])
        assert all(t not in eos for t in ids[: n - 1])
        for t in range(n):
            logits = full_logits(engine.model, tok.encode(prompt), ids[:t]) / temperature
            expected = torch.log_softmax(filter_logits(logits[None], top_k, top_p)[0], -1)[ids[t]]
            assert torch.isfinite(expected)
            # the batched, cached forward and this one-row full forward differ by fp32 rounding (~1e-5)
            assert abs(logp[t] - float(expected)) < 5e-5, (prompt, t)


def test_seeded_sampling_is_reproducible(engine, tok):
    batch = prompt_batch(tok)
    a = engine.generate(batch, SamplingParams(temperature=1.0, max_new_tokens=8, seed=3))
    b = engine.generate(batch, SamplingParams(temperature=1.0, max_new_tokens=8, seed=3))
    c = engine.generate(batch, SamplingParams(temperature=1.0, max_new_tokens=8, seed=4))
    assert torch.equal(a[RESPONSE_IDS], b[RESPONSE_IDS])
    assert torch.equal(a[ROLLOUT_LOG_PROBS], b[ROLLOUT_LOG_PROBS])
    assert not torch.equal(a[RESPONSE_IDS], c[RESPONSE_IDS])


def test_top_k_one_is_greedy(engine, tok):
    batch = prompt_batch(tok)
    greedy = engine.generate(batch, SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True))
    sampled = engine.generate(batch, SamplingParams(temperature=0.9, top_k=1, max_new_tokens=6, ignore_eos=True))
    assert torch.equal(greedy[RESPONSE_IDS], sampled[RESPONSE_IDS])
    assert torch.allclose(sampled[ROLLOUT_LOG_PROBS], torch.zeros(()))  # a one-token distribution


def test_filter_logits():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    assert torch.isinf(filter_logits(logits, top_k=2)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(logits, top_p=0.7)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(logits, top_p=0.75)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(logits, top_p=0.76)).tolist() == [[False, False, False, True]]
    assert torch.isinf(filter_logits(logits, top_p=0.1)).tolist() == [[False, True, True, True]]
    assert not torch.isinf(filter_logits(logits)).any()


# --- EOS, widths, stopping ------------------------------------------------------------------------

@pytest.fixture
def eos_case(engine, tok):
    """Make a token that greedy decoding of PROMPTS[0] first produces at step k >= 2 the engine's EOS."""
    free = engine.generate(prompt_batch(tok), SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True))
    k, token = first_new_token(free[RESPONSE_IDS][0].tolist())
    saved = engine.eos_ids
    engine.eos_ids = [token]
    yield free, k, token
    engine.eos_ids = saved


def test_eos_ends_the_row_and_is_kept_in_the_mask(engine, tok, eos_case):
    free, k, eos = eos_case
    out = engine.generate(prompt_batch(tok), SamplingParams(temperature=0.0, max_new_tokens=12))
    assert out[RESPONSE_IDS].shape == (len(PROMPTS), 12)
    for i in range(len(PROMPTS)):
        row = free[RESPONSE_IDS][i].tolist()
        n = row.index(eos) + 1 if eos in row else 12
        assert out[RESPONSE_IDS][i].tolist() == row[:n] + [tok.pad_token_id] * (12 - n)
        assert out[RESPONSE_MASK][i].tolist() == [1] * n + [0] * (12 - n)
        assert torch.equal(out[ROLLOUT_LOG_PROBS][i][:n], free[ROLLOUT_LOG_PROBS][i][:n])
        assert out[ROLLOUT_LOG_PROBS][i][n:].eq(0).all()
    assert out[RESPONSE_MASK][0].sum() == k + 1


def test_min_new_tokens_forbids_eos_until_reached(engine, tok, eos_case):
    _, k, eos = eos_case
    prompt = tok.encode(PROMPTS[0])
    params = SamplingParams(temperature=0.0, max_new_tokens=12, min_new_tokens=k + 2)
    out = engine.generate(prompt_batch(tok, [PROMPTS[0]]), params)
    ids, logp = out[RESPONSE_IDS][0].tolist(), out[ROLLOUT_LOG_PROBS][0]
    n = int(out[RESPONSE_MASK][0].sum())
    assert eos not in ids[: k + 2]
    assert n >= k + 2
    # reference: argmax with the EOS logit removed before min_new_tokens
    for t in range(n):
        logits = full_logits(engine.model, prompt, ids[:t])
        if t < k + 2:
            logits[eos] = float("-inf")
        assert ids[t] == int(logits.argmax())
        assert abs(float(logp[t]) - float(torch.log_softmax(logits, -1)[ids[t]])) < 1e-5


def test_ignore_eos_generates_the_full_width(engine, tok, eos_case):
    free, k, eos = eos_case
    out = engine.generate(prompt_batch(tok), SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True))
    assert out[RESPONSE_MASK].eq(1).all()
    assert out[RESPONSE_IDS][0, k] == eos
    assert torch.equal(out[RESPONSE_IDS], free[RESPONSE_IDS])


def test_stops_early_when_every_row_has_finished(engine, tok, eos_case, monkeypatch):
    _, k, _ = eos_case
    calls = []
    forward = engine._forward
    monkeypatch.setattr(engine, "_forward", lambda *a: calls.append(1) or forward(*a))
    out = engine.generate(prompt_batch(tok, [PROMPTS[0]]), SamplingParams(temperature=0.0, max_new_tokens=30))
    assert out[RESPONSE_IDS].shape == (1, 30)  # still the full width
    assert out[RESPONSE_MASK].sum() == k + 1
    assert len(calls) == k + 1  # the prompt pass and one pass per token fed back, none after the EOS


def test_outputs_of_different_batches_concatenate(engine, tok):
    params = SamplingParams(temperature=1.0, max_new_tokens=7, seed=0)
    a = engine.generate(prompt_batch(tok, PROMPTS[:2]), params)
    b = engine.generate(prompt_batch(tok, PROMPTS[2:]), params)
    both = Batch.concat([a, b])
    assert both[RESPONSE_IDS].shape == (len(PROMPTS), 7)


def test_empty_batch(engine):
    empty = Batch.from_tensors({PROMPT_IDS: torch.zeros((0, 3), dtype=torch.long),
                                PROMPT_MASK: torch.zeros((0, 3), dtype=torch.long)})
    out = engine.generate(empty, SamplingParams(max_new_tokens=4))
    assert out[RESPONSE_IDS].shape == (0, 4)


# --- weights --------------------------------------------------------------------------------------

def test_importing_another_models_weights_reproduces_its_outputs(model_dir, tok):
    a, b = make_engine(model_dir, seed=1), make_engine(model_dir, seed=2)
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    batch = prompt_batch(tok)
    out_b = b.generate(batch, params)
    assert not torch.equal(a.generate(batch, params)[RESPONSE_IDS], out_b[RESPONSE_IDS])
    weights = list(b.named_weights())
    half = len(weights) // 2
    a.import_weights(weights[:half])  # in two buckets
    a.import_weights(weights[half:])
    a.finish_weight_import()
    out_a = a.generate(batch, params)
    assert torch.equal(out_a[RESPONSE_IDS], out_b[RESPONSE_IDS])
    assert torch.equal(out_a[ROLLOUT_LOG_PROBS], out_b[ROLLOUT_LOG_PROBS])


def test_tied_lm_head_is_accepted_under_either_name(model_dir):
    engine = make_engine(model_dir)
    embed = engine.model.get_input_embeddings().weight
    new = torch.randn(embed.shape, dtype=torch.float64)  # cast to the parameter's dtype on import
    engine.import_weights([("lm_head.weight", new)])
    assert torch.equal(embed, new.float())
    assert torch.equal(engine.model.lm_head.weight, new.float())
    engine.import_weights([("model.embed_tokens.weight", new * 2), ("lm_head.weight", new * 2)])
    assert torch.equal(engine.model.lm_head.weight, (new * 2).float())


def test_unknown_or_misshapen_weights_are_rejected(engine):
    with pytest.raises(KeyError, match="model.layers.9.mlp.up_proj.weight"):
        engine.import_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(2))])
    with pytest.raises(ValueError, match="model.norm.weight"):
        engine.import_weights([("model.norm.weight", torch.zeros(3))])


def test_named_weights_are_the_hf_names(engine, model_dir):
    from safetensors.torch import load_file

    saved = load_file(str(model_dir / "model.safetensors"))
    names = [n for n, _ in engine.named_weights()]
    assert set(names) <= set(saved) | {"lm_head.weight"}
    assert "model.embed_tokens.weight" in names


def test_sleep_and_wake_are_noops_on_cpu(engine, tok):
    params = SamplingParams(temperature=0.0, max_new_tokens=5)
    before = engine.generate(prompt_batch(tok), params)
    engine.sleep()
    engine.wake()
    assert torch.equal(engine.generate(prompt_batch(tok), params)[RESPONSE_IDS], before[RESPONSE_IDS])
    assert next(engine.model.parameters()).device.type == "cpu"


def test_engine_is_found_through_the_registry(model_dir):
    from hybridrl.plugins.discovery import get_registry

    cls = get_registry().backend("rollout", "hf").load()
    assert cls is HFRollout
    assert cls(EngineContext("rollout", "hf", str(model_dir), 0, 1)).eos_ids == [1]


def test_a_resumed_row_is_checked_against_its_own_cap_and_stays_in_the_context(tmp_path):
    """A row resumed near the context's end (prompt + tokens so far, a small cap left) is generated; with GPT-2's
    absolute positions a finished row's pads must not run past the position table."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from hybridrl.engines.batch import MAX_NEW_TOKENS
    from hybridrl.testing.batches import prompt_batch

    folder = tmp_path / "gpt2"
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=40, n_positions=16, n_embd=32, n_layer=1, n_head=2, eos_token_id=1,
                               pad_token_id=0)).save_pretrained(folder)
    engine = HFRollout(EngineContext(role="rollout", backend="hf", model_path=str(folder), rank=0, world_size=1,
                                     trainable=False))
    batch = prompt_batch([list(range(2, 14)), [5, 6]], pad_id=0)  # 12 tokens: 4 positions left of 16
    batch.set(MAX_NEW_TOKENS, torch.tensor([4, 10]))
    out = engine.generate(batch, SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True))
    assert out["response_mask"].sum(-1).tolist() == [4, 10]
    batch.set(MAX_NEW_TOKENS, torch.tensor([5, 10]))
    with pytest.raises(ValueError, match="row 0: prompt of 12 tokens \\+ max_new_tokens=5"):
        engine.generate(batch, SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True))
