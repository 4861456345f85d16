"""A third-party package adds an advantage estimator and an algorithm preset through its entry point, and a
training run selects them from config (CLI, Ray, 2 steps)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = Path(__file__).parent / "sample_plugin"
QUICKSTART = ROOT / "examples" / "quickstart.yaml"
SMALL = ["trainer.steps=2", "data.prompts_per_step=4", "algorithm.n_samples=4", "trainer.progress=false",
         "trainer.trackers=[jsonl]"]


@pytest.fixture(scope="module")
def sample_site(tmp_path_factory) -> Path:
    """The sample third-party package, pip-installed into a folder of its own (not into the environment)."""
    site = tmp_path_factory.mktemp("algo-site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(SAMPLE)], check=True)
    return site


def cli(site: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "hybridrl.cli", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=timeout)


def test_plugin_estimator_and_preset_are_listed(sample_site):
    out = cli(sample_site, "plugins")
    assert out.returncode == 0, out.stderr
    line = next(line for line in out.stdout.splitlines() if line.startswith("sample "))
    assert "advantage:sample_batch_mean" in line and "algorithm:sample_reinforce" in line


def test_unknown_estimator_fails_before_work_and_names_the_plugin_one(sample_site, tmp_path):
    out = cli(sample_site, "plan", str(QUICKSTART), "algorithm.advantage=sample_batch_maen", "--cluster", "1x1",
              "--device", "cpu")
    assert out.returncode == 2 and "algorithm.advantage" in out.stderr and "sample_batch_mean" in out.stderr


def test_plugin_preset_resolves_in_a_fresh_process(sample_site):
    code = ("from hybridrl.algorithms.objective import resolve_algorithm; from hybridrl.config import AlgorithmConfig; "
            "from hybridrl.plugins.discovery import get_registry; "
            "a = resolve_algorithm(AlgorithmConfig(name='sample_reinforce'), get_registry()); "
            "print(a.advantage, a.loss_agg)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(sample_site), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["sample_batch_mean", "seq-mean-token-mean"]


def test_training_steps_with_the_plugin_estimator(sample_site, tmp_path):
    out = tmp_path / "run"
    # The reverse reward is 0 for every sample of the untrained model (no advantage, no gradient): a reward that
    # differs between samples makes the plugin estimator's advantages, and so the update, non-zero.
    proc = cli(sample_site, "train", str(QUICKSTART), *SMALL, "algorithm.advantage=sample_batch_mean",
               "roles.reward.fn=sample_digit_share", f"trainer.out={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["actor/grad_norm"] > 0 for r in rows)
    assert json.loads((out / "config.json").read_text())["algorithm"]["advantage"] == "sample_batch_mean"
