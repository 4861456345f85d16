"""``hybridrl plan RUN/config.json --advise``: a run's resolved config pins the auto settings chosen for its own
map; the advisor gives them back (``run_plan.json``) so each map is planned with its own, as from the YAML."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridrl.cli import main
from hybridrl.config import load_config
from hybridrl.placement.advice.from_run import RUN_PLAN_FILE, auto_resets

ROOT = Path(__file__).resolve().parents[2]
SHAPE = ROOT / "examples" / "configs" / "qwen2.5-0.5b"


def write_run_folder(tmp_path: Path, overrides: list[str]) -> Path:
    """A run folder as pre-flight leaves it on one 80 GiB GPU: the resolved ``config.json`` and ``run_plan.json``
    (the given config and the auto choices), for 0.5B GRPO with long responses."""
    from hybridrl.placement.auto import resolve_auto
    from hybridrl.placement.memory import device_memory_bytes, model_shape, model_shapes_by_role
    from hybridrl.placement.plan import ClusterSpec
    from hybridrl.plugins.discovery import get_registry
    from hybridrl.run.preflight import check_config, resolve_roles
    from hybridrl.run.run_plan import RunPlan

    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1 + 1 ="}\n')
    given = tmp_path / "given.yaml"
    given.write_text(json.dumps({
        "model": {"path": str(SHAPE), "dtype": "bfloat16"},
        "data": {"train": str(data), "max_prompt_len": 256, "prompts_per_step": 64},
        "algorithm": {"name": "grpo", "n_samples": 8, "kl": {"coef": 0.001, "estimator": "k3", "as": "loss"}},
        "roles": {"rollout": {"backend": "vllm", "max_new_tokens": 4096}, "reward": {"fn": "reverse"}},
        "cluster": {"device": "cuda"}, "trainer": {"out": str(tmp_path / "run")}}))
    cfg = load_config(given, overrides)
    registry = get_registry(())
    cluster = ClusterSpec(1, 1, "cuda", declared=True)
    run_cfg, notes, algo = resolve_roles(cfg, registry)
    backends, plan, problems = check_config(cfg, registry, cluster, resolved=(run_cfg, algo), check_engines=False)
    assert not problems, problems
    shape, source = model_shape(run_cfg, None, ())
    auto = resolve_auto(run_cfg, plan, registry, {r: b.name for r, b in backends.items()}, shape,
                        device_memory_bytes("cuda", 79), source, model_shapes_by_role(run_cfg, ()))
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(auto.cfg.model_dump(mode="json", by_alias=True)))
    record = RunPlan(cfg, auto.cfg, algo, tuple(notes), tuple(auto.choices)).record()
    (run / RUN_PLAN_FILE).write_text(json.dumps(record))
    return run


def advise(config: Path, capsys) -> dict[str, str]:
    status = main(["plan", str(config), "--advise", "--cluster", "1x1", "--device", "cuda", "--device-memory", "79",
                   "--skip-engine-check"])
    out = capsys.readouterr().out
    assert status == 0, out
    rows = [line.split() for line in out.splitlines() if line[:1] in "123456789-" and "x1" in line]
    return {f"{cells[1]} {cells[2]}": cells[0] for cells in rows}  # map -> rank ("-": dropped)


def test_a_runs_config_is_advised_with_its_auto_settings_resolved_per_map(tmp_path, capsys):
    run = write_run_folder(tmp_path, [])
    pinned = load_config(run / "config.json").roles.actor.max_tokens_per_micro_batch
    assert pinned is not None  # the run's config spells the budget its own map chose
    resets = auto_resets(run / "config.json")
    assert "roles.actor.max_tokens_per_micro_batch=null" in resets
    assert load_config(run / "config.json", resets).roles.actor.max_tokens_per_micro_batch is None
    with_record = advise(run / "config.json", capsys)
    (run / RUN_PLAN_FILE).rename(tmp_path / RUN_PLAN_FILE)
    without = advise(run / "config.json", capsys)
    # the colocated run's micro-batches sized for its own map do not fit beside a resident engine; the
    # fractional map's own choices do
    assert without["fractional 1x1"] == "-" and with_record["fractional 1x1"] != "-", (with_record, without)


@pytest.mark.parametrize("written", [True, False])
def test_a_key_goes_back_to_what_the_user_wrote_or_to_its_default(tmp_path, written):
    """``roles.rollout.log_probs: auto`` written in the YAML comes back as written; left out, it is unset (its
    default, auto); a backend option left out comes back as ``auto``. Either way the key is free again."""
    run = write_run_folder(tmp_path, ["roles.rollout.log_probs=auto"] if written else [])
    resets = auto_resets(run / "config.json")
    assert ("roles.rollout.log_probs=auto" if written else "roles.rollout.log_probs=null") in resets
    assert "roles.actor.options.offload=auto" in resets
    reset = load_config(run / "config.json", resets)
    assert load_config(run / "config.json").roles.rollout.log_probs is False  # pinned by the run
    assert reset.roles.rollout.log_probs == "auto" and reset.roles.actor.options["offload"] == "auto"


def test_a_config_that_is_no_runs_has_nothing_to_reset(tmp_path):
    config = tmp_path / "config.json"
    config.write_text("{}")
    assert auto_resets(config) == []
    (tmp_path / RUN_PLAN_FILE).write_text("not json")
    assert auto_resets(config) == []
    assert auto_resets(ROOT / "examples" / "quickstart.yaml") == []
