"""The CUDA path of ``MegatronEngine`` on one GPU, in a fresh process (NCCL default group): a Qwen2.5-0.5B-
shaped model (random weights, built from its config) in bf16, one training step through Megatron's DDP and
optimiser, export, offload/onload and a checkpoint round trip. Run as ``python _mg_gpu_worker.py PORT TMPDIR``;
exits non-zero on the first failed check and prints the timings."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from _mg_helpers import PolicyGradient  # noqa: E402

from hybridrl.engines import EngineContext, TrainingOptions  # noqa: E402
from hybridrl.engines.batch import (  # noqa: E402
    ADVANTAGES,
    LOG_PROBS,
    PROMPT_IDS,
    PROMPT_MASK,
    RESPONSE_IDS,
    RESPONSE_MASK,
    Batch,
    sequence_tensors,
)

QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6,
                  rms_norm_eps=1e-6, tie_word_embeddings=True)


def save_model(path: Path) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**QWEN25_05B)).to(torch.bfloat16).save_pretrained(path)
    return path


def batch(rows: int = 8, prompt: int = 32, response: int = 32) -> Batch:
    gen = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(100, 150000, (rows, prompt), generator=gen)
    response_ids = torch.randint(100, 150000, (rows, response), generator=gen)
    prompt_mask = torch.ones(rows, prompt, dtype=torch.long)
    prompt_mask[::2, : prompt // 2] = 0  # left padding on every other row
    response_mask = torch.ones(rows, response, dtype=torch.long)
    response_mask[1::2, response // 2:] = 0  # right padding
    return Batch.from_tensors({PROMPT_IDS: prompt_ids, PROMPT_MASK: prompt_mask, RESPONSE_IDS: response_ids,
                               RESPONSE_MASK: response_mask, ADVANTAGES: torch.randn(rows, response, generator=gen)})


def hf_log_probs(path: Path, data: Batch, weights: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    if weights is not None:
        model.load_state_dict(weights, strict=False)
    ids, mask, pos = (t.cuda() for t in sequence_tensors(data))
    r = data[RESPONSE_IDS].shape[1]
    p = ids.shape[1] - r
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, p - 1: p + r - 1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, data[RESPONSE_IDS].cuda()[..., None]).squeeze(-1)
    return (lp * data[RESPONSE_MASK].cuda()).cpu()


def exported(engine) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for b in engine.export_weights(256 << 20) for n, t in b}


def check(cond: bool, what: str) -> None:
    if not cond:
        raise SystemExit(f"FAILED: {what}")
    print(f"ok: {what}", flush=True)


def main(port: int, tmp: Path) -> None:
    from hybridrl.runtime.distributed import init_process_group
    from hybridrl_megatron.engine import MegatronEngine

    init_process_group(0, 1, "127.0.0.1", port, "cuda", timeout_s=300)
    path = save_model(tmp / "qwen2.5-0.5b-shaped")
    ctx = EngineContext(role="actor", backend="megatron", model_path=str(path), rank=0, world_size=1, device="cuda",
                        dtype="bfloat16", seed=0, training=TrainingOptions(micro_batch=4, lr=1e-5, grad_clip=1.0))
    t0 = time.perf_counter()
    engine = MegatronEngine(ctx)
    print(f"build {time.perf_counter() - t0:.1f}s", flush=True)
    data = batch()
    initial = exported(engine)
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        saved = {n: f.get_tensor(n) for n in f.keys()}
    check(initial.keys() == saved.keys() - {"lm_head.weight"}, "export names are the checkpoint's (tied head once)")
    check(all(t.dtype == torch.bfloat16 and t.is_cuda for t in initial.values()), "export is bf16 on the GPU")
    check(all(torch.equal(initial[n].cpu(), saved[n]) for n in initial), "export equals the checkpoint")

    lp = engine.compute_log_probs(data)[LOG_PROBS]
    want = hf_log_probs(path, data)
    diff = (lp - want).abs()[data[RESPONSE_MASK].bool()]
    print(f"log-prob |megatron - transformers| mean {diff.mean():.4f} max {diff.max():.4f}", flush=True)
    check(float(diff.mean()) < 0.05 and float(diff.max()) < 0.5, "bf16 log-probs agree with transformers")

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    metrics = engine.update(data, PolicyGradient())
    torch.cuda.synchronize()
    print(f"update {time.perf_counter() - t0:.2f}s {metrics}", flush=True)
    check(metrics["skipped_step"] == 0.0 and metrics["grad_norm"] > 0 and torch.isfinite(torch.tensor(metrics["loss"])),
          "one bf16 training step")
    t0 = time.perf_counter()
    trained = exported(engine)
    print(f"export {time.perf_counter() - t0:.2f}s", flush=True)
    check(any(not torch.equal(trained[n], initial[n]) for n in trained), "the step moved the weights")
    after = engine.compute_log_probs(data)[LOG_PROBS]
    want = hf_log_probs(path, data, {n: t.cpu() for n, t in trained.items()})
    check(float((after - want).abs()[data[RESPONSE_MASK].bool()].mean()) < 0.05,
          "transformers with the exported weights agrees with the engine")

    before_offload = torch.cuda.memory_allocated()
    engine.offload()
    check(torch.cuda.memory_allocated() < before_offload / 2, "offload releases most GPU memory")
    engine.onload()
    check(all(torch.equal(t, trained[n]) for n, t in exported(engine).items()), "offload/onload keep the weights")
    engine.update(data, PolicyGradient())  # still trains after onload

    engine.save_checkpoint(str(tmp / "ckpt"))
    saved_weights = exported(engine)
    engine.update(data, PolicyGradient())
    engine.load_checkpoint(str(tmp / "ckpt"))
    check(all(torch.equal(t, saved_weights[n]) for n, t in exported(engine).items()), "checkpoint round trip")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), Path(sys.argv[2]))
