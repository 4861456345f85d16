"""The ``environment`` section is checked before any process starts, each problem under its key: bad values and
unknown keys when the config loads; unknown environments, tools and parsers, tool options for unlisted tools or
that their tool refuses (under ``environment.tool_options.<tool>``), the per-request mode on a rollout that does
not declare it, ReMax with episodes, options the environment refuses, and an opening plus ``max_total_tokens``
past the model's positions; the calc example passes."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridrl.config import ConfigError, load_config
from hybridrl.environments.driver import Episodes
from hybridrl.placement.plan import ClusterSpec
from hybridrl.plugins.discovery import get_registry
from hybridrl.run.preflight import prepare_run

ROOT = Path(__file__).resolve().parents[2]
TOOL_CALC = ROOT / "examples" / "tool-calc.yaml"
CPU2 = ClusterSpec(1, 2, "cpu")


def problems(tmp_path: Path, overrides: list[str]) -> dict[str, str]:
    cfg = load_config(TOOL_CALC, [f"trainer.out={tmp_path / 'run'}", *overrides])
    with pytest.raises(ConfigError) as err:
        prepare_run(cfg, get_registry(tuple(cfg.plugins)), CPU2)
    return {key: reason for key, reason in err.value.problems}


@pytest.mark.parametrize("overrides,key,reason", [
    (["environment.name=chess"], "environment.name", "unknown environment 'chess'"),
    (["environment.tools=[calculator,search]"], "environment.tools", "unknown tool 'search'"),
    (["environment.tool_parser=xml"], "environment.tool_parser", "unknown tool parser 'xml'"),
    (["environment.tool_options={python: {timeout_s: 3}}"], "environment.tool_options", "'python'"),
    (["environment.mode=requests"], "environment.mode", "'hf' does not declare the 'requests' capability"),
    (["algorithm.name=remax"], "environment.name", "greedy single generation"),
    (["environment.options={max_calls_per_turn: 0}"], "environment.options", "max_calls_per_turn must be >= 1"),
    (["environment.tools=[]"], "environment.options", "needs the calculator"),
    (["environment.options={call_syntax: short}"], "environment.options", "call_syntax must be one of"),
    (["environment.max_total_tokens=200"], "environment.max_total_tokens", "max_position_embeddings=128"),
    (["environment.tools=[calculator,python]", "environment.tool_options={python: {timeoutt: 3}}"],
     "environment.tool_options.python", "unknown option(s) ['timeoutt']"),
    (["environment.tools=[calculator,python]", "environment.tool_options={python: {timeout_s: 0}}"],
     "environment.tool_options.python", "timeout_s must be a number > 0"),
    (["environment.tools=[calculator,python]", "environment.tool_options={python: {memory_mb: 0.5}}"],
     "environment.tool_options.python", "memory_mb must be a whole number > 0"),
    (["environment.tools=[calculator,python]", "environment.tool_options={python: {network: maybe}}"],
     "environment.tool_options.python", "network must be 'block' or 'allow'"),
    (["environment.tool_options={calculator: {precision: 3}}"], "environment.tool_options.calculator",
     "does not take the option(s) ['precision']"),
])
def test_environment_problems_are_found_before_start(tmp_path, overrides, key, reason):
    found = problems(tmp_path, overrides)
    assert key in found and reason in found[key], found
    assert not (tmp_path / "run").exists()  # nothing written


@pytest.mark.parametrize("override,key,reason", [
    ("environment.max_turns=0", "environment.max_turns", "greater than 0"),
    ("environment.mode=async", "environment.mode", "'auto', 'batched' or 'requests'"),
    ("environment.max_turn=2", "environment.max_turn", "unknown key"),
    ("environment.env_workers=0", "environment.env_workers", "greater than 0"),
    ("environment.max_total_tokens=-4", "environment.max_total_tokens", "greater than 0"),
])
def test_environment_keys_are_checked_when_the_config_loads(tmp_path, override, key, reason):
    with pytest.raises(ConfigError) as err:
        load_config(TOOL_CALC, [f"trainer.out={tmp_path / 'run'}", override])
    found = dict(err.value.problems)
    assert key in found and reason in found[key], found


def test_good_tool_options_pass(tmp_path):
    cfg = load_config(TOOL_CALC, [f"trainer.out={tmp_path / 'run'}", "environment.tools=[calculator,python]",
                                  "environment.tool_options={python: {timeout_s: 2.5, memory_mb: 256}}"])
    assert prepare_run(cfg, get_registry(), CPU2).cfg.environment.tool_options["python"]["memory_mb"] == 256


def test_the_calc_example_passes_and_plays_batched_on_the_hf_rollout(tmp_path):
    cfg = load_config(TOOL_CALC, [f"trainer.out={tmp_path / 'run'}"])
    setup = prepare_run(cfg, get_registry(), CPU2)
    episodes = Episodes.for_run(setup.cfg, setup.registry)
    assert episodes is not None and episodes.spec.mode == "batched" and episodes.spec.name == "calc"
    assert episodes.spec.limits(cfg.roles.rollout.max_new_tokens).max_total_tokens == 16
    quick = load_config(ROOT / "examples" / "quickstart.yaml", [f"trainer.out={tmp_path / 'q'}"])
    assert Episodes.for_run(quick, get_registry()) is None  # the default: today's single generation


def test_some_reward_is_needed_without_an_environment(tmp_path):
    with pytest.raises(ConfigError, match="or an environment whose episodes reward themselves"):
        load_config(TOOL_CALC, ["environment.name=single_turn", "environment.max_turns=1"])


@pytest.mark.parametrize("name, how", [
    ("hangs_on_reset", "timed out after 1s"),
    ("exits_on_reset", "called sys.exit(3)"),
    ("dies_on_reset", "ended its process with exit status 5"),
])
def test_a_user_environment_that_hangs_or_ends_its_process_is_one_problem(tmp_path, monkeypatch, name, how):
    from hybridrl.environments import checks

    monkeypatch.setattr(checks, "PROBE_TIMEOUT_S", 1.0)
    found = problems(tmp_path, ["plugins=[_env_guard_helpers]", f"environment.name={name}",
                                "environment.tools=[]", "environment.options={}", "environment.tool_parser=null"])
    assert found["environment.name"].startswith(f"environment '{name}' {how} while its first episode was built "
                                                "and reset on the longest prompt, in a process of its own"), found


def test_a_user_environment_that_resets_passes_the_probe_in_its_process(tmp_path):
    cfg = load_config(TOOL_CALC, [f"trainer.out={tmp_path / 'run'}", "plugins=[_env_guard_helpers]",
                                  "environment.name=user_echo", "environment.tools=[]", "environment.options={}",
                                  "environment.tool_parser=null"])
    assert prepare_run(cfg, get_registry(tuple(cfg.plugins)), CPU2).cfg.environment.name == "user_echo"
