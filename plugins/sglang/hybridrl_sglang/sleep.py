"""What the colocated SGLang engine releases when it sleeps and what each wake brings back (engine-free).

SGLang's memory saver releases memory by tag: ``kv_cache`` (always safe: the cache is rebuilt empty) and
``weights``, whose content is *lost* unless the engine started with ``enable_weights_cpu_backup`` (then it is
copied to host memory and back). The trainer's loop is: sync, sleep, [wake, generate, sleep, update, sync] per
step, the sync arriving while the engine sleeps. Waking goes by stages, as with vLLM: the weights alone before
an import (the KV cache stays released while the import runs), the KV cache at the next ``wake``.

Without the backup the weights are released only when that is known to be safe: the current weights served a
generation (nothing fresh would be lost) and imports have been seen arriving while asleep (the loop resyncs).
Otherwise only the KV cache is released. A wake with released weights and no import since raises instead of
generating from garbage.
"""

from __future__ import annotations

from dataclasses import dataclass

WEIGHTS, KV_CACHE = "weights", "kv_cache"


@dataclass
class MemoryState:
    cpu_backup: bool = False
    weights: str = "resident"  # "resident" | "backed_up" (in host memory) | "released" (content lost)
    kv_released: bool = False
    fresh_weights: bool = True  # loaded (at start or by an import) and not yet used for a generation
    imports_while_asleep: bool = False

    @property
    def asleep(self) -> bool:
        return self.kv_released or self.weights != "resident"

    def on_sleep(self) -> list[str]:
        """Tags to release (empty when already asleep)."""
        if self.asleep:
            return []
        tags = [KV_CACHE]
        if self.cpu_backup:
            self.weights = "backed_up"
            tags.append(WEIGHTS)
        elif self.imports_while_asleep and not self.fresh_weights:
            self.weights = "released"
            tags.append(WEIGHTS)
        self.kv_released = True
        return tags

    def on_import_begin(self) -> list[str]:
        """Tags to resume before loading new weights: the weights alone, the KV cache stays released."""
        tags = []
        if self.weights != "resident":
            tags.append(WEIGHTS)
            self.weights = "resident"
        if self.kv_released:
            self.imports_while_asleep = True
        return tags

    def on_import_end(self) -> None:
        self.fresh_weights = True

    def on_wake(self) -> list[str]:
        """Tags to resume before generating, weights first (empty: already awake)."""
        if self.weights == "released":
            raise RuntimeError("the SGLang engine released its weights while asleep and no weights were imported "
                               "before wake(); set roles.rollout.options.weights_cpu_backup=true if the loop does "
                               "not resync the weights after every generation")
        tags = []
        if self.weights == "backed_up":
            tags.append(WEIGHTS)
            self.weights = "resident"
        if self.kv_released:
            tags.append(KV_CACHE)
            self.kv_released = False
        return tags

    def on_generate(self) -> None:
        if self.asleep:
            raise RuntimeError("SGLangRollout.generate called while asleep; call wake() first")
        self.fresh_weights = False
