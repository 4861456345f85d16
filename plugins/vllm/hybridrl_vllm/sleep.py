"""When the colocated engine sleeps, at which level, and what each wake must bring back (engine-free).

vLLM's sleep level 1 keeps a host copy of the weights (they come back on wake); level 2 discards them (the
next weights must be imported before generating), which saves a device->host and a host->device copy of the
model per step. The trainer's loop is: sync, sleep, [wake, generate, sleep, update, sync] per step, with the
sync arriving while the engine sleeps: it wakes the weights alone, loads, and the KV cache comes back at the
next ``wake``.

``level="kv_cache"`` releases the KV cache alone and keeps the weights resident: an update is then a plain
copy into live parameters (no re-mapping of the weights' memory), for models whose weights the trainer can
afford to leave on the device (a 0.5B model in bf16 is 1 GB of a 141 GB H200).

``level="auto"`` chooses level 2 only when it is known to be safe: the current weights have served a
generation (nothing fresh would be lost) and imports have been seen arriving while asleep (the loop resyncs
during sleep). Otherwise level 1. A wake with discarded weights and no import since raises instead of
generating from garbage.
"""

from __future__ import annotations

from dataclasses import dataclass

WEIGHTS, KV_CACHE = "weights", "kv_cache"
KV_ONLY = "kv_cache"
LEVELS = (1, 2, "auto", KV_ONLY)


@dataclass
class SleepState:
    level: int | str = "auto"
    weights: str = "awake"  # "awake" | "offloaded" (level 1) | "discarded" (level 2)
    kv_asleep: bool = False
    fresh_weights: bool = True  # imported (or loaded at start) and not yet used for a generation
    imports_while_asleep: bool = False

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"sleep_level must be one of {LEVELS}, got {self.level!r}")

    @property
    def asleep(self) -> bool:
        return self.kv_asleep or self.weights != "awake"

    def on_sleep(self) -> int | str | None:
        """The level to sleep at (1, 2 or ``KV_ONLY``), or None when already asleep (nothing to do)."""
        if self.asleep:
            return None
        if self.level == KV_ONLY:
            self.kv_asleep = True
            return KV_ONLY
        if self.level == "auto":
            level = 2 if (self.imports_while_asleep and not self.fresh_weights) else 1
        else:
            level = int(self.level)
        self.weights = "discarded" if level == 2 else "offloaded"
        self.kv_asleep = True
        return level

    def on_import_begin(self) -> list[str]:
        """Tags to wake before loading a new set of weights (the weights alone; the KV cache stays asleep)."""
        tags = []
        if self.weights != "awake":
            tags.append(WEIGHTS)
            self.weights = "awake"
        if self.kv_asleep:
            self.imports_while_asleep = True
        return tags

    def on_import_end(self) -> None:
        self.fresh_weights = True

    def on_wake(self) -> list[str]:
        """Tags to wake before generating (empty: already awake)."""
        if self.weights == "discarded":
            raise RuntimeError("the vLLM engine slept at level 2 (weights discarded) and no weights were imported "
                               "before wake(); set roles.rollout.options.sleep_level=1 if the loop does not resync "
                               "the weights after every generation")
        tags = []
        if self.weights == "offloaded":
            tags.append(WEIGHTS)
            self.weights = "awake"
        if self.kv_asleep:
            tags.append(KV_CACHE)
            self.kv_asleep = False
        return tags

    def on_generate(self) -> None:
        if self.asleep:
            raise RuntimeError("VLLMRollout.generate called while asleep; call wake() first")
        self.fresh_weights = False
