"""CUDA checks of LoRA on the FSDP engine in a fresh process (NCCL group): the frozen base kept in bf16 and the
adapters in fp32, only the adapters in AdamW, packed bf16 micro-batches (flash varlen) through the peft model,
the merged export and the adapters in bf16 on the device, the reference view being the base, and offload/onload
keeping the policy. Run as ``python _lora_cuda_worker.py PORT TMPDIR``; exits non-zero on the first failed check."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from _fsdp_cuda_worker import cuda_context, reference_log_probs  # noqa: E402
from _fsdp_helpers import PolicyGradient, make_batch, save_tiny_qwen2  # noqa: E402

from hybridrl.engines.batch import LOG_PROBS, RESPONSE_MASK  # noqa: E402
from hybridrl.lora import LoraSpec  # noqa: E402


def main(port: int, tmp: Path) -> None:
    from hybridrl.runtime.distributed import init_process_group
    from hybridrl_fsdp.engine import FSDPEngine

    init_process_group(0, 1, "127.0.0.1", port, "cuda", timeout_s=120)
    model = save_tiny_qwen2(tmp / "tiny")
    batch = make_batch(6, seed=11)
    mask = batch[RESPONSE_MASK].bool()
    base_ref = reference_log_probs(model, batch)
    spec = LoraSpec(rank=4, alpha=8.0)
    ctx = dataclasses.replace(cuda_context(model, "bfloat16", lr=5e-2, micro_batch=4, gradient_checkpointing=True),
                              lora=spec)
    actor = FSDPEngine(ctx)
    dtypes = {n: p.dtype for n, p in actor.model.named_parameters()}
    assert all(d == torch.float32 for n, d in dtypes.items() if ".lora_" in n), dtypes
    assert all(d == torch.bfloat16 for n, d in dtypes.items() if ".lora_" not in n), dtypes
    optimized = {id(p) for g in actor.optimizer.param_groups for p in g["params"]}
    assert optimized == {id(p) for n, p in actor.model.named_parameters() if ".lora_" in n}
    assert all(m.packed is not None for m in actor._plan(batch))  # packed (flash varlen) through peft

    reference = actor.reference_view(dataclasses.replace(cuda_context(model, "bfloat16", micro_batch=4), role="ref"))
    before = reference.compute_log_probs(batch)[LOG_PROBS]
    torch.testing.assert_close(before[mask], base_ref[mask], atol=0.1, rtol=0)
    metrics = [actor.update(batch, PolicyGradient()) for _ in range(3)]
    assert all(m["skipped_step"] == 0.0 for m in metrics), metrics
    lora = actor.compute_log_probs(batch)[LOG_PROBS]
    assert (lora[mask] - before[mask]).abs().max() > 0.05, "the adapters never moved the policy"
    torch.testing.assert_close(reference.compute_log_probs(batch)[LOG_PROBS], before, atol=0, rtol=0)

    merged = {n: t for b in actor.export_weights_transient(1 << 20) for n, t in b}
    assert all(t.is_cuda and t.dtype == torch.bfloat16 for t in merged.values()), {t.dtype for t in merged.values()}
    adapters = [t for b in actor.export_adapter(1 << 20) for _, t in b]
    # the adapters leave in the compute dtype on a GPU: the engine that serves them computes in it
    assert adapters and all(t.is_cuda and t.dtype == torch.bfloat16 for t in adapters), {t.dtype for t in adapters}

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    hf.load_state_dict({n: t.float().cpu() for n, t in merged.items()}, strict=False)
    hf.save_pretrained(tmp / "merged")
    merged_ref = reference_log_probs(tmp / "merged", batch)
    torch.testing.assert_close(lora[mask], merged_ref[mask], atol=0.1, rtol=0)

    actor.offload()
    actor.onload()
    torch.testing.assert_close(actor.compute_log_probs(batch)[LOG_PROBS], lora, atol=0, rtol=0)
    print("lora cuda checks passed", [round(m["loss"], 4) for m in metrics])


if __name__ == "__main__":
    main(int(sys.argv[1]), Path(sys.argv[2]))
