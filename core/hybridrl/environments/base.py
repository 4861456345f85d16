"""The environment (agent) contract: what an episode is to the core.

An ``Environment`` is one episode, made fresh for each trajectory by its registered factory
(``registry.add_environment(name, "module:Class")``, called as ``Class(context, **environment.options)``):

* ``reset(row)`` gives the initial context: token ids, or chat messages that ``context.chat`` renders through
  the tokenizer's chat template (the data row's own tokens, for most);
* ``step(turn)`` receives each model turn and gives a ``StepResult``: the observation that follows it (tokens or
  messages, e.g. tool results), whether the episode is done, named reward parts, and metrics to add up.

The runner (``hybridrl.environments.runner``) owns the limits, which an environment never has to enforce:
at most ``max_turns`` model turns and ``max_total_tokens`` tokens after the prompt (model and observation
tokens together). An episode always ends on a model turn: an observation is only appended when another model
turn follows it (a trailing observation would be context for nothing, and the reward sits on the model's last
token). The trajectory's reward is the sum of every step's reward parts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridrl.environments.chat import ChatFormat
    from hybridrl.tools.parsers import ToolParser
    from hybridrl.tools.toolbox import ToolBox

#: token ids, or chat messages (``{"role": ..., "content": ...}`` dicts) rendered through the chat template.
Context = list[int] | list[dict[str, Any]]


@dataclass(frozen=True)
class EpisodeLimits:
    """``max_turns`` model turns at most; ``max_total_tokens`` response tokens at most (model and observation
    tokens after the prompt, also the width of the trainer's ``response_ids``)."""

    max_turns: int
    max_total_tokens: int

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        if self.max_total_tokens < 1:
            raise ValueError(f"max_total_tokens must be >= 1, got {self.max_total_tokens}")


@dataclass(frozen=True)
class EpisodeRow:
    """One data row as an episode starts from it: its position in the batch, its prompt text and tokens (as
    the data loader made them: a chat already rendered by its template), the row's other fields (``answer``
    ...), and the chat messages it came from (None for a text prompt)."""

    index: int
    prompt: str
    prompt_ids: list[int]
    meta: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class ModelTurn:
    """What the model said in one turn. ``token_ids`` as sampled, the stop token included when it stopped;
    ``text`` decoded without special tokens; ``stopped``: it ended on a stop token (else it was cut by the
    per-turn or the total token budget); ``index``: 0 for the first turn; ``last``: no turn can follow (the
    turn limit is reached or no token is left), so the environment should settle the episode now."""

    token_ids: list[int]
    text: str
    stopped: bool
    index: int
    last: bool


@dataclass
class StepResult:
    """An environment's answer to a model turn (see the module docstring). ``metrics`` are added up over the
    episode and averaged over the batch by the trainer (``env/<name>``); the tool environment reports
    ``tool_calls``, ``tool_errors`` and ``tool_timeouts``."""

    observation: Context = field(default_factory=list)
    done: bool = False
    reward: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class EnvironmentContext:
    """What the runner hands every environment of a rollout call: the tokenizer, its chat formatting, the
    configured tools and tool-call parser, the limits, and the rollout call's seed."""

    tokenizer: Any
    chat: ChatFormat
    limits: EpisodeLimits
    tools: ToolBox
    parser: ToolParser | None = None
    seed: int | None = None


class Environment(ABC):
    """One episode (see the module docstring). ``single_turn`` marks an environment whose episodes are one
    plain generation of the row's prompt: the runner then calls the engine's ``generate`` directly."""

    single_turn: bool = False

    def __init__(self, context: EnvironmentContext, **options: Any) -> None:
        if options:
            raise ValueError(f"{type(self).__name__} takes no option(s) {sorted(options)} (environment.options)")
        self.context = context

    @abstractmethod
    def reset(self, row: EpisodeRow) -> Context:
        """The initial context of the episode (token ids, or messages to render with the chat template)."""

    @abstractmethod
    def step(self, turn: ModelTurn) -> StepResult:
        """React to a model turn: the observation after it, done, reward parts, metrics."""

    def close(self) -> None:
        """Release what the episode holds (called once it is over, also after an error)."""
