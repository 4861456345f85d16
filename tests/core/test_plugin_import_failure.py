"""An installed plugin whose entry point raises on import: listed by ``hybridrl plugins`` with its error, skipped
by runs that do not use it (one warning), and named in the pre-flight error of a run that asks for its backend.
The plugin is a real distribution (a ``.dist-info`` with ``entry_points.txt`` on the path), as pip leaves one."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridrl.plugins.discovery import build_registry, describe_plugins, plugin_manager
from hybridrl.plugins.registry import RegistryError

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"
ERROR = "No module named 'frobnicate_engine_xyz'"


@pytest.fixture(scope="module")
def broken_site(tmp_path_factory) -> Path:
    """A folder holding the package ``hybridrl_broken`` (its import fails) and its distribution's metadata."""
    site = tmp_path_factory.mktemp("broken_site")
    package = site / "hybridrl_broken"
    package.mkdir()
    (package / "__init__.py").write_text("import frobnicate_engine_xyz  # a dependency that is not installed\n")
    info = site / "hybridrl_broken-0.9.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hybridrl-broken\nVersion: 0.9\n")
    (info / "entry_points.txt").write_text("[hybridrl]\nbroken = hybridrl_broken\n")
    return site


@pytest.fixture
def on_path(broken_site: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.syspath_prepend(str(broken_site))
    importlib.invalidate_caches()
    return broken_site


def _run(site: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "hybridrl.cli", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)


def test_a_plugin_that_fails_to_import_is_skipped_and_recorded(on_path: Path) -> None:
    registry = build_registry(plugin_manager())  # before: the ImportError escaped from here
    [failed] = [f for f in registry.failed_plugins if f.distribution == "hybridrl-broken"]
    assert failed.entry_point == "broken" and failed.version == "0.9" and ERROR in failed.error
    assert registry.backend("rollout", "hf").plugin == "hybridrl.rollout.plugin"  # the others are all there
    with pytest.raises(RegistryError, match="unknown rollout backend 'brokenroll'") as info:
        registry.backend("rollout", "brokenroll")
    assert "hybridrl-broken" in str(info.value) and ERROR in str(info.value)
    row = next(r for r in describe_plugins() if r.distribution == "hybridrl-broken")
    assert row.name == "broken" and ERROR in (row.error or "") and row.registers == []


def test_cli_lists_it_and_runs_without_it(broken_site: Path) -> None:
    listed = _run(broken_site, "plugins")
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if line.startswith("broken "))
    assert "hybridrl-broken" in row and "0.9" in row and "FAILED TO IMPORT" in row and ERROR in row
    assert "Traceback" not in listed.stderr
    planned = _run(broken_site, "plan", str(QUICKSTART), "--cluster", "1x2", "--device", "cpu")
    assert planned.returncode == 0, planned.stderr
    warnings = [line for line in planned.stdout.splitlines() if "hybridrl-broken" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: ") and ERROR in warnings[0]


def test_a_run_naming_its_backend_is_refused_in_preflight(broken_site: Path, tmp_path: Path) -> None:
    refused = _run(broken_site, "train", str(QUICKSTART), "roles.rollout.backend=brokenroll",
                   f"trainer.out={tmp_path / 'run'}")
    assert refused.returncode == 2, refused.stderr
    assert "roles.rollout.backend" in refused.stderr and "hybridrl-broken" in refused.stderr
    assert ERROR in refused.stderr and "Traceback" not in refused.stderr
    assert not (tmp_path / "run").exists()
