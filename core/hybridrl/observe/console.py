"""What ``hybridrl train`` shows on the terminal: the core logs through ``logging`` (``hybridrl.*`` loggers);
the CLI routes them to standard output as plain lines, warnings prefixed, so a run reads as it always has
while a program embedding hybridrl keeps control of its own logging."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, TextIO


class _CurrentStdout(logging.StreamHandler):
    """Writes to whatever ``sys.stdout`` is when a record is emitted (a redirected stream, pytest's capture)."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    @property  # type: ignore[override]
    def stream(self):  # noqa: D102 - the handler's stream is always the current stdout
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:
        pass


class _Plain(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.levelno >= logging.WARNING:
            text = f"{record.levelname.lower()}: {text}"
        return text


def enable_console(level: int = logging.INFO) -> None:
    """Show the ``hybridrl`` loggers' records on standard output (idempotent)."""
    logger = logging.getLogger("hybridrl")
    if not any(isinstance(h, _CurrentStdout) for h in logger.handlers):
        handler = _CurrentStdout()
        handler.setFormatter(_Plain())
        logger.addHandler(handler)
    logger.setLevel(level)


def is_terminal(stream: Any) -> bool:
    """Whether ``stream`` is an interactive terminal (a file, a pipe, a closed stream: no)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def progress_bar(total: int, initial: int, wanted: bool = True, stream: TextIO | None = None) -> Any:
    """The training loop's bar (tqdm, on ``stream``, default standard error), drawn on a terminal only: in a
    file or a pipe its redrawn frames (``\\r``) would interleave with the step lines, which say the same."""
    from tqdm import tqdm

    stream = sys.stderr if stream is None else stream
    return tqdm(total=total, initial=initial, desc="train", unit="step", file=stream, dynamic_ncols=True,
                disable=not (wanted and is_terminal(stream)))


def quiet_library_bars() -> None:
    """No progress bars from the Hugging Face libraries in this process. For a worker: its output reaches the
    user through Ray's log forwarding, a pipe, where a bar (``Loading weights``) is only a run of ``\\r``
    frames between the step lines."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # for a library not imported yet
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as hf_logging

    disable_progress_bars()
    hf_logging.disable_progress_bar()
