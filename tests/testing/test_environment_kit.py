"""The environment battery (``hybridrl.testing.EnvironmentContract``) on the core's environments: single turn,
the tool environment with the calculator (compact ``arith`` calls on the char chat tokenizer, Hermes JSON calls
on a Qwen2.5-style tokenizer, a plugin's own call format), and the calc task; and environments (or rows) that
break the contract fail it, saying what."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridrl.engines.batch import RESPONSE_ATTENTION_MASK, RESPONSE_MASK
from hybridrl.testing import EnvironmentContract
from hybridrl.testing.environment_contract import FINITE, ROUND_TRIP, build_policy_model, play

HERMES_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'


class TestSingleTurn(EnvironmentContract):
    environment = "single_turn"


class TestToolsArith(EnvironmentContract):
    environment = "tools"
    tools = ("calculator",)
    tool_parser = "arith"
    actions = ("12+30=", "7+8=", "42")  # two calls, then an answer (cut by max_turns=2 in one check)


class TestToolsHermes(EnvironmentContract):
    environment = "tools"
    tokenizer = "qwen2"
    tools = ("calculator",)
    rows = ({"prompt": "What is 6 times 7?"}, {"prompt": "Multiply six by seven."})
    actions = (HERMES_CALL, '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>', "It is 42.")
    max_new_tokens = 96
    max_total_tokens = 400


class TestCalcTask(EnvironmentContract):
    environment = "calc"
    tools = ("calculator",)
    tool_parser = "arith"
    rows = ({"prompt": "12+30", "answer": "42"}, {"prompt": "7+8", "answer": "15"})
    actions = ("12+30=", "42")


class TestCalcTaskBareCall(TestCalcTask):
    options = {"call_syntax": "bare"}
    actions = ("=", "42")


class TestPluginToolParser(EnvironmentContract):
    """A tool-call format a plugin module adds (``_env_kit_plugin.colon``), played by the tools environment."""

    environment = "tools"
    tools = ("calculator",)
    tool_parser = "colon"
    plugins = ("_env_kit_plugin",)
    actions = ("calculator: 12+30", "42")


def test_a_plugin_parser_reads_its_calls_and_the_results_come_back(tmp_path):
    kit = TestPluginToolParser()
    batch, policy, envs = play(build_policy_model(tmp_path / "m"), kit.spec(), kit.rows, kit.actions)
    for env in envs:
        (first, result), (second, final) = env.kit_observations
        assert first.text == "calculator: 12+30" and result.observation[0]["content"] == "42"
        assert result.metrics["tool_calls"] == 1.0 and result.metrics["tool_errors"] == 0.0
        assert second.text == "42" and final.done


# --- the kit has teeth: environments that break the contract fail it, saying what ---------------------------
class _NaNKit(EnvironmentContract):
    environment = "nan_reward"
    tools = ("calculator",)
    tool_parser = "arith"
    plugins = ("_env_kit_plugin",)
    actions = ("12+30=", "42")


class _MisremembersKit(_NaNKit):
    environment = "misremembers_results"


@pytest.fixture(scope="module")
def kit_model(tmp_path_factory) -> Path:
    return build_policy_model(tmp_path_factory.mktemp("kit-teeth") / "char_chat")


def _played(kit: EnvironmentContract, model: Path) -> dict:
    return {mode: play(model, kit.spec(), kit.rows, kit.actions, kit.max_new_tokens, mode)
            for mode in ("batched", "requests")}


def test_the_kit_fails_rewards_that_are_not_finite(kit_model):
    kit = _NaNKit()
    with pytest.raises(AssertionError, match=FINITE):
        kit.test_rewards_and_metrics_are_finite(_played(kit, kit_model))


def test_the_kit_fails_a_history_that_differs_from_the_row(kit_model):
    kit = _MisremembersKit()
    played = _played(kit, kit_model)
    kit.test_masks_mark_exactly_the_model_tokens(played, kit_model)  # what was sent is right ...
    with pytest.raises(AssertionError, match=ROUND_TRIP):  # ... what the environment remembers is not
        kit.test_tokens_round_trip(played, kit_model)


def test_the_kit_fails_observations_marked_as_trained(kit_model):
    kit = TestToolsArith()
    played = _played(kit, kit_model)
    batch = played["batched"][0]
    assert (batch[RESPONSE_ATTENTION_MASK] > batch[RESPONSE_MASK]).any()  # there are observations
    batch.tensors[RESPONSE_MASK] = batch[RESPONSE_ATTENTION_MASK].clone()  # a packing that trains them too
    with pytest.raises(AssertionError, match="response_mask must be 1 exactly on the model's tokens"):
        kit.test_masks_mark_exactly_the_model_tokens(played, kit_model)
