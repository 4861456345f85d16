"""The collector's pauses are told apart per engine call (``hybridrl.observe.gc_pauses``)."""

from __future__ import annotations

import gc

from hybridrl.observe.gc_pauses import GcPauseMeter, gc_pause_metrics


def test_a_full_collection_inside_a_call_is_counted_for_that_call_only():
    meter = GcPauseMeter()
    try:
        junk = [[i] for i in range(200_000)]  # something for the collection to walk
        with meter.watch("actor", "update"):
            gc.collect()  # a full (generation 2) collection
        with meter.watch("ref", "compute_log_probs"):
            pass
        gc.collect()  # outside every call: counted for none
        report = meter.report()
        assert report["gc/actor.update_s"] > 0 and report["gc/actor.update_full"] == 1.0
        assert report["gc/ref.compute_log_probs_full"] == 0.0
        assert report["gc/ref.compute_log_probs_s"] < report["gc/actor.update_s"]
        assert meter.report() == {}  # reset by the report
        del junk
    finally:
        meter.close()
    assert meter._on_collect not in gc.callbacks


class _Group:
    """What gc_pause_metrics asks of a worker group: one report per rank."""

    def __init__(self, reports):
        self.reports = reports

    def call_all(self, method):
        assert method == "gc_report"
        return self.reports


def test_the_slowest_rank_is_reported_and_a_shared_process_once():
    shared = _Group([{"gc/actor.update_s": 0.1}, {"gc/actor.update_s": 0.3}])
    rollout = _Group([{"gc/rollout.generate_s": 0.2}])
    out = gc_pause_metrics({"actor": shared, "ref": shared, "rollout": rollout})
    assert out == {"gc/actor.update_s": 0.3, "gc/rollout.generate_s": 0.2}
