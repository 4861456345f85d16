"""SGLang's memory-saver tags, read onto the core's sleep stages (``hybridrl.engines.sleep``).

The memory saver releases by tag: ``kv_cache`` (always safe: the cache is rebuilt empty) and ``weights``, whose
content is *lost* unless the engine started with ``enable_weights_cpu_backup`` (then ``backup``: copied to host
memory and back). Without the backup the weights are released only when the core's ``auto`` says it is safe,
and kept resident otherwise.
"""

from __future__ import annotations

from hybridrl.engines.sleep import AUTO, BACKUP, KEEP, KV_CACHE, RESIDENT, WEIGHTS, SleepStages

__all__ = ["KV_CACHE", "WEIGHTS", "MemoryState"]


class MemoryState(SleepStages):
    """The sleep stages of one SGLang engine, with or without the host copy of its weights."""

    def __init__(self, cpu_backup: bool = False, weights: str = RESIDENT, kv_released: bool = False) -> None:
        self.cpu_backup = cpu_backup
        super().__init__(policy=BACKUP if cpu_backup else AUTO, auto_fallback=KEEP, engine="SGLang",
                         fix="roles.rollout.options.weights_cpu_backup=true", weights=weights,
                         kv_released=kv_released)

    def on_sleep(self) -> list[str]:  # type: ignore[override]
        """Tags to release (empty when already asleep)."""
        fate = super().on_sleep()
        if fate is None:
            return []
        return [KV_CACHE] if fate == KEEP else [KV_CACHE, WEIGHTS]
