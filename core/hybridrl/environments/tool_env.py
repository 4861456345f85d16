"""``tools``: the multi-turn tool-use environment.

Each model turn is read by the configured parser (``environment.tool_parser``, Hermes/Qwen ``<tool_call>`` JSON
by default); the calls it asks for (at most ``max_calls_per_turn``) run on the configured tools
(``environment.tools``) and their results come back as ``tool`` messages, rendered through the chat template
(``hybridrl.environments.chat``), before the model's next turn. A turn that calls no tool is the final answer
and ends the episode. On the last turn the limits allow, calls are counted but not run (nothing could read
their results): the episode is settled (``final_reward``) and ends truncated.

With a chat template and ``render_prompt`` on (the default when there is one), the opening is the row's chat
(or its text as a user message), after the optional ``system_prompt``, rendered again with the tools' schemas
so that the template can describe them; otherwise the row's own tokens.

Rewards: none of its own by default (the trainer's reward function scores the decoded transcript); a task
subclasses it and returns reward parts from ``final_reward`` (and ``call_reward``). Metrics per episode:
``tool_calls`` (calls asked for, unreadable ones included), ``tool_errors`` (unreadable, unknown tool, failed),
``tool_timeouts``.
"""

from __future__ import annotations

from typing import Any

from hybridrl.environments.base import Context, Environment, EnvironmentContext, EpisodeRow, ModelTurn, StepResult
from hybridrl.tools.base import ToolCall, ToolResult
from hybridrl.tools.parsers import ParsedTurn


class ToolEnvironment(Environment):
    """See the module docstring. Options: ``system_prompt``, ``max_calls_per_turn`` (default 4),
    ``render_prompt`` (default: whether the tokenizer has a chat template)."""

    def __init__(self, context: EnvironmentContext, system_prompt: str | None = None, max_calls_per_turn: int = 4,
                 render_prompt: bool | None = None) -> None:
        super().__init__(context)
        if max_calls_per_turn < 1:
            raise ValueError(f"max_calls_per_turn must be >= 1, got {max_calls_per_turn}")
        if context.parser is None:
            raise ValueError("the tools environment needs a tool-call parser (environment.tool_parser)")
        self.system_prompt = system_prompt
        self.max_calls_per_turn = int(max_calls_per_turn)
        self.render_prompt = context.chat.has_template if render_prompt is None else bool(render_prompt)
        self.row: EpisodeRow | None = None
        #: the conversation so far, as messages (the opening is absent when the row's tokens were used).
        self.messages: list[dict[str, Any]] = []

    def reset(self, row: EpisodeRow) -> Context:
        self.row = row
        if not self.render_prompt:
            return list(row.prompt_ids)
        messages = [dict(m) for m in row.messages] if row.messages else [{"role": "user", "content": row.prompt}]
        if self.system_prompt and not (messages and messages[0].get("role") == "system"):
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        self.messages = list(messages)
        return messages

    def step(self, turn: ModelTurn) -> StepResult:
        parsed = self.context.parser(turn.text)
        self.messages.append({"role": "assistant", "content": turn.text})
        metrics = {"tool_calls": float(len(parsed.calls) + len(parsed.errors)),
                   "tool_errors": float(len(parsed.errors)), "tool_timeouts": 0.0}
        if not parsed.asks_for_tools:
            return StepResult(done=True, reward=self.final_reward(turn, parsed), metrics=metrics)
        if turn.last:  # calls nobody could read the results of: settle now, the runner ends it as truncated
            return StepResult(reward=self.final_reward(turn, parsed), metrics=metrics)
        results: list[tuple[ToolCall | None, ToolResult]] = [(None, ToolResult.failure(f"error: {e}"))
                                                              for e in parsed.errors]
        for call in parsed.calls[:self.max_calls_per_turn]:
            results.append((call, self.context.tools.call(call)))
        for call in parsed.calls[self.max_calls_per_turn:]:
            results.append((call, ToolResult.failure(f"error: at most {self.max_calls_per_turn} tool calls per turn")))
        metrics["tool_errors"] = float(sum(r.error for _, r in results))
        metrics["tool_timeouts"] = float(sum(r.timed_out for _, r in results))
        observation = [self.tool_message(call, result) for call, result in results]
        self.messages.extend(observation)
        return StepResult(observation=observation, reward=self.call_reward(turn, parsed, results), metrics=metrics)

    def tool_message(self, call: ToolCall | None, result: ToolResult) -> dict[str, Any]:
        """The message a result comes back as (``role: tool``, as chat templates expect)."""
        message: dict[str, Any] = {"role": "tool", "content": result.content}
        if call is not None:
            message["name"] = call.name
        return message

    def final_reward(self, turn: ModelTurn, parsed: ParsedTurn) -> dict[str, float]:
        """Reward parts when the episode ends on ``turn`` (the answer). Default: none."""
        return {}

    def call_reward(self, turn: ModelTurn, parsed: ParsedTurn,
                    results: list[tuple[ToolCall | None, ToolResult]]) -> dict[str, float]:
        """Reward parts for a turn whose calls ran. Default: none."""
        return {}
