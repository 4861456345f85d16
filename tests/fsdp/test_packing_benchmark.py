"""``benchmarks/packing_step.py``: the ragged workload it builds, and its packed and padded variants computing the
same numbers (on CPU in fp32; on a GPU in bf16 through the varlen flash kernel, with MFU per phase)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "packing_step.py"
sys.path.insert(0, str(SCRIPT.parent))


def test_ragged_batch_draws_lengths_in_range_and_ends_each_response_in_eos() -> None:
    from packing_step import ragged_batch

    from hybridrl.engines.batch import PROMPT_MASK, RESPONSE_IDS, RESPONSE_MASK

    eos, pad = 2, 0
    batch = ragged_batch(64, 8, 16, 1024, vocab=500, eos=eos, pad=pad, seed=3)
    lengths = batch[RESPONSE_MASK].sum(1)
    assert int(lengths.min()) >= 16 and int(lengths.max()) <= 1024
    assert float(lengths.float().std()) > 100, "lengths must vary across the range, not cluster"
    ids, mask = batch[RESPONSE_IDS], batch[RESPONSE_MASK].bool()
    assert torch.equal(ids[torch.arange(64), lengths - 1], torch.full((64,), eos))
    assert not ((ids == eos) & mask).sum(1).gt(1).any(), "EOS appears only where the response ends"
    assert bool((ids[~mask] == pad).all()) and bool(batch[PROMPT_MASK].bool().all())
    fixed = ragged_batch(4, 8, 16, 32, vocab=500, eos=eos, pad=pad, fixed=True)
    assert fixed[RESPONSE_MASK].sum(1).tolist() == [32] * 4
    grouped = ragged_batch(10, 8, 16, 32, vocab=500, eos=eos, pad=pad, samples=4)
    prompts = grouped["prompt_ids"]
    assert all(torch.equal(prompts[i], prompts[i - i % 4]) for i in range(10))
    assert not torch.equal(prompts[0], prompts[4]) and not torch.equal(prompts[4], prompts[8])
    with pytest.raises(ValueError, match="response lengths"):
        ragged_batch(4, 8, 0, 32, vocab=500, eos=eos, pad=pad)


def run_benchmark(tmp_path: Path, device: str, *extra: str) -> dict:
    out = tmp_path / "packing.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--size", "tiny", "--device", device, "--rows", "12",
                           "--prompt-len", "8", "--min-response", "2", "--max-response", "40", "--token-budget",
                           "256", "--repeats", "1", "--variants", "packed,shared,padded,padded_sorted",
                           "--workdir", str(tmp_path / "models"), "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


def check_result(result: dict, tolerance: float) -> None:
    variants = result["variants"]
    assert set(variants) == {"packed", "shared", "padded", "padded_sorted"}
    assert variants["packed"]["options"]["packing"] is True and variants["padded"]["options"]["packing"] is False
    assert variants["shared"]["options"]["share_prompts"] is True
    assert variants["packed"]["options"]["share_prompts"] is False
    work = result["workload"]
    assert work["real_tokens"] < work["padded_tokens"], "a ragged batch has padding to save"
    for name, v in variants.items():
        assert v["ref_log_probs_max_abs_diff_vs_first_variant"] <= tolerance, name
        assert v["train_tokens_per_s"] == pytest.approx(work["real_tokens"] / v["median_s"]["update_actor"])
        assert v["perf"]["perf/tflops_per_device/update_actor"] > 0
        assert v["last_update_metrics"]["skipped_step"] == 0.0
    assert result["train_tokens_per_s_over_padded"]["padded"] == pytest.approx(1.0)


def test_packed_and_padded_variants_compute_the_same_log_probs_on_cpu(tmp_path: Path) -> None:
    result = run_benchmark(tmp_path, "cpu")
    check_result(result, tolerance=1e-4)
    assert result["peak_flops"] is None  # no MFU without a known device peak


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_packed_and_padded_variants_on_a_gpu_report_mfu_per_phase(tmp_path: Path) -> None:
    """bf16: the packed path runs the varlen flash kernel, the padded one sdpa with a mask; the log-probs agree
    to bf16's precision, and with a known device peak (an H200's) every phase has its MFU."""
    result = run_benchmark(tmp_path, "cuda")
    check_result(result, tolerance=0.1)
    if result["peak_flops"]:
        for v in result["variants"].values():
            assert 0 < v["perf"]["perf/mfu/update_actor"] < 1 and 0 < v["perf"]["perf/mfu/ref"] < 1
            assert v["peak_allocated_mb"] > 0
