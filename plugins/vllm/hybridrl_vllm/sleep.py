"""vLLM's sleep levels, read onto the core's sleep stages (``hybridrl.engines.sleep``).

Level 1 keeps a host copy of the weights (``backup``), level 2 discards them (``discard``), ``kv_cache``
releases the KV cache alone and keeps the weights resident (``keep``: an update is then a plain copy into live
parameters, for models whose weights the trainer can afford to leave on the device), and ``auto`` discards
only when it is known to be safe, level 1 otherwise.
"""

from __future__ import annotations

from hybridrl.engines.sleep import AUTO, BACKUP, DISCARD, KEEP, KV_CACHE, WEIGHTS, SleepStages

__all__ = ["KV_CACHE", "KV_ONLY", "LEVELS", "WEIGHTS", "SleepState"]

KV_ONLY = "kv_cache"
LEVELS = (1, 2, "auto", KV_ONLY)
_POLICY = {1: BACKUP, 2: DISCARD, "auto": AUTO, KV_ONLY: KEEP}
_LEVEL = {BACKUP: 1, DISCARD: 2, KEEP: KV_ONLY}


class SleepState(SleepStages):
    """The sleep stages of one vLLM engine at ``sleep_level`` (1, 2, ``auto`` or ``kv_cache``)."""

    def __init__(self, level: int | str = "auto", imports_while_asleep: bool = False) -> None:
        if level not in LEVELS:
            raise ValueError(f"sleep_level must be one of {LEVELS}, got {level!r}")
        self.level = level
        super().__init__(policy=_POLICY[level], auto_fallback=BACKUP, engine="vLLM",
                         fix="roles.rollout.options.sleep_level=1", imports_while_asleep=imports_while_asleep)

    @property
    def kv_asleep(self) -> bool:
        return self.kv_released

    def on_sleep(self) -> int | str | None:  # type: ignore[override]
        """The level to sleep at (1, 2 or ``KV_ONLY``), or None when already asleep."""
        fate = super().on_sleep()
        return None if fate is None else _LEVEL[fate]
