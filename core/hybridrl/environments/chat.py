"""Chat messages -> token ids inside an episode: the initial prompt, and the observations (tool results, user
replies) that go between two model turns.

With a chat template the observation of a turn is the template's own rendering of the new messages *after*
a finished assistant turn, found by the fixed-base method (as SkyRL does): render a fixed short conversation
ending in an assistant turn, render it again with the new messages and the generation prompt appended, and
keep what the second rendering adds after the base's last stop token (the model's own stop token already
closed its turn; whatever the template writes after it, a newline for ChatML, belongs to the observation).
The model's turn is therefore never re-tokenized: its sampled tokens stay exactly as generated.

Without a chat template (the bundled character tokenizer before it gets one) each message is rendered as
``plain_template.format(role=..., name=..., content=...)`` and encoded without special tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybridrl.environments.base import Context
from hybridrl.errors import HybridRLError

#: the conversation whose rendering is cut off every observation's (see the module docstring).
BASE_CONVERSATION = ({"role": "user", "content": "1"}, {"role": "assistant", "content": "1"})


class ChatFormatError(HybridRLError, ValueError):
    """The chat template cannot render observations by prefix (it rewrites earlier turns)."""


class ChatFormat:
    """Renders episode messages with ``template`` (Jinja text; default: ``tokenizer``'s own chat template), or
    with ``plain_template`` when there is none or ``use_template`` is off. ``stop_ids``: the model's end-of-turn
    tokens (its EOS ids)."""

    def __init__(self, tokenizer: Any, stop_ids: Sequence[int], plain_template: str = "{content}",
                 use_template: bool = True, template: str | None = None,
                 template_kwargs: dict[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.stop_ids = [int(s) for s in stop_ids]
        self.plain_template = plain_template
        self.template = template
        self.has_template = bool(use_template and (template or getattr(tokenizer, "chat_template", None)))
        self.template_kwargs = dict(template_kwargs or {})
        self._base: list[int] | None = None

    # --- rendering ----------------------------------------------------------------------------------------
    def _template(self, messages: Sequence[dict[str, Any]], generation_prompt: bool,
                  tools: list[dict[str, Any]] | None = None) -> list[int]:
        ids = self.tokenizer.apply_chat_template(list(messages), tools=tools or None, tokenize=True,
                                                 add_generation_prompt=generation_prompt, return_dict=False,
                                                 chat_template=self.template, **self.template_kwargs)
        if ids and isinstance(ids[0], list):  # a processor's batch of one
            ids = ids[0]
        return [int(t) for t in ids]

    def _plain(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        text = "".join(self.plain_template.format(role=m.get("role", ""), name=m.get("name", ""),
                                                  content=m.get("content", "")) for m in messages)
        return [int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def prompt_ids(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The episode's opening: the messages with the generation prompt (and the tool schemas, which a
        template renders into its system prompt)."""
        if self.has_template:
            return self._template(messages, True, tools)
        return self._plain(messages)

    def _base_ids(self) -> list[int]:
        if self._base is None:
            base = self._template(BASE_CONVERSATION, False)
            last_stop = max((i for i, t in enumerate(base) if t in self.stop_ids), default=None)
            self._base = base if last_stop is None else base[:last_stop + 1]
        return self._base

    def observation_ids(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """The tokens that follow a finished model turn: the messages (``tool`` results, ``user`` replies) and
        the prompt for the next assistant turn."""
        if not messages:
            return []
        if not self.has_template:
            return self._plain(messages)
        base = self._base_ids()
        full = self._template([*BASE_CONVERSATION, *messages], True)
        if full[:len(base)] != base:
            raise ChatFormatError("the chat template renders the earlier turns differently once a new message is "
                                  "added, so an observation cannot be cut off by prefix; give the environment "
                                  "observation tokens directly")
        return full[len(base):]

    # --- contexts -----------------------------------------------------------------------------------------
    def initial_ids(self, context: Context, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """``reset``'s result as tokens (messages are rendered with the generation prompt)."""
        return self.prompt_ids(context, tools) if is_messages(context) else [int(t) for t in context]

    def step_ids(self, observation: Context) -> list[int]:
        """A step's observation as tokens."""
        return self.observation_ids(observation) if is_messages(observation) else [int(t) for t in observation]


def is_messages(context: Context) -> bool:
    """Whether a context is chat messages (dicts) rather than token ids."""
    return bool(context) and isinstance(context[0], dict)
