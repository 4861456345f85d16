"""Plugin discovery through entry points, the registry, and the engine-missing path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridrl.config import load_config
from hybridrl.placement.plan import ClusterSpec
from hybridrl.plugins.discovery import build_registry, describe_plugins, plugin_manager
from hybridrl.plugins.registry import Registry, RegistryError, check_requirement
from hybridrl.run.preflight import check_config

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = Path(__file__).parent / "sample_plugin"
QUICKSTART = ROOT / "examples" / "quickstart.yaml"


def test_core_defaults_register_through_the_hooks():
    rows = {r.name: r for r in describe_plugins()}
    assert "rollout:hf" in rows["hybridrl.rollout.plugin"].registers
    assert "train:fsdp" in rows["fsdp"].registers
    assert rows["fsdp"].distribution == "hybridrl-fsdp"
    assert "advantage:grpo" in rows["hybridrl.algorithms.plugin"].registers


def test_missing_engine_is_reported_with_hint_and_refused_on_load():
    registry = build_registry(plugin_manager())
    entry = registry.backend("rollout", "sglang")
    problem = entry.engine_problem()
    assert problem is not None and "engine missing" in problem and "pip install" in problem
    with pytest.raises(RegistryError, match="sglang"):
        entry.load()


def test_choosing_a_backend_whose_engine_is_missing_fails_before_work():
    cfg = load_config(QUICKSTART, ["roles.rollout.backend=sglang"])
    _, _, problems = check_config(cfg, build_registry(plugin_manager()), ClusterSpec(1, 1, "cuda"))
    keys = [k for k, _ in problems]
    assert "roles.rollout.backend" in keys
    assert any("engine missing" in reason and "pip install" in reason for _, reason in problems)


def test_duplicate_registration_names_both_plugins():
    reg = Registry()
    reg.current_plugin = "a"
    reg.add_reward("x", len)
    reg.current_plugin = "b"
    with pytest.raises(RegistryError, match="by a and b"):
        reg.add_reward("x", len)


@pytest.mark.parametrize("cost", [0.5, "fast", -1])
def test_a_rollouts_log_prob_cost_is_a_factor_of_at_least_one(cost):
    reg = Registry()
    reg.current_plugin = "mine"
    with pytest.raises(RegistryError, match="log_prob_cost must be a number >= 1.*plugin mine"):
        reg.add_rollout("r", "m:R", log_prob_cost=cost)
    reg.add_rollout("r", "m:R", log_prob_cost=1.3)
    assert reg.backend("rollout", "r").log_prob_cost == 1.3


def test_check_requirement_versions():
    assert check_requirement("torch>=2.0") is None
    assert "required" in check_requirement("torch>=999")
    assert "not installed" in check_requirement("surely_not_installed_pkg>=1")


def test_bridge_lookup_prefers_the_specific_pair():
    reg = Registry()
    reg.add_bridge("*", "*", "in_process", "general")
    reg.add_bridge("megatron", "vllm", "in_process", "special")
    assert reg.bridge("megatron", "vllm", "in_process").target == "special"
    assert reg.bridge("fsdp", "vllm", "in_process").target == "general"
    with pytest.raises(RegistryError, match="no reshard bridge"):
        reg.bridge("fsdp", "vllm", "carrier_pigeon")


@pytest.fixture(scope="module")
def sample_site(tmp_path_factory) -> Path:
    """The sample third-party package, pip-installed into a folder of its own."""
    site = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(SAMPLE)], check=True)
    return site


def _run(site: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "hybridrl.cli", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT)


def test_pip_installed_third_party_plugin_is_discovered(sample_site):
    out = _run(sample_site, "plugins")
    assert out.returncode == 0, out.stderr
    line = next(line for line in out.stdout.splitlines() if line.startswith("sample "))
    assert "hybridrl-sample" in line and "0.3.1" in line
    assert "rollout:sample (engine available)" in line
    assert "rollout:sample_missing (installed, engine missing" in line and "pip install not-a-real-engine" in line


def test_third_party_plugin_is_selected_from_config(sample_site):
    out = _run(sample_site, "plan", str(QUICKSTART), "roles.rollout.backend=sample", "roles.reward.fn=sample_length",
               "algorithm.kl.estimator=sample_half_k1", "--cluster", "1x2", "--device", "cpu")
    assert out.returncode == 0, out.stderr
    assert "rollout[sample]" in out.stdout
    # a plan reads only what the plugin registered: a missing engine is a warning there ...
    missing = _run(sample_site, "plan", str(QUICKSTART), "roles.rollout.backend=sample_missing", "--cluster", "1x2",
                   "--device", "cpu")
    assert missing.returncode == 0, missing.stderr
    warning = next(line for line in missing.stdout.splitlines() if line.startswith("WARNING: roles.rollout.backend"))
    assert "pip install not-a-real-engine" in warning and "hybridrl train on this machine would refuse it" in warning
    # ... and an error before any process starts in train
    refused = _run(sample_site, "train", str(QUICKSTART), "roles.rollout.backend=sample_missing")
    assert refused.returncode == 2
    assert "roles.rollout.backend" in refused.stderr and "pip install not-a-real-engine" in refused.stderr


def test_the_core_defaults_need_no_installed_entry_points(monkeypatch):
    """A source checkout that is not pip-installed still has the hf rollout, the rewards and the bridges: the
    host registers its defaults directly, through the same hooks."""
    import pluggy

    monkeypatch.setattr(pluggy.PluginManager, "load_setuptools_entrypoints", lambda self, group, name=None: 0)
    registry = build_registry(plugin_manager())
    assert registry.backend("rollout", "hf").plugin == "hybridrl.rollout.plugin"
    assert "reverse" in registry.names("reward") and registry.bridge("fsdp", "hf", "in_process")


def test_a_misspelt_hook_is_an_error_naming_it(tmp_path, monkeypatch):
    from hybridrl.plugins.registry import RegistryError

    (tmp_path / "typo_plugin.py").write_text(
        "from hybridrl import hookimpl\n\n@hookimpl\ndef hybridrl_register_backend(registry):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RegistryError,
                       match=r"hybridrl_register_backend.*the hybridrl hooks: hybridrl_register_backends"):
        plugin_manager(("typo_plugin",))
