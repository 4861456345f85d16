"""Issue 24's "done when": a GSM8K parquet in verl's schema (the committed fixture) trains with a checkpoint
whose tokenizer carries a real chat template (a Qwen2.5-Instruct-style tokenizer folder), through
``hybridrl train`` from a YAML of at most 15 lines and no code; it validates on the val fixture, keeps the best
checkpoint, and ``hybridrl report`` shows the validation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "data"

CONFIG = """\
model: {{path: {model}}}
data:
  train: tests/fixtures/data/verl_gsm8k_train.parquet
  val: tests/fixtures/data/verl_gsm8k_val.parquet
  prompts_per_step: 4
algorithm: {{n_samples: 4}}
roles:
  rollout: {{max_new_tokens: 8}}
  reward: {{by_source: {{openai/gsm8k: gsm8k}}}}
trainer: {{steps: 2, out: {out}, val_every: 1, keep_best: val/reward/mean}}
"""


def qwen_style_checkpoint(folder: Path) -> Path:
    """A small random Qwen2 whose tokenizer is the fixture's Qwen2.5-style one (ChatML template, <|im_end|>
    as EOS), saved as an ordinary HF checkpoint folder, as a user's model.path would be."""
    from hybridrl.config import TinyModelConfig
    from hybridrl.model.tiny import build_tiny_model

    cfg = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                          max_position=512, tokenizer=str(FIXTURES / "qwen2_tokenizer"))
    return build_tiny_model(cfg, folder)


def test_verl_gsm8k_parquet_trains_from_a_short_yaml(tmp_path):
    model = qwen_style_checkpoint(tmp_path / "qwen-style")
    out = tmp_path / "run"
    config = tmp_path / "gsm8k.yaml"
    config.write_text(CONFIG.format(model=model, out=out))
    assert len(config.read_text().splitlines()) <= 15
    proc = subprocess.run([sys.executable, "-m", "hybridrl.cli", "train", str(config)], capture_output=True,
                          text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]  # step 0: the validation before training
    for row in rows:
        assert 0.0 <= row["val/reward/mean"] <= 1.0 and "val/openai/gsm8k/pass@1" in row
    for row in rows[1:]:
        assert row["reward/errors"] == 0 and 0.0 <= row["reward/openai/gsm8k/mean"] <= 1.0
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples[0]["prompt"].startswith("<|im_start|>system\nYou are Qwen")  # the checkpoint's template
    assert samples[0]["prompt"].endswith("<|im_start|>assistant\n")
    best = json.loads((out / "best" / "best.json").read_text())
    assert best["metric"] == "val/reward/mean" and best["step"] in (1, 2)
    assert Path(best["checkpoint"]).is_dir()

    exported = subprocess.run([sys.executable, "-m", "hybridrl.cli", "export", str(out / "best"), "--out",
                               str(tmp_path / "best-model")], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert (tmp_path / "best-model" / "config.json").is_file()
    assert (tmp_path / "best-model" / "tokenizer_config.json").is_file()

    report = subprocess.run([sys.executable, "-m", "hybridrl.cli", "report", str(out)], capture_output=True,
                            text=True, cwd=ROOT, timeout=300)
    assert report.returncode == 0, report.stderr[-2000:]
    summary = (out / "report" / "summary.md").read_text()
    assert "## Validation" in summary and "| val/reward/mean |" in summary
