"""CUDA checks of the FSDP engine in a fresh process (the default process group there is NCCL, which the
gloo group of the pytest process cannot be). Run as ``python _fsdp_cuda_worker.py PORT TMPDIR``; exits non-zero
on the first failed check."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from _fsdp_helpers import PolicyGradient, grouped, make_batch, save_tiny_qwen2  # noqa: E402

from hybridrl.engines import EngineContext, TrainingOptions  # noqa: E402
from hybridrl.engines.batch import LOG_PROBS, PROMPT_IDS, PROMPT_MASK, RESPONSE_IDS, RESPONSE_MASK  # noqa: E402


def cuda_context(model: Path, dtype: str, **options) -> EngineContext:
    return EngineContext(role="actor", backend="fsdp", model_path=str(model), rank=0, world_size=1, device="cuda",
                         dtype=dtype, seed=0, training=TrainingOptions.split(options)[0],
                         options=TrainingOptions.split(options)[1])


def reference_log_probs(model_path: Path, batch) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).cuda().eval()
    ids = torch.cat([batch[PROMPT_IDS], batch[RESPONSE_IDS]], 1).cuda()
    mask = torch.cat([batch[PROMPT_MASK], batch[RESPONSE_MASK]], 1).cuda()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
    p, r = batch[PROMPT_IDS].shape[1], batch[RESPONSE_IDS].shape[1]
    logp = torch.log_softmax(logits[:, p - 1: p + r - 1].float(), -1)
    return logp.gather(-1, batch[RESPONSE_IDS].cuda()[..., None]).squeeze(-1).cpu()


def _cuda_bytes(engine) -> int:
    """Bytes of the engine's parameter shards and AdamW state that live on the GPU."""
    tensors = [p.to_local() for p in engine.model.parameters()]
    tensors += [v for s in engine.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return sum(t.numel() * t.element_size() for t in tensors if t.is_cuda)


def packed_checks(model: Path, batch, ref: torch.Tensor) -> None:
    """bf16 packed micro-batches run PyTorch's flash varlen kernel and the fused head's Triton kernels, match the
    fp32 reference like the padded path does, and train like it (same loss and gradient norm, to bf16 noise)."""
    from hybridrl_fsdp import head_kernels, varlen_attention
    from hybridrl_fsdp.engine import FSDPEngine

    calls = {"flash": 0, "head": 0}
    flash_apply, stats = varlen_attention._TorchFlashVarlen.apply, head_kernels.chunk_stats

    def counting_flash(*args):
        calls["flash"] += 1
        return flash_apply(*args)

    def counting_stats(*args):
        calls["head"] += 1
        return stats(*args)

    varlen_attention._TorchFlashVarlen.apply = counting_flash
    head_kernels.chunk_stats = counting_stats
    mask = batch[RESPONSE_MASK].bool()
    packed = FSDPEngine(cuda_context(model, "bfloat16", lr=1e-3, micro_batch=4, gradient_checkpointing=True))
    padded = FSDPEngine(cuda_context(model, "bfloat16", lr=1e-3, micro_batch=4, gradient_checkpointing=True,
                                     packing=False))
    assert all(m.packed is not None for m in packed._plan(batch))
    lp = packed.compute_log_probs(batch)[LOG_PROBS]
    assert calls["flash"] > 0 and calls["head"] > 0, calls
    torch.testing.assert_close(lp[mask], ref[mask], atol=0.1, rtol=0)
    torch.testing.assert_close(lp[mask], padded.compute_log_probs(batch)[LOG_PROBS][mask], atol=0.1, rtol=0)
    a, b = packed.update(batch, PolicyGradient()), padded.update(batch, PolicyGradient())
    assert abs(a["loss"] - b["loss"]) < 0.05 * abs(b["loss"]) + 1e-3, (a, b)
    assert abs(a["grad_norm"] - b["grad_norm"]) < 0.05 * b["grad_norm"], (a, b)
    varlen_attention._TorchFlashVarlen.apply, head_kernels.chunk_stats = flash_apply, stats
    print("packed checks passed", calls, a["grad_norm"], b["grad_norm"])


def shared_prompt_checks(model: Path) -> None:
    """Shared prompts on the GPU's kernels: torch_flash with key segments longer than their queries equals the
    sdpa path's explicit end-aligned mask (bf16), and an engine with ``share_prompts: true`` gives the log-probs,
    loss and gradient norm of one that repeats the prompts."""
    from hybridrl_fsdp import varlen_attention
    from hybridrl_fsdp.engine import FSDPEngine

    gen = torch.Generator(device="cuda").manual_seed(0)
    lengths = [(3, 40), (1, 17), (64, 64), (5, 130)]
    cu_q = torch.tensor([0, *torch.tensor([q for q, _ in lengths]).cumsum(0).tolist()], dtype=torch.int32).cuda()
    cu_k = torch.tensor([0, *torch.tensor([k for _, k in lengths]).cumsum(0).tolist()], dtype=torch.int32).cuda()
    q = torch.randn(int(cu_q[-1]), 4, 64, device="cuda", generator=gen, dtype=torch.bfloat16)
    k, v = (torch.randn(int(cu_k[-1]), 2, 64, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in "kv")
    max_q, max_k = max(x for x, _ in lengths), max(x for _, x in lengths)
    flash = varlen_attention._varlen("torch_flash", q, k, v, cu_q, cu_k, max_q, max_k, 0.125)
    plain = varlen_attention._padded_sdpa_end_aligned(q, k, v, cu_q, cu_k, max_q, max_k, 0.125)
    torch.testing.assert_close(flash.float(), plain.float(), atol=2e-2, rtol=0)

    batch = grouped(max_prompt=9, max_response=8)
    mask = batch[RESPONSE_MASK].bool()
    engines = {share: FSDPEngine(cuda_context(model, "bfloat16", lr=1e-3, micro_batch=8, share_prompts=share))
               for share in (True, False)}
    assert engines[True].share_prompts and not engines[False].share_prompts
    assert FSDPEngine(cuda_context(model, "bfloat16")).share_prompts  # auto: on with the GPU's kernels too
    lp = {share: e.compute_log_probs(batch)[LOG_PROBS] for share, e in engines.items()}
    torch.testing.assert_close(lp[True][mask], lp[False][mask], atol=0.05, rtol=0)
    a, b = (engines[share].update(batch, PolicyGradient()) for share in (True, False))
    assert abs(a["loss"] - b["loss"]) < 0.05 * abs(b["loss"]) + 1e-3, (a, b)
    assert abs(a["grad_norm"] - b["grad_norm"]) < 0.05 * b["grad_norm"], (a, b)
    print("shared prompt checks passed", a["grad_norm"], b["grad_norm"])


def main(port: int, tmp: Path) -> None:
    from hybridrl.runtime.distributed import init_process_group
    from hybridrl_fsdp.engine import FSDPEngine

    init_process_group(0, 1, "127.0.0.1", port, "cuda", timeout_s=120)
    model = save_tiny_qwen2(tmp / "tiny")
    batch = make_batch(6, seed=11)
    mask = batch[RESPONSE_MASK].bool()
    ref = reference_log_probs(model, batch)

    fp32 = FSDPEngine(cuda_context(model, "float32"))
    torch.testing.assert_close(fp32.compute_log_probs(batch)[LOG_PROBS][mask], ref[mask], atol=1e-4, rtol=0)
    del fp32

    engine = FSDPEngine(cuda_context(model, "bfloat16", lr=1e-3, micro_batch=4, gradient_checkpointing=True))
    bf16 = engine.compute_log_probs(batch)[LOG_PROBS]
    assert bf16.dtype == torch.float32
    torch.testing.assert_close(bf16[mask], ref[mask], atol=0.1, rtol=0)  # bf16 forward, fp32 log-softmax
    metrics = [engine.update(batch, PolicyGradient()) for _ in range(3)]
    assert all(m["skipped_step"] == 0.0 for m in metrics), metrics
    assert metrics[-1]["loss"] < metrics[0]["loss"], metrics
    weights = engine.full_state_dict()
    assert all(t.dtype == torch.float32 for t in weights.values())
    assert all(t.is_cuda for b in engine.export_weights(1 << 20) for _, t in b)

    engine_bytes = _cuda_bytes(engine)
    allocated = torch.cuda.memory_allocated()
    engine.offload()
    freed = allocated - torch.cuda.memory_allocated()
    assert freed >= engine_bytes > 0, (freed, engine_bytes)  # the CUDA context, cuBLAS workspace etc. stay
    assert all(not p.is_cuda for p in engine.model.parameters())
    assert all(not v.is_cuda for s in engine.optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    engine.onload()
    after = engine.full_state_dict()
    for name in weights:
        torch.testing.assert_close(after[name], weights[name], atol=0, rtol=0)
    again = engine.update(batch, PolicyGradient())  # optimizer state still attached to the live parameters
    assert again["skipped_step"] == 0.0 and again["loss"] < metrics[-1]["loss"], again
    del engine
    packed_checks(model, batch, ref)
    shared_prompt_checks(model)
    torch.distributed.destroy_process_group()
    print("cuda checks passed", metrics[0]["loss"], again["loss"], freed, engine_bytes)


if __name__ == "__main__":
    main(int(sys.argv[1]), Path(sys.argv[2]))
