"""docs/config.md is generated from the config schema; it must match what the schema says today."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "docs" / "gen_config_reference.py"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_reference", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_reference_is_up_to_date():
    expected = _generator().render()
    current = (ROOT / "docs" / "config.md").read_text()
    assert current == expected, "docs/config.md is out of date: run python docs/gen_config_reference.py"


def test_config_reference_lists_every_leaf_key():
    from hybridrl.config.schema import RunConfig

    text = _generator().render()
    # a few keys from each depth, aliases by their YAML name
    for key in ("model.path", "data.prompts_per_step", "algorithm.kl.as", "pools.<name>.devices_per_node",
                "roles.actor.lora.rank", "roles.reward.http.timeout_s", "trainer.steps", "cluster.address"):
        assert f"| `{key}` |" in text, key
    for name in RunConfig.model_fields["trainer"].annotation.model_fields:
        assert f"| `trainer.{name}` |" in text, name


def test_description_lands_in_the_table():
    text = _generator().render()
    row = next(line for line in text.splitlines() if line.startswith("| `trainer.max_staleness` |"))
    assert "int (>= 1)" in row and "`1`" in row and "pipelined and partial rollouts: at most" in row
