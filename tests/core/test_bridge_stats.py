"""The colocated bridge's figures: bytes and buckets it moved, plus what the rollout engine reports about its own
import (``RolloutEngine.import_stats``), which the trainer logs as ``reshard/<key>``."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from hybridrl.engines import RolloutEngine, TrainEngine
from hybridrl.weights.bridges import sync_in_process


class Exporter:
    """The part of ``TrainEngine`` the bridge calls, with the contract's defaults."""

    ctx = SimpleNamespace(lora=None)  # the part of its context the bridge reads: no LoRA, full weights

    def __init__(self) -> None:
        self.weights = {"a": torch.ones(4), "b": torch.zeros(2, 3, dtype=torch.float64)}

    def export_weights_transient(self, bucket_bytes: int):
        for name, tensor in self.weights.items():  # one tensor per bucket
            yield [(name, tensor)]

    transient_export_holds_views = TrainEngine.transient_export_holds_views


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

    imports_without_staging = RolloutEngine.imports_without_staging


def test_sync_reports_bytes_buckets_and_the_engines_own_figures():
    trainer, rollout = Exporter(), Importer({"wake_weights_s": 0.25, "load_s": 0.5})
    stats = sync_in_process(trainer, rollout, bucket_bytes=1)
    assert rollout.finished == 1 and set(rollout.received) == {"a", "b"}
    assert stats["bytes"] == 4 * 4 + 6 * 8 and stats["buckets"] == 2
    assert stats["wake_weights_s"] == 0.25 and stats["load_s"] == 0.5 and stats["seconds"] >= 0


class PlainImporter:
    """An engine that keeps the contract's default ``import_stats`` (no figures of its own)."""

    def import_weights(self, bucket) -> None:
        pass

    def finish_weight_import(self) -> None:
        pass

    import_stats = RolloutEngine.import_stats
    imports_without_staging = RolloutEngine.imports_without_staging


def test_engines_with_the_default_import_stats_report_the_bridge_figures_alone():
    stats = sync_in_process(Exporter(), PlainImporter(), bucket_bytes=1)
    assert set(stats) == {"bytes", "buckets", "seconds"}


class GroupingExporter(Exporter):
    """Buckets by the core's grouping rule, saying whether its tensors are views of live weights."""

    def __init__(self, views: bool) -> None:
        super().__init__()
        self.views = views
        self.asked: list[int] = []

    def export_weights_transient(self, bucket_bytes: int):
        from hybridrl.weights.buckets import group_into_buckets

        self.asked.append(bucket_bytes)
        return group_into_buckets(iter(self.weights.items()), bucket_bytes)

    def transient_export_holds_views(self) -> bool:
        return self.views


class InPlaceImporter(Importer):
    def __init__(self, in_place: bool) -> None:
        super().__init__(None)
        self.in_place = in_place
        self.bucket_sizes: list[int] = []

    def import_weights(self, bucket) -> None:
        self.bucket_sizes.append(len(bucket))
        super().import_weights(bucket)

    def imports_without_staging(self) -> bool:
        return self.in_place


def test_views_copied_in_place_travel_in_large_buckets_and_anything_else_keeps_the_bucket_size(monkeypatch):
    import hybridrl.weights.bridges as bridge

    monkeypatch.setattr(bridge, "VIEW_BUCKET_BYTES", 64)  # the test's two tensors: 16 and 48 bytes
    for views, in_place, large in [(True, True, True), (True, False, False), (False, True, False)]:
        trainer, rollout = GroupingExporter(views), InPlaceImporter(in_place)
        stats = sync_in_process(trainer, rollout, bucket_bytes=1)
        assert set(rollout.received) == {"a", "b"}
        if large:  # nothing is staged on either side: the floor applies
            assert rollout.bucket_sizes == [2] and stats["buckets"] == 1 and trainer.asked == [64]
        else:  # an exporter that gathers or an importer that stages keeps the configured bound
            assert rollout.bucket_sizes == [1, 1] and trainer.asked == [1]
    trainer, rollout = GroupingExporter(True), InPlaceImporter(True)
    sync_in_process(trainer, rollout, bucket_bytes=128)  # a larger configured size stays
    assert trainer.asked == [128]
    trainer, rollout = GroupingExporter(True), InPlaceImporter(True)
    sync_in_process(trainer, rollout, bucket_bytes=1, views_in_large_buckets=False)
    assert rollout.bucket_sizes == [1, 1] and trainer.asked == [1]
