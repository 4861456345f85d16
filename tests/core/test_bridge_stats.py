"""The colocated bridge's figures: bytes and buckets it moved, plus what the rollout engine reports about its own
import (``RolloutEngine.import_stats``), which the trainer logs as ``reshard/<key>``."""

from __future__ import annotations

import torch

from hybridrl.bridge import sync_in_process


class Exporter:
    def __init__(self) -> None:
        self.weights = {"a": torch.ones(4), "b": torch.zeros(2, 3, dtype=torch.float64)}

    def export_weights_transient(self, bucket_bytes: int):
        for name, tensor in self.weights.items():  # one tensor per bucket
            yield [(name, tensor)]


class Importer:
    def __init__(self, stats: dict[str, float] | None) -> None:
        self.received: dict[str, torch.Tensor] = {}
        self.finished = 0
        self.stats = stats

    def import_weights(self, bucket) -> None:
        self.received.update({n: t.clone() for n, t in bucket})

    def finish_weight_import(self) -> None:
        self.finished += 1

    def import_stats(self) -> dict[str, float]:
        return dict(self.stats or {})


def test_sync_reports_bytes_buckets_and_the_engines_own_figures():
    trainer, rollout = Exporter(), Importer({"wake_weights_s": 0.25, "load_s": 0.5})
    stats = sync_in_process(trainer, rollout, bucket_bytes=1)
    assert rollout.finished == 1 and set(rollout.received) == {"a", "b"}
    assert stats["bytes"] == 4 * 4 + 6 * 8 and stats["buckets"] == 2
    assert stats["wake_weights_s"] == 0.25 and stats["load_s"] == 0.5 and stats["seconds"] >= 0


class PlainImporter:
    """An engine written before the ``import_stats`` hook."""

    def import_weights(self, bucket) -> None:
        pass

    def finish_weight_import(self) -> None:
        pass


def test_engines_without_the_hook_still_sync():
    stats = sync_in_process(Exporter(), PlainImporter(), bucket_bytes=1)
    assert set(stats) == {"bytes", "buckets", "seconds"}
