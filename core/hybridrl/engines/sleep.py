"""What a colocated rollout engine releases when it sleeps, and what each wake must bring back (engine-free).

The trainer's loop is: sync, sleep, [wake, generate, sleep, update, sync] per step, the sync arriving while the
engine sleeps. Waking goes by stages: the weights alone before an import (the KV cache stays released while
the import runs), the KV cache at the next ``wake``. At each sleep the weights either stay resident (``keep``),
go to host memory and come back on wake (``backup``), or are dropped (``discard``: the next import refills
them, which saves a device->host and a host->device copy of the model per step).

``auto`` discards only when that is known to be safe: the current weights have served a generation (nothing
fresh would be lost) and imports have been seen arriving while asleep (the loop resyncs). Otherwise it does
what the engine names as its fallback. A wake with discarded weights and no import since raises instead of
generating from garbage. vLLM's sleep levels and SGLang's memory-saver tags are each a thin reading of this.
"""

from __future__ import annotations

from dataclasses import dataclass

WEIGHTS, KV_CACHE = "weights", "kv_cache"
KEEP, BACKUP, DISCARD, AUTO = "keep", "backup", "discard", "auto"
POLICIES = (KEEP, BACKUP, DISCARD, AUTO)
RESIDENT, BACKED_UP, RELEASED = "resident", "backed_up", "released"


@dataclass
class SleepStages:
    """The sleep state of one engine. ``policy``: what sleeping does with the weights; ``auto_fallback``:
    ``keep`` or ``backup``, what ``auto`` does when discarding is not known to be safe. ``engine`` and ``fix``
    (the setting that avoids discarding) word the errors."""

    policy: str = AUTO
    auto_fallback: str = BACKUP
    engine: str = "rollout"
    fix: str = ""
    weights: str = RESIDENT
    kv_released: bool = False
    fresh_weights: bool = True  # loaded (at start or by an import) and not yet used for a generation
    imports_while_asleep: bool = False

    def __post_init__(self) -> None:
        if self.policy not in POLICIES or self.auto_fallback not in (KEEP, BACKUP):
            raise ValueError(f"sleep policy must be one of {POLICIES} (auto falling back to keep or backup), "
                             f"got {self.policy!r} / {self.auto_fallback!r}")

    @property
    def asleep(self) -> bool:
        return self.kv_released or self.weights != RESIDENT

    def on_sleep(self) -> str | None:
        """What happens to the weights at this sleep (``keep``, ``backup`` or ``discard``; the KV cache is always
        released), or None when already asleep (nothing to do)."""
        if self.asleep:
            return None
        fate = self.policy
        if fate == AUTO:
            fate = DISCARD if (self.imports_while_asleep and not self.fresh_weights) else self.auto_fallback
        self.weights = {KEEP: RESIDENT, BACKUP: BACKED_UP, DISCARD: RELEASED}[fate]
        self.kv_released = True
        return fate

    def on_import_begin(self) -> list[str]:
        """Tags to wake before loading new weights: the weights alone, the KV cache stays released."""
        tags = []
        if self.weights != RESIDENT:
            tags.append(WEIGHTS)
            self.weights = RESIDENT
        if self.kv_released:
            self.imports_while_asleep = True
        return tags

    def on_import_end(self) -> None:
        self.fresh_weights = True

    def on_wake(self) -> list[str]:
        """Tags to wake before generating, weights first (empty: already awake)."""
        if self.weights == RELEASED:
            raise RuntimeError(f"the {self.engine} engine discarded its weights while asleep and no weights were "
                               f"imported before wake(); set {self.fix} if the loop does not resync the weights "
                               "after every generation")
        tags = []
        if self.weights == BACKED_UP:
            tags.append(WEIGHTS)
            self.weights = RESIDENT
        if self.kv_released:
            tags.append(KV_CACHE)
            self.kv_released = False
        return tags

    def on_generate(self) -> None:
        if self.asleep:
            raise RuntimeError(f"{self.engine} generate called while asleep; call wake() first")
        self.fresh_weights = False
