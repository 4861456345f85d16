"""``benchmarks/cpu_slot_threads.py``'s fit: the exponent of a phase's seconds against its slot's threads."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
cpu_slot_threads = pytest.importorskip("cpu_slot_threads")


@pytest.mark.parametrize(("seconds", "b"), [
    ({1: 2.0, 2: 1.0}, 1.0),  # twice the threads, half the seconds: scales with its threads
    ({1: 1.0, 2: 1.0}, 0.0),  # threads buy nothing
    ({1: 1.5, 4: 1.0}, 0.292),  # through the fewest and the most threads: log(1.5) / log(4)
    ({1: 0.9, 2: 1.0}, -0.152),  # slower with more threads (oversubscribed cores)
])
def test_the_exponent_goes_through_the_fewest_and_the_most_threads(seconds, b):
    assert cpu_slot_threads.exponent(seconds) == pytest.approx(b, abs=1e-3)
