"""The environment battery (``hybridrl.testing.EnvironmentContract``) on the core's environments: single turn,
the tool environment with the calculator (compact ``arith`` calls on the char chat tokenizer, Hermes JSON calls
on a Qwen2.5-style tokenizer), and the calc task."""

from __future__ import annotations

from hybridrl.testing import EnvironmentContract

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
