"""GPU smoke test of the SGLang rollout plugin, in one call, on a Qwen2.5-0.5B-shaped random bf16 model.

    python3 plugins/sglang/benchmarks/sglang_smoke.py --out $OUT/sglang_smoke.json

Stages (each timed; a failure is recorded with its traceback and the next stages still run where they can):
  env         versions, GPU
  model       config + random weights (A, saved with a tokenizer built in code) and a second set B (in memory)
  engine      ``SGLangRollout`` start through the plugin (``sglang.Engine`` underneath)
  generate    greedy outputs; sampled throughput at batch x tokens (``ignore_eos``)
  greedy_a    greedy equality vs transformers on model A; log-prob differences on the engine's tokens
  sleep       sleep/wake with the KV cache released (freed memory, timings)
  sync_b      weights B imported while asleep (CUDA buckets, packed), wake, greedy vs transformers on B
  sync_a      sleep releasing the weights too, weights A imported as views of one receive buffer (zero copy,
              the broadcast bridge's shape), wake, greedy vs transformers on A
  sampling    sampled log-probs (top-k) and min_new_tokens vs transformers
  close       engine shutdown
The JSON is rewritten after every stage, so a killed run still leaves what it measured; a watchdog ends the
run at ``--deadline`` seconds (default 225) with the stage it was in marked ``timeout``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
for extra in (ROOT / "core", ROOT / "plugins" / "sglang"):  # runnable from a checkout without installing
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402

SHAPE = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
             num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=1000000.0,
             rms_norm_eps=1e-6, use_sliding_window=False)
EOS, PAD = 1, 0  # the bundled character tokenizer's ids, written into the model's configs
TIE_TOL = 0.05  # a greedy mismatch whose two tokens' log-probs differ by less than this is a near-tie
DEVICE = "cuda"  # where the transformers reference runs (a module constant so the helpers can be dry-run on CPU)


class Report:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {"stages": {}, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        self.current: str | None = None
        self.lock = threading.Lock()
        self.t0 = time.perf_counter()

    def write(self) -> None:
        with self.lock:
            self.data["elapsed_s"] = round(time.perf_counter() - self.t0, 2)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.data, indent=2, default=str))
            tmp.replace(self.path)

    def stage(self, name: str, fn: Callable[[], dict[str, Any] | None], needs: tuple[str, ...] = ()) -> bool:
        missing = [n for n in needs if not self.data["stages"].get(n, {}).get("ok")]
        if missing:
            self.data["stages"][name] = {"ok": False, "skipped": f"needs {', '.join(missing)}"}
            print(f"[{name}] skipped (needs {', '.join(missing)})", flush=True)
            self.write()
            return False
        self.current = name
        start = time.perf_counter()
        print(f"[{name}] ...", flush=True)
        try:
            figures = fn() or {}
            entry = {"ok": True, **figures}
        except Exception as exc:  # noqa: BLE001 - every stage reports its own failure
            entry = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-6000:]}
        entry["seconds"] = round(time.perf_counter() - start, 3)
        self.data["stages"][name] = entry
        self.current = None
        shown = {k: v for k, v in entry.items() if k != "traceback"}
        print(f"[{name}] {json.dumps(shown, default=str)[:1500]}", flush=True)
        if not entry["ok"]:
            print(entry["traceback"], flush=True)
        self.write()
        return entry["ok"]


def _watchdog(report: Report, deadline: float) -> None:
    def fire() -> None:
        report.data["timeout"] = {"deadline_s": deadline, "stage": report.current}
        if report.current:
            report.data["stages"][report.current] = {"ok": False, "error": f"timeout after {deadline}s"}
        report.write()
        print(f"watchdog: deadline {deadline}s reached in stage {report.current}", flush=True)
        try:
            import psutil

            for child in psutil.Process().children(recursive=True):
                child.kill()
        except Exception:  # noqa: BLE001
            pass
        os._exit(3)

    timer = threading.Timer(deadline, fire)
    timer.daemon = True
    timer.start()


# --- helpers --------------------------------------------------------------------------------------------------
def build_model(seed: int, init_std: float):
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SHAPE, initializer_range=init_std, eos_token_id=EOS, pad_token_id=PAD, bos_token_id=2)
    torch.manual_seed(seed)
    with torch.device(DEVICE):
        model = Qwen2ForCausalLM(config)
    # Buffers (the rotary inverse frequencies) stay float32, as from_pretrained(dtype=bfloat16) keeps them and as
    # SGLang computes them: a bfloat16 copy shifts every position's rotation and the reference with it.
    buffers = {name: buf.clone() for name, buf in model.named_buffers()}
    model = model.to(torch.bfloat16).eval()
    for name, buf in buffers.items():
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, buf)
    model.generation_config = GenerationConfig(eos_token_id=EOS, pad_token_id=PAD)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def state_of(model) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def export_buckets(state: dict[str, torch.Tensor], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """As a trainer exports: each tensor once (the tied head only as the embedding), ~bucket_bytes per bucket."""
    buckets, current, size = [], [], 0
    for name, tensor in state.items():
        if name == "lm_head.weight":
            continue
        current.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


@torch.no_grad()
def hf_greedy(model, prompts: list[list[int]], width: int) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy continuation of equally long prompts (no padding), one uncached forward per step; also the
    log-softmax at every generated position ``(rows, width, vocab)`` is not kept: only the chosen tokens'."""
    ids = torch.tensor(prompts, device=DEVICE)
    for _ in range(width):
        logits = model(input_ids=ids).logits[:, -1].float()
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    return ids[:, len(prompts[0]):].tolist(), ids


@torch.no_grad()
def hf_logprobs(model, prompt: list[int], response: list[int], temperature: float = 1.0, top_k: int = 0,
                eos_banned: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced ``(log-probs of the response tokens, log-softmax rows)`` under transformers, with the
    engine's transformations: temperature, top-k renormalisation, EOS masked for the first ``eos_banned``."""
    from hybridrl.rollout.hf import filter_logits

    ids = torch.tensor([prompt + response], device=DEVICE)
    logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    if eos_banned:
        logits[:eos_banned, EOS] = float("-inf")
    logits = filter_logits(logits / temperature, top_k, 1.0) if temperature > 0 else logits
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(1, torch.tensor(response, device=DEVICE)[:, None]).squeeze(1), logp


def compare_greedy(model, engine_tokens: list[list[int]], engine_logps: torch.Tensor, prompts: list[list[int]],
                   width: int) -> dict[str, Any]:
    """Rows equal to transformers' greedy output; for the others, where they diverge and whether it is a
    near-tie; log-prob differences on the engine's tokens (teacher-forced)."""
    expected, _ = hf_greedy(model, prompts, width)
    equal, first_div, ties, lp_diffs = 0, [], 0, []
    for i, (got, want) in enumerate(zip(engine_tokens, expected)):
        ref_lp, logp = hf_logprobs(model, prompts[i], got)
        lp_diffs.append(float((ref_lp.cpu() - engine_logps[i, :len(got)]).abs().max()))
        if got == want:
            equal += 1
            continue
        pos = next(k for k in range(min(len(got), len(want))) if got[k] != want[k])
        first_div.append(pos)
        gap = float(logp[pos, want[pos]] - logp[pos, got[pos]])
        ties += int(abs(gap) < TIE_TOL)
    return {"rows": len(prompts), "equal_rows": equal, "first_divergence": first_div, "divergences_near_tie": ties,
            "logprob_max_abs_diff": max(lp_diffs), "logprob_mean_max_abs_diff": sum(lp_diffs) / len(lp_diffs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--model-dir", default="/tmp/hybridrl-sglang-smoke")
    ap.add_argument("--prompts", type=int, default=8, help="prompts of the greedy checks")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--width", type=int, default=32, help="new tokens of the greedy checks")
    ap.add_argument("--batch", type=int, default=64, help="rows of the throughput run")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per row of the throughput run")
    ap.add_argument("--mem", type=float, default=0.5, help="gpu_memory_utilization (mem_fraction_static)")
    ap.add_argument("--bucket-mb", type=float, default=256.0)
    ap.add_argument("--init-std", type=float, default=0.02, help="initializer_range of the random weights")
    ap.add_argument("--deadline", type=float, default=225.0, help="seconds before the watchdog ends the run")
    args = ap.parse_args()
    report = Report(Path(args.out))
    report.data["args"] = vars(args)
    _watchdog(report, args.deadline)
    ctx: dict[str, Any] = {}

    def env() -> dict[str, Any]:
        info: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__,
                                "cuda": torch.cuda.is_available()}
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["gpu_total_gb"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        for mod in ("transformers", "sglang", "tensordict", "torch_memory_saver", "flashinfer"):
            try:
                m = __import__(mod)
                info[mod] = getattr(m, "__version__", "present")
            except Exception as exc:  # noqa: BLE001
                info[mod] = f"missing: {type(exc).__name__}: {exc}"
        try:
            import hybridrl.engines.batch  # noqa: F401 - needs tensordict
            info["hybridrl"] = "importable"
        except Exception as exc:  # noqa: BLE001
            info["hybridrl"] = f"not importable: {exc}"
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device")
        return info

    def model() -> dict[str, Any]:
        folder = Path(args.model_dir) / "a"
        folder.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        a = build_model(0, args.init_std)
        ctx["state_a"] = state_of(a)
        a.save_pretrained(str(folder), safe_serialization=True)
        tokenizer = "saved"
        try:  # the engine runs without one (skip_tokenizer_init); saved so the folder is a complete checkpoint
            from hybridrl.model.tokenizer import build_char_tokenizer

            build_char_tokenizer().save_pretrained(str(folder))
        except Exception as exc:  # noqa: BLE001
            tokenizer = f"not saved: {exc}"
        saved = time.perf_counter() - t
        b = build_model(1, args.init_std)
        ctx["state_b"] = state_of(b)
        del b
        ctx["hf"], ctx["folder"] = a, folder  # the transformers reference, holding A's weights now
        gen = torch.Generator().manual_seed(0)
        ctx["prompts"] = torch.randint(10, SHAPE["vocab_size"], (args.prompts, args.prompt_len), generator=gen).tolist()
        n = sum(t.numel() for k, t in ctx["state_a"].items() if k != "lm_head.weight")
        return {"params": n, "tensors": len(ctx["state_a"]) - 1, "build_and_save_s": round(saved, 2),
                "tokenizer": tokenizer,
                "dir_gb": round(sum(f.stat().st_size for f in folder.iterdir()) / 2**30, 3)}

    def engine() -> dict[str, Any]:
        from hybridrl.engines import EngineContext
        from hybridrl_sglang.engine import SGLangRollout

        c = EngineContext(role="rollout", backend="sglang", model_path=str(ctx["folder"]), rank=0, world_size=1,
                          device="cuda", dtype="bfloat16", seed=0, trainable=False,
                          options={"gpu_memory_utilization": args.mem})
        free0 = torch.cuda.mem_get_info()[0]
        ctx["engine"] = SGLangRollout(c)
        free1 = torch.cuda.mem_get_info()[0]
        e = ctx["engine"]
        return {"start_s": round(e.start_seconds, 2), "context_length": e.context_length, "eos_ids": e.eos_ids,
                "engine_gb": round((free0 - free1) / 2**30, 2)}

    def batch_of(prompts: list[list[int]]):
        from hybridrl.engines.batch import PROMPT_IDS, PROMPT_MASK, Batch, left_pad

        ids, mask = left_pad(prompts, pad_id=PAD)
        return Batch.from_tensors({PROMPT_IDS: ids, PROMPT_MASK: mask})

    def engine_greedy() -> tuple[list[list[int]], torch.Tensor, float]:
        from hybridrl.engines import SamplingParams
        from hybridrl.engines.batch import RESPONSE_IDS, RESPONSE_MASK, ROLLOUT_LOG_PROBS

        t = time.perf_counter()
        out = ctx["engine"].generate(batch_of(ctx["prompts"]),
                                     SamplingParams(temperature=0.0, max_new_tokens=args.width, ignore_eos=True))
        dt = time.perf_counter() - t
        lengths = out[RESPONSE_MASK].sum(1).tolist()
        tokens = [row[:n] for row, n in zip(out[RESPONSE_IDS].tolist(), lengths)]
        return tokens, out[ROLLOUT_LOG_PROBS], dt

    def generate() -> dict[str, Any]:
        from hybridrl.engines import SamplingParams
        from hybridrl.engines.batch import RESPONSE_MASK

        tokens, _, dt = engine_greedy()
        ctx["greedy_a"] = tokens
        gen = torch.Generator().manual_seed(1)
        rows = torch.randint(10, SHAPE["vocab_size"], (args.batch, args.prompt_len), generator=gen).tolist()
        params = SamplingParams(temperature=1.0, max_new_tokens=args.tokens, ignore_eos=True, seed=3)
        ctx["engine"].generate(batch_of(rows[:4]), params)  # warm-up of the sampled path
        t = time.perf_counter()
        out = ctx["engine"].generate(batch_of(rows), params)
        sampled = time.perf_counter() - t
        n = int(out[RESPONSE_MASK].sum())
        return {"greedy_s": round(dt, 3), "greedy_first_row": tokens[0][:12], "sampled_tokens": n,
                "sampled_s": round(sampled, 3), "tokens_per_s": round(n / sampled, 1),
                "batch": args.batch, "new_tokens": args.tokens}

    def greedy_a() -> dict[str, Any]:
        tokens, logps, _ = engine_greedy()
        return compare_greedy(ctx["hf"], tokens, logps, ctx["prompts"], args.width)

    def timed(fn: Callable[[], None]) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        return round(time.perf_counter() - t, 4)

    def sleep() -> dict[str, Any]:
        e = ctx["engine"]
        free0 = torch.cuda.mem_get_info()[0]
        s = timed(e.sleep)
        free1 = torch.cuda.mem_get_info()[0]
        w = timed(e.wake)
        free2 = torch.cuda.mem_get_info()[0]
        tokens, _, _ = engine_greedy()
        return {"released": e.last_released, "sleep_s": s, "wake_s": w, "freed_gb": round((free1 - free0) / 2**30, 2),
                "retaken_gb": round((free1 - free2) / 2**30, 2), "same_greedy_after_wake": tokens == ctx["greedy_a"]}

    def sync(state_key: str, views: bool) -> dict[str, Any]:
        from hybridrl.weights.buckets import describe_bucket, pack_bucket, unpack_bucket

        e = ctx["engine"]
        buckets = export_buckets(ctx[state_key], int(args.bucket_mb * 2**20))
        if views:  # the broadcast bridge's shape: each bucket received into one flat buffer
            specs = [describe_bucket(b) for b in buckets]
            buckets = [unpack_bucket(pack_bucket(b, spec, "cuda"), spec) for b, spec in zip(buckets, specs)]
        e.sleep()
        released = list(e.last_released)
        free_asleep = torch.cuda.mem_get_info()[0]
        shared0 = e.import_counters["shared"]
        torch.cuda.synchronize()
        t = time.perf_counter()
        for bucket in buckets:
            e.import_weights(bucket)
        e.finish_weight_import()
        sync_s = time.perf_counter() - t
        w = timed(e.wake)
        nbytes = sum(t.numel() * t.element_size() for b in buckets for _, t in b)
        ctx["hf"].load_state_dict(ctx[state_key])
        tokens, logps, _ = engine_greedy()
        out = {"released_on_sleep": released, "free_gb_asleep": round(free_asleep / 2**30, 2),
               "buckets": len(buckets), "gb": round(nbytes / 2**30, 3), "sync_s": round(sync_s, 4),
               "gb_per_s": round(nbytes / 2**30 / sync_s, 1),
               "zero_copy_buckets": e.import_counters["shared"] - shared0,
               "wake_s": w}
        out.update(compare_greedy(ctx["hf"], tokens, logps, ctx["prompts"], args.width))
        return out

    def sampling() -> dict[str, Any]:
        from hybridrl.engines import SamplingParams
        from hybridrl.engines.batch import RESPONSE_IDS, RESPONSE_MASK, ROLLOUT_LOG_PROBS

        e, prompts = ctx["engine"], ctx["prompts"][:4]
        out: dict[str, Any] = {}
        params = SamplingParams(temperature=0.8, top_k=20, max_new_tokens=16, ignore_eos=True, seed=7)
        got = e.generate(batch_of(prompts), params)
        diffs = []
        for i, p in enumerate(prompts):
            ref, _ = hf_logprobs(ctx["hf"], p, got[RESPONSE_IDS][i].tolist(), 0.8, 20)
            diffs.append(float((ref.cpu() - got[ROLLOUT_LOG_PROBS][i]).abs().max()))
        out["topk_logprob_max_abs_diff"] = max(diffs)
        out["inexact_renormalisations"] = e.inexact_logprobs
        params = SamplingParams(temperature=0.0, max_new_tokens=12, min_new_tokens=6)
        got = e.generate(batch_of(prompts), params)
        lengths = got[RESPONSE_MASK].sum(1).tolist()
        eos_early = sum(int(EOS in row[:6]) for row in got[RESPONSE_IDS].tolist())
        diffs = []
        for i, p in enumerate(prompts):
            resp = got[RESPONSE_IDS][i, :int(lengths[i])].tolist()
            ref, _ = hf_logprobs(ctx["hf"], p, resp, 0.0, 0, eos_banned=6)
            diffs.append(float((ref.cpu() - got[ROLLOUT_LOG_PROBS][i, :len(resp)]).abs().max()))
        out.update({"min_new_lengths": lengths, "eos_inside_min_new": eos_early,
                    "min_new_logprob_max_abs_diff": max(diffs)})
        return out

    def raw() -> dict[str, Any]:
        """Without the plugin's engine class (it failed to start): SGLang through ``compat`` alone, which
        needs neither hybridrl's core nor tensordict, to tell an SGLang problem from a plugin problem."""
        from hybridrl_sglang import compat
        from hybridrl_sglang.buckets import flatten
        from hybridrl_sglang.options import SGLangOptions, engine_kwargs

        kwargs = engine_kwargs(SGLangOptions(gpu_memory_utilization=args.mem), model_path=str(ctx["folder"]),
                               dtype="bfloat16", seed=0)
        out: dict[str, Any] = {"kwargs": kwargs}
        t = time.perf_counter()
        eng = compat.start_engine(kwargs)
        out["start_s"] = round(time.perf_counter() - t, 2)

        def greedy(state_key: str) -> dict[str, Any]:
            sp = {"temperature": 0.0, "max_new_tokens": args.width, "ignore_eos": True}
            outs = compat.generate(eng, ctx["prompts"], [dict(sp) for _ in ctx["prompts"]])
            tokens = [list(o["output_ids"]) for o in outs]
            lps = torch.tensor([[float(e[0]) for e in o["meta_info"]["output_token_logprobs"]] for o in outs])
            ctx["hf"].load_state_dict(ctx[state_key])
            return compare_greedy(ctx["hf"], tokens, lps, ctx["prompts"], args.width)

        try:
            out["greedy_a"] = greedy("state_a")
            out["release_s"] = timed(lambda: compat.release(eng, ["kv_cache", "weights"]))
            out["resume_weights_s"] = timed(lambda: compat.resume(eng, ["weights"]))
            t = time.perf_counter()
            for bucket in export_buckets(ctx["state_b"], int(args.bucket_mb * 2**20)):
                flat, entries, _ = flatten(bucket, torch.bfloat16, "cuda")
                torch.cuda.synchronize()
                compat.update_flat(eng, flat, entries, 1)
            compat.flush_cache(eng)
            out["update_s"] = round(time.perf_counter() - t, 4)
            out["resume_kv_s"] = timed(lambda: compat.resume(eng, ["kv_cache"]))
            out["greedy_b"] = greedy("state_b")
        finally:
            compat.shutdown(eng)
        return out

    def close() -> dict[str, Any]:
        engine = ctx.pop("engine")
        t = time.perf_counter()
        engine.close()
        return {"shutdown_s": round(time.perf_counter() - t, 2)}

    report.stage("env", env)
    report.stage("model", model, needs=("env",))
    report.stage("engine", engine, needs=("model",))
    if not report.data["stages"]["engine"].get("ok") and report.data["stages"]["model"].get("ok"):
        report.stage("raw", raw, needs=("model",))
    report.stage("generate", generate, needs=("engine",))
    report.stage("greedy_a", greedy_a, needs=("generate",))
    report.stage("sleep", sleep, needs=("generate",))
    report.stage("sync_b", lambda: sync("state_b", views=False), needs=("engine",))
    report.stage("sync_a", lambda: sync("state_a", views=True), needs=("engine",))
    report.stage("sampling", sampling, needs=("engine",))
    if "engine" in ctx:
        report.stage("close", close)
    stages = report.data["stages"]
    report.data["ok"] = all(s.get("ok") for s in stages.values())
    report.data["failed"] = [n for n, s in stages.items() if not s.get("ok")]
    report.write()
    print(json.dumps({"ok": report.data["ok"], "failed": report.data["failed"],
                      "elapsed_s": report.data["elapsed_s"]}), flush=True)
    return 0 if report.data["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
