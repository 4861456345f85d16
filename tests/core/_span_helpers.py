"""A split placement and a timer with given spans, shared by the span and busy-share tests."""

from __future__ import annotations

from hybridrl.observe.timing import PhaseTimer
from hybridrl.placement.plan import ClusterSpec, Device, PlacementPlan, ProcessGroupPlan


def split_plan() -> PlacementPlan:
    """actor + ref on pool 'train' (2 devices), rollout on pool 'gen' (2 devices); a rule reward."""
    train = [Device(0, 0), Device(0, 1)]
    gen = [Device(0, 2), Device(0, 3)]
    groups = [ProcessGroupPlan("train", "fsdp", {"actor": "fsdp", "ref": "fsdp"}, train, 0),
              ProcessGroupPlan("gen", "hf", {"rollout": "hf"}, gen, 0)]
    return PlacementPlan(ClusterSpec(1, 4, "cpu"), {"train": train, "gen": gen}, groups,
                         {"actor": "train", "ref": "train", "rollout": "gen"})


def timer_with(phases: list[tuple[str, float, float]], started: float = 1000.0) -> PhaseTimer:
    """A timer whose spans are given (seconds after ``started``), as if the phases had run."""
    timer = PhaseTimer()
    timer.started = started
    timer.spans = [(name, started + a, started + b) for name, a, b in phases]
    for name, a, b in phases:
        timer.seconds[name] = timer.seconds.get(name, 0.0) + b - a
    return timer


def fractional_plan() -> PlacementPlan:
    """actor + ref on pool 'train' (2 devices), the rollout on pool 'gen' sharing them (``pools.gen.share``)."""
    train = [Device(0, 0), Device(0, 1)]
    groups = [ProcessGroupPlan("train", "fsdp", {"actor": "fsdp", "ref": "fsdp"}, train, 0),
              ProcessGroupPlan("gen", "vllm", {"rollout": "vllm"}, list(train), 0)]
    return PlacementPlan(ClusterSpec(1, 2, "cuda"), {"train": train, "gen": list(train)}, groups,
                         {"actor": "train", "ref": "train", "rollout": "gen"}, shares={"gen": "train"})
