"""``DataParallelInfo``: how one rank of an engine takes part in the worker group's scatter/gather.

A module of its own, below ``hybridrl.engines`` (which re-exports it as part of the engine contract), so that
the helpers an engine is built from (``hybridrl.engines.rollout_kit``) need not import the contract, whose
default episode method runs the episode runner built on those helpers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DataParallelInfo:
    """How a rank takes part in scatter/gather: ranks with the same ``dp_rank`` get the same chunk
    (tensor/pipeline parallel peers); only ranks with ``returns_output`` send results back."""

    dp_rank: int
    dp_size: int
    returns_output: bool = True
