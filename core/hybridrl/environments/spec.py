"""``EnvironmentSpec``: what the driver sends the rollout workers about the episodes to play (a plain,
picklable value; the worker builds the environments, tools and parser from its own registry)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridrl.environments.base import EpisodeLimits

#: how episodes are played: ``requests``: each trajectory on its own, one engine request per turn (engines that
#: declare the ``requests`` capability: vLLM, SGLang), so a long conversation holds up nobody; ``batched``: all
#: live trajectories' next turns in one ``generate`` call per round (any engine; the ``hf`` rollout's way);
#: ``auto``: ``requests`` where the engine declares it, else ``batched``.
MODES = ("auto", "batched", "requests")
DEFAULT_ENVIRONMENT = "single_turn"


@dataclass(frozen=True)
class EnvironmentSpec:
    name: str = DEFAULT_ENVIRONMENT
    options: dict[str, Any] = field(default_factory=dict)
    max_turns: int = 1
    max_total_tokens: int | None = None  # None: max_turns * the rollout's max_new_tokens
    tools: tuple[str, ...] = ()
    tool_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    tool_parser: str | None = "hermes"
    tool_deadline_s: float = 60.0  # a tool call not answered by then is failed (timed out), never waited for
    use_chat_template: bool = True  # off: data.chat_template is none
    chat_template: str | None = None  # Jinja text of data.chat_template=PATH (None: the tokenizer's own)
    plain_template: str = "{content}"  # how a message is written without a chat template
    mode: str = "auto"
    env_workers: int = 8  # threads stepping environments in the per-request mode
    plugins: tuple[str, ...] = ()  # plugin modules the worker's registry loads (the run's ``plugins``)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"environment.mode must be one of {MODES}, got '{self.mode}'")
        if self.env_workers < 1:
            raise ValueError(f"environment.env_workers must be >= 1, got {self.env_workers}")

    def resolved(self, serves_requests: bool) -> EnvironmentSpec:
        """This spec with ``auto`` decided for a rollout backend that does (or does not) declare ``requests``;
        ``requests`` for one that does not is a ``ValueError``."""
        from dataclasses import replace

        if self.mode == "requests" and not serves_requests:
            raise ValueError("environment.mode=requests, but the rollout backend does not declare the 'requests' "
                             "capability (it cannot generate single requests): use batched or auto")
        if self.mode == "auto":
            return replace(self, mode="requests" if serves_requests else "batched")
        return self

    def limits(self, max_new_tokens: int) -> EpisodeLimits:
        total = self.max_total_tokens if self.max_total_tokens is not None else self.max_turns * int(max_new_tokens)
        return EpisodeLimits(self.max_turns, total)

    @classmethod
    def from_config(cls, cfg: Any) -> EnvironmentSpec:
        """From a run config (``hybridrl.config.RunConfig``): its ``environment`` section, the chat template
        of ``data.chat_template`` and the run's extra ``plugins``."""
        from pathlib import Path

        env = cfg.environment
        data_template = cfg.data.chat_template
        template = None if data_template in ("auto", "none") else Path(data_template).read_text(encoding="utf-8")
        return cls(name=env.name, options=dict(env.options), max_turns=env.max_turns,
                   max_total_tokens=env.max_total_tokens, tools=tuple(env.tools),
                   tool_options={k: dict(v) for k, v in env.tool_options.items()}, tool_parser=env.tool_parser,
                   tool_deadline_s=env.tool_deadline_s,
                   use_chat_template=data_template != "none", chat_template=template,
                   plain_template=env.plain_template, mode=env.mode, env_workers=env.env_workers,
                   plugins=tuple(cfg.plugins))
