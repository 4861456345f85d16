"""Episodes: chat rendering of observations, trajectory packing, the runner's limits and error handling, the
single-turn environment against ``generate`` (bit for bit, on the ``hf`` rollout), the calc task's rewards,
and the episode metrics."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridrl.engines import EngineContext, SamplingParams
from hybridrl.engines.batch import (
    PROMPT_IDS,
    PROMPT_MASK,
    RESPONSE_ATTENTION_MASK,
    RESPONSE_IDS,
    RESPONSE_MASK,
    ROLLOUT_LOG_PROBS,
    Batch,
    left_pad,
)
from hybridrl.environments.base import Environment, EpisodeRow, ModelTurn, StepResult
from hybridrl.environments.chat import ChatFormat, ChatFormatError
from hybridrl.environments.metrics import episode_metrics
from hybridrl.environments.runner import EpisodeError, build_runner, run_episodes
from hybridrl.environments.spec import EnvironmentSpec
from hybridrl.environments.trajectory import (
    ENV_REWARD,
    NUM_TURNS,
    REWARD_PARTS,
    TRUNCATED,
    Trajectory,
    pack_trajectories,
)
from hybridrl.model.tokenizer import build_char_tokenizer
from hybridrl.plugins.registry import Registry
from hybridrl.tasks.calc import arith, call_credit, make_calc_rows, positional_match
from hybridrl.testing.environment_contract import build_policy_model, play, row_segments


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    return build_policy_model(tmp_path_factory.mktemp("envs") / "char_chat", "char_chat")


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory) -> Path:
    return build_policy_model(tmp_path_factory.mktemp("envs") / "char", "char")


def encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


# --- chat -------------------------------------------------------------------------------------------------
def test_observations_are_what_the_template_writes_after_a_finished_turn(tmp_path):
    tok = build_char_tokenizer(chat=True)
    chat = ChatFormat(tok, [tok.eos_token_id])
    assert chat.has_template
    assert chat.observation_ids([{"role": "tool", "content": "42"}]) == encode(tok, "<|tool|>42<eos><|assistant|>")
    assert chat.prompt_ids([{"role": "user", "content": "1+1"}]) == encode(tok, "<|user|>1+1<eos><|assistant|>")

    from hybridrl.data.fixtures import build_chat_tokenizer
    from hybridrl.model.tokenizer import load_tokenizer

    qwen = load_tokenizer(build_chat_tokenizer("qwen2", tmp_path / "qwen"))
    qchat = ChatFormat(qwen, [qwen.eos_token_id])
    expected = qwen("\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert qchat.observation_ids([{"role": "tool", "content": "42"}]) == expected


def test_plain_observations_and_templates_that_rewrite_history():
    tok = build_char_tokenizer()
    plain = ChatFormat(tok, [tok.eos_token_id], plain_template=" {content} ")
    assert not plain.has_template
    assert plain.observation_ids([{"role": "tool", "content": "42"}]) == encode(tok, " 42 ")
    assert plain.step_ids([5, 6]) == [5, 6] and plain.step_ids([]) == []

    chat_tok = build_char_tokenizer(chat=True)
    chat_tok.chat_template = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}<eos>{% endfor %}"
    with pytest.raises(ChatFormatError, match="renders the earlier turns differently"):
        ChatFormat(chat_tok, [chat_tok.eos_token_id]).observation_ids([{"role": "tool", "content": "1"}])


# --- trajectories -----------------------------------------------------------------------------------------
def test_packing_marks_exactly_the_model_tokens():
    a = Trajectory(prompt_ids=[5, 6, 7])
    a.add_model_turn([10, 11], [-0.1, -0.2])
    a.add_observation([20, 21, 22])
    a.add_model_turn([12], [-0.3])
    a.add_reward({"answer": 0.5})
    a.add_reward({"answer": 0.25, "call": 0.1})
    b = Trajectory(prompt_ids=[8])
    b.add_model_turn([13, 14, 15], None)
    batch = pack_trajectories([a, b], width=8, pad_id=0)
    assert batch[PROMPT_IDS].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert batch[PROMPT_MASK].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert batch[RESPONSE_IDS].tolist() == [[10, 11, 20, 21, 22, 12, 0, 0], [13, 14, 15, 0, 0, 0, 0, 0]]
    assert batch[RESPONSE_MASK].tolist() == [[1, 1, 0, 0, 0, 1, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0]]
    assert batch[RESPONSE_ATTENTION_MASK].tolist() == [[1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0]]
    torch.testing.assert_close(batch[ROLLOUT_LOG_PROBS][0], torch.tensor([-0.1, -0.2, 0, 0, 0, -0.3, 0, 0]))
    assert batch[ENV_REWARD].tolist() == pytest.approx([0.85, 0.0]) and batch[NUM_TURNS].tolist() == [2, 1]
    assert batch[REWARD_PARTS][0] == pytest.approx({"answer": 0.75, "call": 0.1})
    assert a.model_turns() == [[10, 11], [12]]
    with pytest.raises(ValueError, match="row 0: a trajectory of 6 response tokens"):
        pack_trajectories([a], width=5, pad_id=0)
    with pytest.raises(ValueError, match="2 tokens came with 1 log-probs"):
        a.add_model_turn([1, 2], [0.0])


# --- the runner's rules -------------------------------------------------------------------------------------
class Echo(Environment):
    """Observes ``obs`` tokens after every turn, never done; counts closes (class-wide)."""

    closed = 0
    obs: list[int] = [30, 31]
    fail_at: int | None = None

    def __init__(self, context, **options):
        super().__init__(context)

    def reset(self, row: EpisodeRow):
        return row.prompt_ids

    def step(self, turn: ModelTurn) -> StepResult:
        if self.fail_at is not None and turn.index == self.fail_at:
            raise KeyError("no such thing")
        return StepResult(observation=list(self.obs), reward={"turn": 1.0}, metrics={"steps": 1.0})

    def close(self) -> None:
        Echo.closed += 1


def echo_registry(cls=Echo) -> Registry:
    from hybridrl.plugins.discovery import get_registry

    registry = Registry(backends=dict(get_registry().backends), named=dict(get_registry().named))
    registry.named.pop(("environment", "echo"), None)
    registry.add_environment("echo", cls)
    return registry


def play_echo(model: Path, spec: EnvironmentSpec, actions, max_new_tokens=16, mode="batched", cls=Echo):
    from hybridrl.environments import runner as runner_module

    registry = echo_registry(cls)
    original = runner_module.build_runner

    def with_registry(spec_, path, n, seed, registry_=None):
        return original(spec_, path, n, seed, registry)

    runner_module.build_runner = with_registry
    try:
        return play(model, spec, [{"prompt": "ab"}, {"prompt": "cdef"}], actions, max_new_tokens, mode)
    finally:
        runner_module.build_runner = original


@pytest.mark.parametrize("mode", ["batched", "requests"])
def test_limits_end_every_episode_on_a_model_turn(plain_model, mode):
    spec = EnvironmentSpec(name="echo", max_turns=3, max_total_tokens=20, tool_parser=None)
    batch, policy, _ = play_echo(plain_model, spec, ["xyz"], mode=mode)  # turns: marker x y z eos = 5 tokens
    for i in range(2):
        runs = row_segments(batch, i)
        assert [(m, len(t)) for m, t in runs] == [(True, 5), (False, 2), (True, 5), (False, 2), (True, 5)]
        assert runs[-1][0]
    assert batch[NUM_TURNS].tolist() == [3, 3] and batch[TRUNCATED].tolist() == [1, 1]
    assert batch[REWARD_PARTS] == [{"turn": 3.0}, {"turn": 3.0}]

    tight = EnvironmentSpec(name="echo", max_turns=5, max_total_tokens=13, tool_parser=None)
    batch, _, _ = play_echo(plain_model, tight, ["xyz"], mode=mode)
    # 5 + 2 + 5 = 12: the next observation would leave no room for a model token, so the episode ends
    runs = [[(m, len(t)) for m, t in row_segments(batch, i)] for i in range(2)]
    assert runs == [[(True, 5), (False, 2), (True, 5)]] * 2
    assert batch[TRUNCATED].tolist() == [1, 1] and batch[NUM_TURNS].tolist() == [2, 2]


def test_a_turn_cut_by_its_budget_is_closed_by_an_eos_in_the_context(plain_model):
    spec = EnvironmentSpec(name="echo", max_turns=2, max_total_tokens=40, tool_parser=None)
    batch, policy, _ = play_echo(plain_model, spec, ["abcdefgh"], max_new_tokens=4)
    runs = row_segments(batch, 0)
    assert [len(t) for _, t in runs] == [4, 3, 4]
    assert runs[1] == (False, [policy.eos_id, 30, 31])  # EOS as context, never trained
    assert policy.eos_id not in runs[0][1]


def test_environment_errors_name_the_row_and_turn_and_close_every_episode(plain_model):
    class Failing(Echo):
        fail_at = 1

    for mode in ("batched", "requests"):
        Echo.closed = 0
        spec = EnvironmentSpec(name="echo", max_turns=3, max_total_tokens=40, tool_parser=None)
        with pytest.raises(EpisodeError, match=r"environment 'echo': step of row \d, turn 1 failed: KeyError"):
            play_echo(plain_model, spec, ["xy"], mode=mode, cls=Failing)
        assert Echo.closed == 2


def test_requests_mode_needs_a_rollout_that_declares_requests(tmp_path):
    from hybridrl.plugins.discovery import get_registry
    from hybridrl.rollout.hf import HFRollout

    assert not get_registry().backend("rollout", "hf").can("requests")
    spec = EnvironmentSpec(name="echo", max_turns=2, mode="requests", tool_parser=None)
    with pytest.raises(ValueError, match="does not declare the 'requests' capability"):
        spec.resolved(serves_requests=False)
    assert EnvironmentSpec(mode="auto").resolved(True).mode == "requests"
    assert EnvironmentSpec(mode="auto").resolved(False).mode == "batched"
    # a direct call with auto asks the registry: the hf rollout plays batched rounds
    model = build_policy_model(tmp_path / "m", "char")
    engine = HFRollout(EngineContext(role="rollout", backend="hf", model_path=str(model), rank=0, world_size=1))
    ids, mask = left_pad([[5, 6]], 0)
    auto = EnvironmentSpec(name="echo", max_turns=2, max_total_tokens=12, tool_parser=None)
    out = run_episodes(engine, Batch.from_tensors({PROMPT_IDS: ids, PROMPT_MASK: mask}),
                       SamplingParams(max_new_tokens=4), auto,
                       runner=build_runner(auto, str(model), 4, 0, echo_registry()))
    assert out[NUM_TURNS].tolist() == [2]


# --- the default is today's path -----------------------------------------------------------------------------
@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_new_tokens=6),
                                    SamplingParams(temperature=1.0, top_k=5, max_new_tokens=6, seed=11)])
def test_single_turn_episodes_are_generate_bit_for_bit(plain_model, params):
    from hybridrl.rollout.hf import HFRollout

    engine = HFRollout(EngineContext(role="rollout", backend="hf", model_path=str(plain_model), rank=0, world_size=1))
    tok = build_char_tokenizer()
    ids, mask = left_pad([encode(tok, p) for p in ("rev 12=", "a", "rev 4321=")], tok.pad_token_id)
    batch = Batch.from_tensors({PROMPT_IDS: ids, PROMPT_MASK: mask}, {"prompt": ["rev 12=", "a", "rev 4321="],
                                                                     "meta": [{}, {}, {}]})
    spec = EnvironmentSpec()  # single_turn
    direct = engine.generate(batch.select(PROMPT_IDS, PROMPT_MASK), params)
    default = run_episodes(engine, batch, params, spec)
    looped = run_episodes(engine, batch, params, spec, force_loop=True)
    assert set(default.tensors.keys()) == set(direct.tensors.keys())
    for key in (RESPONSE_IDS, RESPONSE_MASK, ROLLOUT_LOG_PROBS):
        assert torch.equal(default[key], direct[key]), key
        assert torch.equal(looped[key], direct[key]), key  # the episode loop samples exactly the same
    assert torch.equal(looped[RESPONSE_ATTENTION_MASK], direct[RESPONSE_MASK])
    assert looped[NUM_TURNS].tolist() == [1, 1, 1] and looped[TRUNCATED].tolist() == [0, 0, 0]


# --- the calc task ---------------------------------------------------------------------------------------------
def test_arith_calls_and_partial_credit():
    assert [c.arguments for c in arith("47+85=").calls] == [{"expression": "47+85"}]
    assert not arith("132").asks_for_tools and not arith("47+85").asks_for_tools and not arith("=").asks_for_tools
    assert positional_match("47+85=", "47+85=") == 1.0 and positional_match("47", "47+85=") == pytest.approx(2 / 6)
    assert positional_match("47+85=xx", "47+85=") == pytest.approx(6 / 8)
    assert call_credit("47+85=", "47+85=") == pytest.approx(0.3)
    assert call_credit("++++", "4+8=") == pytest.approx(0.05 / 2)  # the constant at one place only
    assert call_credit("4989", "4+8=") == pytest.approx(0.25)
    assert call_credit("4+8=xx", "4+8=") == pytest.approx(0.25 + 0.05 * 2 / 4)
    rows = make_calc_rows(2, 50, seed=3)
    assert len(rows) == 50 and all(int(r["answer"]) == eval(r["prompt"]) for r in rows)  # noqa: S307 - test data
    assert all(10 <= int(x) <= 99 for r in rows for x in r["prompt"].split("+"))


@pytest.mark.parametrize("actions,reward,tool_use", [
    (["12+30=", "42"], 1.0, 1.0),       # call, then copy the result
    (["42"], 0.7 + 0.25 / 4, 0.0),      # the right answer without the tool ("42" vs "12+30=": one digit agrees)
    (["12+30=", "41"], 0.3 + 0.3 * 0.5, 1.0),
    (["12+3=", "15"], 0.25 * 3 / 4 + 0.05 / 2, 1.0),  # a wrong call: its result, copied, is the wrong number
    (["41"], 0.0, 0.0),                 # a wrong answer without a call: no partial credit for its digits
])
def test_calc_rewards(chat_model, actions, reward, tool_use):
    spec = EnvironmentSpec(name="calc", max_turns=3, max_total_tokens=48, tools=("calculator",), tool_parser="arith")
    batch, _, _ = play(chat_model, spec, [{"prompt": "12+30", "answer": "42"}], actions)
    assert float(batch[ENV_REWARD][0]) == pytest.approx(reward)
    metrics = episode_metrics(batch)
    assert metrics["env/tool_use_rate"] == tool_use
    if tool_use:
        obs = [t for trained, t in row_segments(batch, 0) if not trained][0]
        tok = build_char_tokenizer(chat=True)
        assert obs == encode(tok, "<|tool|>" + str(eval(actions[0][:-1])) + "<eos><|assistant|>")  # noqa: S307


@pytest.mark.parametrize("actions,reward,tool_use", [
    (["=", "42"], 1.0, 1.0),            # the bare call: '=' alone asks for the question's value
    (["=", "41"], 0.3 + 0.3 * 0.5, 1.0),
    (["=+", "42"], 0.3 / 2, 0.0),       # not a call ('=' in the right place: half the call credit), then over
    (["42"], 0.7, 0.0),                 # right without the tool: no call credit
    (["12+30=", "42"], 0.7, 1.0),       # an expression call still runs; the call credit is for the bare one
])
def test_calc_bare_call_rewards(chat_model, actions, reward, tool_use):
    spec = EnvironmentSpec(name="calc", max_turns=3, max_total_tokens=48, tools=("calculator",), tool_parser="arith",
                           options={"call_syntax": "bare"})
    batch, _, _ = play(chat_model, spec, [{"prompt": "12+30", "answer": "42"}], actions)
    assert float(batch[ENV_REWARD][0]) == pytest.approx(reward)
    assert episode_metrics(batch)["env/tool_use_rate"] == tool_use
    if actions[0] == "=":
        obs = [t for trained, t in row_segments(batch, 0) if not trained][0]
        assert obs == encode(build_char_tokenizer(chat=True), "<|tool|>42<eos><|assistant|>")


def test_calc_needs_the_calculator(chat_model):
    spec = EnvironmentSpec(name="calc", max_turns=2, tools=(), tool_parser="arith")
    with pytest.raises(EpisodeError, match="environment 'calc' could not be built.*needs the calculator"):
        play(chat_model, spec, [{"prompt": "1+2", "answer": "3"}], ["3"])


# --- metrics -----------------------------------------------------------------------------------------------
def test_episode_metrics(chat_model):
    spec = EnvironmentSpec(name="tools", max_turns=2, max_total_tokens=128, tools=("calculator",), tool_parser="arith")
    batch, _, _ = play(chat_model, spec, [{"prompt": "a"}, {"prompt": "b"}], ["1-="])  # a bad expression, twice
    m = episode_metrics(batch, rollout_ranks=2)
    assert m["env/turns_mean"] == 2.0 and m["env/truncated_rate"] == 1.0
    # both turns call; the first call fails; the second is the last turn's: counted, not run
    assert m["env/tool_calls_mean"] == 2.0 and m["env/tool_errors_mean"] == 1.0 and m["env/tool_timeouts_mean"] == 0.0
    assert m["env/tool_use_rate"] == 1.0 and m["timing/env"] >= 0
    assert m["env/model_tokens_mean"] == float(batch[RESPONSE_MASK].sum(-1).float().mean())
    assert episode_metrics(Batch.from_tensors({PROMPT_IDS: torch.zeros(1, 1)})) == {}
