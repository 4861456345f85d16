"""Trackers write what each tool's own reader reads back: TensorBoard events through TensorBoard's
EventAccumulator, the W&B offline run file through W&B's protobuf records, MLflow through its client."""

from __future__ import annotations

import json
import math
import struct
import sys
import time
from pathlib import Path

import pytest

from hybridrl.observe.tracking import MlflowTracker, TensorBoardTracker, WandbTracker, flatten
from hybridrl.plugins.discovery import get_registry

CONFIG = {"model": {"tiny": {"hidden_size": 32}, "dtype": "float32"}, "trainer": {"trackers": ["console", "jsonl"]},
          "algorithm": {"name": "grpo", "kl": None}}
STEPS = {1: {"reward/mean": 0.25, "timing/step": 1.5, "actor/kl_loss": float("nan"), "note": "text"},
         2: {"reward/mean": 0.5, "timing/step": 1.25, "actor/kl_loss": 0.01, "note": "text"},
         3: {"reward/mean": 0.75, "timing/step": 1.0, "actor/kl_loss": 0.02, "note": "text"}}


def log_all(tracker) -> None:
    for step, metrics in STEPS.items():
        tracker.log(metrics, step)
    tracker.close()


def expected(key: str) -> list[tuple[int, float]]:
    return [(s, m[key]) for s, m in STEPS.items() if isinstance(m[key], float) and math.isfinite(m[key])]


def test_every_tracker_is_registered_through_the_hook():
    assert {"console", "jsonl", "tensorboard", "wandb", "mlflow"} <= set(get_registry().names("tracker"))


def test_tensorboard_events_parse_with_tensorboards_reader(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_all(TensorBoardTracker(str(tmp_path), CONFIG))
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"reward/mean", "timing/step", "actor/kl_loss"}  # flat names, no text
    for key in ("reward/mean", "timing/step", "actor/kl_loss"):
        got = [(e.step, e.value) for e in acc.Scalars(key)]
        assert got == [(s, pytest.approx(v)) for s, v in expected(key)]  # NaN left out, step is the x-axis
    (text,) = acc.Tensors("config/text_summary")
    logged = text.tensor_proto.string_val[0].decode()
    assert json.loads("\n".join(line[4:] for line in logged.splitlines())) == CONFIG  # the config, once


def wandb_records(path: Path) -> list:
    """The protobuf records of an offline W&B run file (a LevelDB-style log: 7-byte file header, 32 KiB
    blocks, each chunk ``crc32 (4) | length (2) | type (1)``, types 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the tail of a block too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if pos + 7 + length > len(data):  # a chunk still being written
            break
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            out.append(chunk)
        elif kind in (2, 3):
            pending = (b"" if kind == 2 else pending) + chunk
        elif kind == 4:
            out.append(pending + chunk)
    records = []
    for raw in out:
        record = pb.Record()
        record.ParseFromString(raw)
        records.append(record)
    return records


def finished_wandb_records(path: Path, timeout_s: float = 30.0) -> list:
    """The run file's records once its exit record is there: ``run.finish()`` can return while W&B's
    service is still writing the file (seen: 7 bytes, only the header, then the whole run 10 ms later)."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = wandb_records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.05)


def test_wandb_offline_run_holds_the_metrics_and_config(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    log_all(WandbTracker(str(tmp_path), CONFIG))
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    history, config = {}, {}
    for record in finished_wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
            history[record.history.step.num] = items
        elif kind in ("run", "config"):  # the config comes with the run record (and any later update)
            updates = record.run.config.update if kind == "run" else record.config.update
            config.update({i.key: json.loads(i.value_json) for i in updates})
    for key in ("reward/mean", "timing/step", "actor/kl_loss"):
        got = [(s, history[s][key]) for s in sorted(history) if key in history[s]]
        assert got == expected(key)
    assert not any("note" in items for items in history.values())
    assert {k: config[k] for k in CONFIG} == CONFIG
    assert (tmp_path / "wandb_run_id").read_text().strip()


def test_mlflow_file_store_holds_the_metrics_and_config(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="mlflow is not installed here (pip install mlflow-skinny)")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    log_all(MlflowTracker(str(tmp_path), CONFIG))
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    run_id = (tmp_path / "mlflow_run_id").read_text().strip()
    for key in ("reward/mean", "timing/step", "actor/kl_loss"):
        got = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        assert got == [(s, pytest.approx(v)) for s, v in expected(key)]
    run = client.get_run(run_id)
    assert run.data.params == flatten(CONFIG)
    assert run.info.status == "FINISHED"
    # a resumed run continues the same MLflow run
    tracker = MlflowTracker(str(tmp_path), CONFIG, resume=True)
    tracker.log({"reward/mean": 1.0}, 4)
    tracker.close()
    assert [m.step for m in client.get_metric_history(run_id, "reward/mean")][-1] == 4


@pytest.mark.parametrize("cls, module, install", [(WandbTracker, "wandb", "wandb"),
                                                   (MlflowTracker, "mlflow", "mlflow-skinny")])
def test_a_missing_package_is_named_in_the_error(cls, module, install, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)  # makes ``import module`` raise ImportError
    with pytest.raises(ImportError, match=f"needs the '{module}' package.*pip install {install}"):
        cls(str(tmp_path), CONFIG)


def test_flatten_keeps_every_leaf():
    assert flatten({"a": {"b": 1, "c": [1, 2]}, "d": "x", "e": None, "f": {}}) == \
        {"a.b": "1", "a.c": "[1, 2]", "d": "x", "e": "null", "f": "{}"}
