"""Prompts as text or as chat messages, and how they become the token ids the rollout sees.

A prompt is a non-empty string or a non-empty list of ``{"role": str, "content": str}`` messages (verl's
parquet files and TRL's conversational datasets store them so). ``data.chat_template`` decides how messages
become text:

- ``auto``: the tokenizer's own chat template, with the generation prompt added (``<|im_start|>assistant``
  for Qwen);
- ``none``: no template; a message list is then refused (there is no one right way to flatten it);
- a path: a Jinja file used instead of the tokenizer's template.

``data.system_prompt`` is prepended as a system message to a message list that has none, and turns a text
prompt into a chat (``[system, user: text]``). A text prompt without a system prompt is used as it is, with the
tokenizer's own special-token convention (a BOS where the tokenizer adds one), as TRL does for non-chat data.

Rendered templates are encoded without adding special tokens: the template writes them itself (Llama 3's
``<|begin_of_text|>``), so adding them again would double them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridrl.errors import HybridRLError

Message = dict[str, str]
ROLES = ("system", "user", "assistant", "tool")


class PromptFormatError(HybridRLError, ValueError):
    """A prompt that is neither text nor a valid message list, or a template that cannot be applied."""

    exit_status = 2  # refused before any work


def prompt_problem(prompt: Any) -> str | None:
    """Why ``prompt`` is not a usable prompt (text or messages), or None."""
    if isinstance(prompt, str):
        return "is an empty string" if not prompt else None
    if not isinstance(prompt, (list, tuple)):
        return f"must be a string or a list of {{role, content}} messages, got {type(prompt).__name__}"
    if not prompt:
        return "is an empty message list"
    for i, message in enumerate(prompt):
        if not isinstance(message, dict):
            return f"message {i} must be a {{role, content}} object, got {type(message).__name__}"
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            return f"message {i} has no 'role' string (fields: {sorted(message)})"
        if not isinstance(content, str):
            return f"message {i} ({role}) must have a 'content' string, got {type(content).__name__}"
    return None


def is_messages(prompt: Any) -> bool:
    return isinstance(prompt, (list, tuple))


def as_messages(prompt: Any) -> list[Message]:
    """A plain copy of a message list (``role`` and ``content`` only, plus any other string fields a template
    may read, like ``name``), whatever container it came in (pyarrow gives lists of dicts)."""
    return [{k: v for k, v in dict(m).items() if v is not None} for m in prompt]


@dataclass
class PromptFormatter:
    """Turns a row's prompt into ``(text, messages or None)`` following ``data.chat_template`` and
    ``data.system_prompt``; ``encode`` gives the token ids of a batch of formatted prompts."""

    tokenizer: Any
    chat_template: str = "auto"
    system_prompt: str | None = None

    def __post_init__(self) -> None:
        self.template: str | None = None  # None: the tokenizer's own
        if self.chat_template not in ("auto", "none"):
            path = Path(self.chat_template)
            if not path.is_file():
                raise PromptFormatError(f"data.chat_template: '{path}' is not a file (give auto, none, or a Jinja "
                                        "template file)")
            try:
                self.template = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise PromptFormatError(f"data.chat_template: cannot read '{path}': {exc}") from None
            if not self.template.strip():
                raise PromptFormatError(f"data.chat_template: '{path}' is empty")
        if self.chat_template == "none" and self.system_prompt is not None:
            raise PromptFormatError("data.system_prompt needs a chat template (data.chat_template is none)")

    @property
    def has_template(self) -> bool:
        return self.template is not None or bool(getattr(self.tokenizer, "chat_template", None))

    def messages_of(self, prompt: Any) -> list[Message] | None:
        """The chat a prompt becomes (system prompt included), or None for a text prompt used as it is."""
        if is_messages(prompt):
            messages = as_messages(prompt)
        elif self.system_prompt is not None:
            messages = [{"role": "user", "content": prompt}]
        else:
            return None
        if self.system_prompt is not None and not any(m["role"] == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def render(self, messages: list[Message]) -> str:
        """The chat as text, ending with the generation prompt."""
        if self.chat_template == "none":
            raise PromptFormatError("is a message list but data.chat_template is none: give auto (the tokenizer's "
                                    "template) or a template file")
        if not self.has_template:
            name = getattr(self.tokenizer, "name_or_path", "") or type(self.tokenizer).__name__
            raise PromptFormatError(f"is a chat but the tokenizer ('{name}') has no chat template: give "
                                    "data.chat_template=PATH (a Jinja file), or text prompts")
        try:
            text = self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                      add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - jinja raises TemplateError, templates raise their own
            raise PromptFormatError(f"the chat template failed: {type(exc).__name__}: {exc}") from None
        if not isinstance(text, str):  # some versions return a list for a batch of one
            text = text[0]
        return text

    def format(self, prompt: Any) -> tuple[str, list[Message] | None]:
        """``(text the model is given, the messages or None)``."""
        messages = self.messages_of(prompt)
        if messages is None:
            return prompt, None
        return self.render(messages), messages

    def encode(self, texts: list[str], templated: list[bool]) -> list[list[int]]:
        """Token ids of each text; rendered chats without added special tokens (the template wrote them)."""
        out: list[list[int] | None] = [None] * len(texts)
        for flag in (False, True):
            idx = [i for i, t in enumerate(templated) if t == flag]
            if not idx:
                continue
            kwargs = {"add_special_tokens": False} if flag else {}
            encoded = self.tokenizer([texts[i] for i in idx], **kwargs)["input_ids"]
            for i, ids in zip(idx, encoded):
                out[i] = list(ids)
        return out  # type: ignore[return-value]
