"""Secrets stay secret: header values and credential-named keys are redacted in ``config.json`` and in what
trackers receive, ``${ENV_VAR}`` is read from the environment (a missing one names its key and variable), and a
run's files are its owner's only (0600 files, 0700 folders), whatever the umask."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from hybridrl.config import ConfigError, load_config
from hybridrl.config.secrets import REDACTED, redacted
from hybridrl.observe.tracking import build_trackers
from hybridrl.plugins.registry import Registry
from hybridrl.run import checkpoint as ckpt
from hybridrl.run.file_modes import write_config

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"
TOKEN = "s3cr3t-bearer-9f8e7d"
HEADER = "roles.reward.http.headers.Authorization"


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def loose_umask():
    """The usual umask (group and others may read): the run's files must be private all the same."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_redacted_hides_headers_and_credential_keys_only() -> None:
    data = {"roles": {"reward": {"url": "https://me:hunter2@score.example/v1",
                                 "http": {"headers": {"Authorization": f"Bearer {TOKEN}", "X-Trace": "keep?",
                                                      "X-Ref": "${TRACE_ID}"}}},
                      "rollout": {"max_new_tokens": 64, "options": {"hf_token": TOKEN, "api_key": TOKEN}}},
            "data": {"pad_token_id": 0, "tokenizer": "tok"}, "trackers": [{"client_secret": TOKEN}]}
    out = redacted(data)
    assert TOKEN not in json.dumps(out) and "hunter2" not in json.dumps(out)
    headers = out["roles"]["reward"]["http"]["headers"]
    assert headers == {"Authorization": REDACTED, "X-Trace": REDACTED, "X-Ref": "${TRACE_ID}"}
    assert out["roles"]["reward"]["url"] == f"https://me:{REDACTED}@score.example/v1"
    assert out["roles"]["rollout"]["max_new_tokens"] == 64 and out["data"] == data["data"]  # not credentials
    assert data["roles"]["rollout"]["options"]["hf_token"] == TOKEN  # a copy: the run keeps the real value


def test_a_run_folders_config_of_an_moe_model_loads_again(tmp_path: Path) -> None:
    """``experts_per_token: 2`` ends in "token" but is a number, not a credential: redacting it made the run's
    ``config.json`` unloadable (``hybridrl plan RUN/config.json``, a profile's config)."""
    from hybridrl.config import load_config

    cfg = load_config(ROOT / "examples" / "quickstart-moe.yaml", [])
    out = redacted(cfg.model_dump(mode="json"))
    assert out["model"]["tiny"]["experts_per_token"] == 2
    path = tmp_path / "config.json"
    path.write_text(json.dumps(out))
    assert load_config(path, []).model.tiny.experts_per_token == 2


def test_env_references_are_read_at_load_and_a_missing_one_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDRL_TEST_TOKEN", TOKEN)
    cfg = load_config(QUICKSTART, ["roles.reward.url=http://127.0.0.1:9/score",
                                   f"{HEADER}=Bearer ${{HYBRIDRL_TEST_TOKEN}}"])
    assert cfg.roles.reward.http.headers["Authorization"] == f"Bearer {TOKEN}"  # what the reward client sends
    monkeypatch.delenv("HYBRIDRL_TEST_TOKEN")
    with pytest.raises(ConfigError) as info:
        load_config(QUICKSTART, [f"{HEADER}=Bearer ${{HYBRIDRL_TEST_TOKEN}}"])
    assert info.value.problems == [(HEADER, "environment variable HYBRIDRL_TEST_TOKEN is not set "
                                            "(the value is 'Bearer ${HYBRIDRL_TEST_TOKEN}')")]


def test_config_json_is_redacted_and_private(tmp_path: Path, loose_umask) -> None:
    cfg = load_config(QUICKSTART, ["roles.reward.url=http://127.0.0.1:9/score", f"{HEADER}=Bearer {TOKEN}"])
    path = tmp_path / "config.json"
    path.write_text("{}")
    os.chmod(path, 0o644)  # written by an older run: made private when rewritten
    write_config(path, cfg.model_dump(mode="json", by_alias=True))
    text = path.read_text()
    assert TOKEN not in text and json.loads(text)["roles"]["reward"]["http"]["headers"]["Authorization"] == REDACTED
    assert mode(path) == 0o600


def test_trackers_get_the_redacted_config_and_metrics_are_private(tmp_path: Path, loose_umask) -> None:
    seen = {}

    class Recorder:
        def __init__(self, out_dir: str, config: dict) -> None:
            seen.update(config)

    registry = Registry()
    registry.add_tracker("recorder", Recorder)
    from hybridrl.observe.tracking import JsonlTracker

    registry.add_tracker("jsonl", JsonlTracker)
    out = tmp_path / "run"
    trackers = build_trackers(registry, ["recorder", "jsonl"], str(out),
                              {"roles": {"reward": {"http": {"headers": {"Authorization": TOKEN}}}}}, resume=False)
    assert seen["roles"]["reward"]["http"]["headers"]["Authorization"] == REDACTED
    trackers[1].log({"reward/mean": 0.5}, 1)
    trackers[1].close()
    assert mode(out / "metrics.jsonl") == 0o600 and mode(out) == 0o700


def test_checkpoint_files_are_private_whatever_the_workers_umask(tmp_path: Path, loose_umask) -> None:
    def write(tmp: Path) -> dict:
        (tmp / "actor" / "dcp").mkdir(parents=True)  # what a worker writes under its own umask
        (tmp / "actor" / "dcp" / "__0_0.distcp").write_bytes(b"x" * 8)
        ckpt.save_driver_state(tmp, {"step": 1})
        return {}

    folder = ckpt.save_checkpoint(tmp_path, 1, write, keep=0)
    for path in [ckpt.checkpoints_root(tmp_path), *ckpt.checkpoints_root(tmp_path).rglob("*")]:
        assert mode(path) == (0o700 if path.is_dir() else 0o600), path
    assert ckpt.damage(folder) is None  # modes are set before the manifest is taken


def test_train_with_a_missing_variable_stops_before_anything(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "HYBRIDRL_TEST_TOKEN"}
    proc = subprocess.run([sys.executable, "-m", "hybridrl.cli", "train", str(QUICKSTART),
                           f"trainer.out={tmp_path / 'run'}", "roles.reward.url=http://127.0.0.1:9/score",
                           f"{HEADER}=Bearer ${{HYBRIDRL_TEST_TOKEN}}"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    assert f"{HEADER}: environment variable HYBRIDRL_TEST_TOKEN is not set" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()
