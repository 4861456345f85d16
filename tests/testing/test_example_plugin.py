"""The example rollout plugin (examples/plugin) as a third party ships it: pip-installed into a folder of its
own, found through its entry point, passing the kit by name, and training the quick start."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "plugin"
QUICKSTART = ROOT / "examples" / "quickstart.yaml"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``pip install --target`` of a copy (an in-tree build would leave build/ and egg-info in the repo)."""
    source = tmp_path_factory.mktemp("example-src") / "plugin"
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    target = tmp_path_factory.mktemp("example-site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(source)], check=True)
    return target


def _env(site: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "HYBRIDRL_PLUGINS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    return env


def _only_capability_skips(stdout: str) -> None:
    """Skipped: only the checks of capabilities the example does not declare, and CUDA-only ones on a CPU."""
    for line in stdout.splitlines():
        if line.startswith("SKIPPED"):
            assert "does not declare the" in line or "only on CUDA" in line, line


def test_example_plugin_is_discovered(site: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "hybridrl.cli", "plugins"], capture_output=True, text=True,
                         env=_env(site), cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    line = next(line for line in out.stdout.splitlines() if line.startswith("example "))
    assert "hybridrl-example-rollout" in line and "rollout:example (engine available)" in line


def test_example_plugin_passes_the_kit(site: Path, tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "pytest", "--hybridrl-backend=example", "-q", "-rs", "-p",
                          "no:cacheprovider",
                          f"--basetemp={tmp_path / 'kit'}"], capture_output=True, text=True, env=_env(site),
                         cwd=tmp_path, timeout=600)
    tail = out.stdout[-3000:]
    assert out.returncode == 0, tail
    summary = out.stdout.strip().splitlines()[-1]
    assert "failed" not in summary and "error" not in summary, summary
    _only_capability_skips(out.stdout)
    passed = int(summary.split(" passed")[0].split()[-1])
    assert passed >= 18, summary  # the whole rollout battery and the fsdp -> example bridge ran


def test_example_plugin_trains_the_quick_start(site: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "hybridrl.cli", "train", str(QUICKSTART),
                          "roles.rollout.backend=example",
                          "trainer.steps=2", f"trainer.out={run}", "data.prompts_per_step=4", "algorithm.n_samples=4",
                          "trainer.progress=false",
                          "roles.rollout.log_probs=true"],  # auto leaves them off; rollout/logp_diff needs them
                         capture_output=True, text=True, env=_env(site), cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "rollout[example] rank 0/1" in out.stdout
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert 0.0 <= row["reward/mean"] <= 1.0 and row["response_length/mean"] > 0
        assert row["rollout/logp_diff"] < 1e-3  # the example's log-probs agree with the FSDP actor's


def test_example_train_engine_passes_the_kit(site: Path, tmp_path: Path) -> None:
    """The plain-PyTorch train engine beside the rollout: the whole train battery, bridged into ``hf``."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--hybridrl-backend=example_train", "-q", "-rs", "-p",
                          "no:cacheprovider", f"--basetemp={tmp_path / 'kit'}"], capture_output=True, text=True,
                         env=_env(site), cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:]
    summary = out.stdout.strip().splitlines()[-1]
    assert "failed" not in summary and "error" not in summary, summary
    _only_capability_skips(out.stdout)
    assert int(summary.split(" passed")[0].split()[-1]) >= 10, summary  # every train check and the bridge ran


def test_a_one_rank_engine_is_refused_a_pool_of_two(site: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "hybridrl.cli", "plan", str(QUICKSTART), "--cluster", "1x2",
                          "roles.actor.backend=example_train", "roles.ref.backend=example_train",
                          "pools.main.devices_per_node=2"], capture_output=True, text=True, env=_env(site),
                         cwd=ROOT, timeout=300)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "example_train" in out.stderr and "at most 1 rank" in out.stderr, out.stderr[-2000:]
