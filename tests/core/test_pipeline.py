"""Pipelined steps without Ray: the staleness rule, the pre-flight checks, the TIS default and the plan's view."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridrl.cli import main
from hybridrl.config import load_config
from hybridrl.placement.plan import ClusterSpec
from hybridrl.plugins.discovery import get_registry
from hybridrl.run.pipeline import GenerationJob, StalenessError, needs_sync, staleness_of
from hybridrl.run.preflight import check_config, with_algorithm_roles

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "examples" / "quickstart.yaml")
SPLIT = str(ROOT / "examples" / "quickstart-split.yaml")
CPU2 = ClusterSpec(1, 2, "cpu", declared=True)


def simulate(max_staleness: int, steps: int, sync_every: int | None = None) -> tuple[list[int], int]:
    """The trainer's bookkeeping over ``steps`` pipelined steps: staleness per step and the number of syncs
    (weights sent every ``sync_every`` updates, default: as rarely as the bound allows)."""
    actor = rollout = syncs = 0
    job = GenerationJob(None, 0, rollout, None)  # type: ignore[arg-type]
    out = []
    for step in range(steps):
        out.append(staleness_of(job, actor, max_staleness))
        if needs_sync(actor, rollout, max_staleness, sync_every or max_staleness):
            rollout, syncs = actor, syncs + 1
        job = GenerationJob(None, step + 1, rollout, None)  # type: ignore[arg-type]
        actor += 1  # train_on updates the actor
    return out, syncs


@pytest.mark.parametrize("bound, expected, syncs", [(1, [0, 1, 1, 1, 1, 1], 5), (2, [0, 1, 2, 1, 2, 1], 2),
                                                    (3, [0, 1, 2, 3, 1, 2], 1)])
def test_staleness_stays_within_the_bound_and_syncs_only_when_needed(bound, expected, syncs):
    assert simulate(bound, 6) == (expected, syncs)


def test_weights_go_out_every_sync_every_updates_within_the_bound():
    assert simulate(2, 6, sync_every=1) == ([0, 1, 1, 1, 1, 1], 5)  # the default: every update
    assert simulate(3, 6, sync_every=2) == ([0, 1, 2, 1, 2, 1], 2)
    with pytest.raises(ValueError, match="trainer.sync_every=3 exceeds trainer.max_staleness=2"):
        load_config(SPLIT, ["trainer.sync_every=3", "trainer.max_staleness=2"])


def test_a_batch_past_the_bound_is_refused():
    job = GenerationJob(None, 5, 2, None)  # type: ignore[arg-type]
    assert staleness_of(job, 3, 1) == 1
    with pytest.raises(StalenessError, match="staleness 2 outside"):
        staleness_of(job, 4, 1)


def problems_for(path: str, overrides: list[str]) -> list[tuple[str, str]]:
    return check_config(load_config(path, overrides), get_registry(), CPU2)[2]


def test_preflight_refuses_pipelined_with_actor_and_rollout_colocated():
    problems = problems_for(QUICKSTART, ["trainer.pipelined=true"])
    assert len(problems) == 1
    key, reason = problems[0]
    assert key == "trainer.pipelined"
    assert "roles.actor.pool" in reason and "roles.rollout.pool" in reason and "'main'" in reason


def test_preflight_refuses_other_roles_on_the_rollout_pool_and_remax():
    shared = problems_for(SPLIT, ["trainer.pipelined=true", "roles.ref.pool=gen"])
    assert [k for k, _ in shared] == ["trainer.pipelined"] and "roles.ref.pool" in shared[0][1]
    remax = problems_for(SPLIT, ["trainer.pipelined=true", "algorithm.name=remax"])
    assert [k for k, _ in remax] == ["trainer.pipelined"] and "greedy baseline" in remax[0][1]


def test_split_pipelined_passes_and_defaults_tis_on():
    registry = get_registry()
    assert problems_for(SPLIT, ["trainer.pipelined=true"]) == []
    cfg, notes = with_algorithm_roles(load_config(SPLIT, ["trainer.pipelined=true"]), registry)
    assert cfg.algorithm.tis_cap == 2.0 and any("tis_cap" in n for n in notes)
    off, _ = with_algorithm_roles(load_config(SPLIT, ["trainer.pipelined=true", "algorithm.tis_cap=null"]), registry)
    assert off.algorithm.tis_cap is None
    sync, _ = with_algorithm_roles(load_config(SPLIT), registry)
    assert sync.algorithm.tis_cap is None  # the synchronous loop is unchanged unless asked


def test_plan_prints_phases_per_device_and_takes_overrides_after_options(capsys):
    assert main(["plan", SPLIT, "--cluster", "1x2", "--device", "cpu", "trainer.pipelined=true",
                 "trainer.max_staleness=2", "trainer.sync_every=2"]) == 0
    out = capsys.readouterr().out
    assert "node0:0  actor[old_log_prob, update_actor, reshard-send], ref[ref]" in out
    assert "node0:1  rollout[gen, reshard-recv]" in out
    assert "pipelined: pool 'gen'" in out and "at most 2 update(s) stale" in out
    assert main(["plan", QUICKSTART, "--cluster", "1x2", "--device", "cpu", "trainer.pipelined=true"]) == 2
    assert "trainer.pipelined" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", QUICKSTART, "--cluster", "1x2", "--bogus"])


def resolved(path: str, overrides: list[str]):
    from hybridrl.run.preflight import resolve_roles

    cfg, notes, _ = resolve_roles(load_config(path, overrides), get_registry())
    return cfg, notes


def test_async_mode_pipelines_a_rollout_alone_on_its_pool():
    cfg, notes = resolved(SPLIT, ["trainer.mode=async"])
    assert cfg.trainer.pipelined and cfg.roles.rollout.oversample == 1.0
    assert any("trainer.mode=async" in n and "trainer.pipelined" in n for n in notes)
    assert problems_for(SPLIT, ["trainer.mode=async"]) == []


def test_async_mode_keeps_groups_in_flight_on_a_colocated_map():
    cfg, notes = resolved(QUICKSTART, ["trainer.mode=async"])
    assert not cfg.trainer.pipelined  # the refusal of pipelined-with-colocated does not apply
    assert cfg.roles.rollout.oversample == 1.25 and cfg.roles.rollout.partial is True
    assert any("groups in flight" in n for n in notes)
    assert problems_for(QUICKSTART, ["trainer.mode=async"]) == []
    mine, _ = resolved(QUICKSTART, ["trainer.mode=async", "roles.rollout.oversample=2"])
    assert mine.roles.rollout.oversample == 2.0
    # the reference on the rollout's own pool: the rollout is not alone there, so groups in flight again
    shared, _ = resolved(SPLIT, ["trainer.mode=async", "roles.ref.pool=gen"])
    assert not shared.trainer.pipelined and shared.roles.rollout.oversample == 1.25


def test_pipelined_is_async_mode_and_refuses_to_contradict_sync():
    assert load_config(SPLIT, ["trainer.pipelined=true"]).trainer.mode == "async"
    with pytest.raises(ValueError, match="trainer.pipelined=true .* trainer.mode=async"):
        load_config(SPLIT, ["trainer.pipelined=true", "trainer.mode=sync"])
    # the explicit flag keeps its checks: colocated, it is still refused with its key
    assert [k for k, _ in problems_for(QUICKSTART, ["trainer.pipelined=true"])] == ["trainer.pipelined"]
