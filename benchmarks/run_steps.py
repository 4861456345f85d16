"""Which logged steps of a training run are its steady state: shared by the benchmarks that time whole runs, so
they leave the same steps out."""

from __future__ import annotations

from typing import Any


def steady_steps(rows: list[dict[str, Any]], skip: int) -> list[dict[str, Any]]:
    """The timed steps after ``skip`` warm-up steps that a long run repeats. A pipelined run's last step only
    trains (there is no next batch to generate beside it: ``pipelined_step``), so it is a drain, not a steady
    step, and is left out; pipelined steps are the ones that log ``timing/overlap_saved``."""
    later = [r for r in rows[skip:] if "timing/step" in r]
    if len(later) > 1 and "timing/overlap_saved" in later[-1]:
        later = later[:-1]
    return later
