"""What ``hybridrl train`` shows on the terminal: the core logs through ``logging`` (``hybridrl.*`` loggers);
the CLI routes them to standard output as plain lines, warnings prefixed, so a run reads as it always has
while a program embedding hybridrl keeps control of its own logging."""

from __future__ import annotations

import logging
import sys


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
