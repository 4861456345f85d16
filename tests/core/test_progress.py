"""The training bar is drawn on a terminal only: piped to a file, its ``\\r`` frames would mix with the step lines."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

from hybridrl.observe.console import is_terminal, progress_bar
from hybridrl.observe.tracking import ConsoleTracker


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _drive(stream: io.StringIO, wanted: bool = True) -> str:
    """What three steps of the trainer's bar write to ``stream``, as ``Trainer.fit`` drives it."""
    bar = progress_bar(3, 0, wanted=wanted, stream=stream)
    for step in range(3):
        bar.update(1)
        bar.set_postfix(reward=f"{0.1 * step:.3f}", step_s="0.50")
    bar.close()
    return stream.getvalue()


def test_no_bar_when_the_stream_is_not_a_terminal() -> None:
    assert _drive(io.StringIO()) == ""


def test_a_bar_on_a_terminal_unless_turned_off() -> None:
    drawn = _drive(Terminal())
    assert "\r" in drawn and "3/3" in drawn  # the check above could fail: a terminal does get frames
    assert _drive(Terminal(), wanted=False) == ""  # trainer.progress=false


def test_step_lines_are_plain_when_piped(capsys: pytest.CaptureFixture[str]) -> None:
    err = io.StringIO()
    bar = progress_bar(2, 0, stream=err)
    tracker = ConsoleTracker("unused")
    for step in (1, 2):
        bar.update(1)
        tracker.log({"reward/mean": 0.5, "timing/step": 1.0}, step)
    bar.close()
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("step 1") and out.splitlines()[1].startswith("step 2")
    assert "\r" not in out and err.getvalue() == ""


def test_is_terminal_is_false_for_closed_and_odd_streams() -> None:
    closed = io.StringIO()
    closed.close()
    assert not is_terminal(closed) and not is_terminal(object()) and is_terminal(Terminal())


def test_a_worker_draws_no_library_bars() -> None:
    """Ray forwards a worker's output through a pipe: the Hugging Face bars (``Loading weights``) are off there."""
    code = ("from transformers.utils import logging\n"
            "assert logging.is_progress_bar_enabled()\n"
            "from hybridrl.runtime.worker import RoleWorker\n"
            "RoleWorker(0, 1, 'cpu')\n"
            "assert not logging.is_progress_bar_enabled()\n"
            "from huggingface_hub.utils import are_progress_bars_disabled\n"
            "assert are_progress_bars_disabled()\n")
    env = {key: value for key, value in os.environ.items() if key != "HF_HUB_DISABLE_PROGRESS_BARS"}
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env=env)
