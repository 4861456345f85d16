"""Config loading: YAML + dotted overrides, typed validation, errors that name the key path."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridrl.config import ConfigError, load_config

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"


def problems_of(overrides: list[str], path: Path | None = QUICKSTART) -> dict[str, str]:
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides)
    return dict(err.value.problems)


def test_quickstart_loads_and_overrides_apply():
    cfg = load_config(QUICKSTART, ["trainer.steps=7", "roles.rollout.temperature=0.5", "algorithm.kl.as=reward",
                                   "roles.actor.betas=[0.8, 0.9]"])
    assert cfg.trainer.steps == 7
    assert cfg.roles.rollout.temperature == 0.5
    assert cfg.algorithm.kl.apply_as == "reward"
    assert cfg.roles.actor.betas == (0.8, 0.9)
    assert "jsonl" in cfg.trainer.trackers


@pytest.mark.parametrize("override, key, reason", [
    ("roles.rolout.pool=main", "roles.rolout", "unknown key"),
    ("trainer.stepz=3", "trainer.stepz", "unknown key"),
    ("roles.actor.lr=fast", "roles.actor.lr", "valid number"),
    ("trainer.steps=-1", "trainer.steps", "greater than 0"),
    ("algorithm.kl.as=sideways", "algorithm.kl.as", "'loss' or 'reward'"),
    ("model.path=/x", "model", "exactly one of model.path"),
])
def test_bad_values_name_the_key(override, key, reason):
    problems = problems_of([override])
    assert key in problems, problems
    assert reason in problems[key]


def test_all_problems_reported_at_once():
    problems = problems_of(["trainer.stepz=3", "roles.actor.lr=fast", "pools.main.nodes=0"])
    assert {"trainer.stepz", "roles.actor.lr", "pools.main.nodes"} <= set(problems)


def test_override_syntax_and_missing_file(tmp_path):
    assert "<file>" in problems_of([], tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="key.path=value"):
        load_config(QUICKSTART, ["trainer.steps"])
    with pytest.raises(ConfigError, match="cannot set"):
        load_config(QUICKSTART, ["trainer.steps.x=1"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    assert "not valid YAML" in problems_of([], bad)["<file>"]


def test_an_override_that_is_not_yaml_names_its_key() -> None:
    found = problems_of(["trainer.trackers=[console,"])
    assert "the value '[console,' is not valid YAML" in found["trainer.trackers"]


def test_a_duplicated_key_is_refused_with_its_path_and_lines(tmp_path: Path) -> None:
    config = tmp_path / "dup.yaml"
    config.write_text(QUICKSTART.read_text() + "\ntrainer:\n  steps: 5\n")  # a second 'trainer:' at the top
    found = problems_of([], config)
    assert "duplicate key (first at line" in found["trainer"] and str(config) in found["trainer"]
    config.write_text("model: {tiny: {}}\ndata:\n  train: x.jsonl\n  shuffle: true\n  shuffle: false\n")
    assert problems_of([], config)["data.shuffle"].endswith("line 5: duplicate key (first at line 4); keep one")
    merged = tmp_path / "merge.yaml"  # a merge may still be overridden
    merged.write_text("base: &b {steps: 3}\nmodel: {tiny: {}}\ndata: {train: x.jsonl}\ntrainer: {<<: *b, steps: 4}\n")
    assert "trainer" not in problems_of([], merged)


def test_null_on_the_command_line_unsets_a_key() -> None:
    assert load_config(QUICKSTART, []).roles.actor.micro_batch == 256  # the quick start's own value
    cfg = load_config(QUICKSTART, ["roles.actor.micro_batch=null", "trainer.steps=~", "roles.actor.betas=NULL"])
    assert cfg.roles.actor.micro_batch == 16  # not None-able: back to its default
    assert cfg.trainer.steps == 100 and cfg.roles.actor.betas == (0.9, 0.999)
    assert "trainer.steps" in problems_of(["trainer.steps="])  # an empty value is a slip, not an unset
    assert load_config(QUICKSTART, ["roles.rollout.log_probs=null"]).roles.rollout.log_probs == "auto"  # a union
    cfg = load_config(QUICKSTART, ["roles.ref=null", "roles.reward.fn=null", "roles.reward.url=http://localhost:1"])
    assert cfg.roles.ref is None and cfg.roles.reward.fn is None  # None-able keys: None, as before
    assert load_config(QUICKSTART, ["roles.actor.micro_batch=8", "roles.actor.micro_batch=null"]) \
        .roles.actor.micro_batch == 16  # the last override wins


def test_null_for_a_required_key_is_refused_by_name() -> None:
    assert problems_of(["model=null"]) == {"model": "is required: null cannot unset it; give a value"}
    found = problems_of(["data=null", "trainer.stepz=1", "roles.actor.micro_batch=null"])
    assert found == {"data": "is required: null cannot unset it; give a value", "trainer.stepz": "unknown key"}
    assert problems_of(["roles.actor.microbatch=null"]) == {"roles.actor.microbatch": "unknown key"}


def test_a_bad_key_is_refused_before_torch_is_imported():
    """The CLI reads, checks and refuses a config without the tensor libraries: the error comes in well under a
    second, not after torch's import (``hybridrl.engines`` imports its contracts at first use)."""
    import subprocess
    import sys

    probe = ("import sys\nfrom hybridrl.cli import main\ncode = main(['train', sys.argv[1], 'trainer.stepz=3'])\n"
             "print(code, 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", probe, str(QUICKSTART)], capture_output=True, text=True, timeout=120)
    assert proc.stdout.split()[-2:] == ["2", "False"], proc.stdout + proc.stderr
    assert "trainer.stepz" in proc.stderr + proc.stdout
