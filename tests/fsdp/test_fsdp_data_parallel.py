"""Headline: two gloo ranks, one FSDP rank and plain PyTorch reach the same weights after the same updates."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from _fsdp_worker import GLOBAL_BATCH, OPTIONS, STEPS, global_batch

from hybridrl.engines.batch import ADVANTAGES, RESPONSE_MASK, sequence_tensors
from hybridrl.runtime.distributed import free_port

WORKER = Path(__file__).with_name("_fsdp_worker.py")
ATOL = 1e-5


def launch(world_size: int, model: Path, out: Path) -> list[subprocess.Popen]:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return [subprocess.Popen([sys.executable, str(WORKER), str(rank), str(world_size), str(port), str(model), str(out)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for rank in range(world_size)]


def wait(procs: list[subprocess.Popen], timeout: float = 180) -> None:
    try:
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {rank} failed:\n{log}"


def plain_reference(model_path: Path) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The same training written directly: unsharded HF model, full logits, AdamW, micro-batched gradients."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=OPTIONS["lr"], betas=(0.9, 0.999), weight_decay=0.0)
    batch = global_batch()
    total_tokens = float(batch[RESPONSE_MASK].sum())
    norms = []
    for _ in range(STEPS):
        opt.zero_grad()
        for start in range(0, GLOBAL_BATCH, OPTIONS["micro_batch"]):
            micro = batch.index(range(start, start + OPTIONS["micro_batch"]))
            ids, mask, _ = sequence_tensors(micro)
            pos = (mask.cumsum(1) - 1).clamp(min=0)
            r = micro[RESPONSE_MASK].shape[1]
            p = ids.shape[1] - r
            logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, p - 1: p + r - 1]
            lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, p:, None]).squeeze(-1)
            loss = -(lp * micro[ADVANTAGES] * micro[RESPONSE_MASK]).sum() / total_tokens
            loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIONS["grad_clip"])))
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def test_two_ranks_match_one_process(tiny_model: Path, tmp_path: Path) -> None:
    from hybridrl_fsdp.micro_batching import plan_micro_batches

    shares = [m.packed.shared is not None for half in global_batch().chunk(2)
              for m in plan_micro_batches(half, OPTIONS["micro_batch"], None, packed=True, share_prompts=True)]
    assert any(shares) and not all(shares), "some micro-batches hold a prompt once, others repeat none"
    one, two = tmp_path / "world1.pt", tmp_path / "world2.pt"
    procs = launch(1, tiny_model, one) + launch(2, tiny_model, two)
    reference, ref_norms = plain_reference(tiny_model)
    wait(procs)
    single = torch.load(f"{one}.rank0")
    dual, dual_1 = torch.load(f"{two}.rank0"), torch.load(f"{two}.rank1")

    initial = {n: p for n, p in _initial_weights(tiny_model).items()}
    assert set(single["state"]) == set(dual["state"]) == set(reference)
    moved = max(float((reference[n] - initial[n]).abs().max()) for n in reference)
    assert moved > 100 * ATOL, "the updates must move the weights far beyond the tolerance"
    for name in reference:
        torch.testing.assert_close(single["state"][name], reference[name], atol=ATOL, rtol=0, msg=name)
        torch.testing.assert_close(dual["state"][name], single["state"][name], atol=ATOL, rtol=0, msg=name)

    for name, tensor in dual_1["state"].items():  # every rank ends with the same full weights
        torch.testing.assert_close(tensor, dual["state"][name], atol=0, rtol=0)
    for result in (single, dual, dual_1):  # the collective bucketed export equals the full state dict
        assert result["exported"].keys() == result["state"].keys()
        for name, tensor in result["exported"].items():
            torch.testing.assert_close(tensor, result["state"][name], atol=0, rtol=0)
    # the sharded forward of the trained model: each rank's half equals the single process's rows
    torch.testing.assert_close(torch.cat([dual["log_probs"], dual_1["log_probs"]]), single["log_probs"],
                               atol=ATOL, rtol=0)

    for m1, m2, ref_norm in zip(single["metrics"], dual["metrics"], ref_norms):
        assert m1["skipped_step"] == m2["skipped_step"] == 0.0
        assert abs(m1["grad_norm"] - ref_norm) < 1e-4 * max(1.0, ref_norm)
        assert abs(m2["grad_norm"] - ref_norm) < 1e-4 * max(1.0, ref_norm)
        assert abs(m1["loss"] - m2["loss"]) < 1e-5
    assert single["metrics"][-1]["loss"] < single["metrics"][0]["loss"]


def _initial_weights(model_path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return {n: p.detach().clone() for n, p in model.named_parameters()}
