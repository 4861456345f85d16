"""Megatron layouts against each other on two ranks (issue #12): TP1 (data parallel 2), TP2 and PP2 on one
Qwen2.5-0.5B-shaped random bf16 model, one batch, one update each.

    python plugins/megatron/benchmarks/tp_pp_gpu.py --out results/tp_pp_gpu.json              # 2 GPUs, NCCL
    python plugins/megatron/benchmarks/tp_pp_gpu.py --device cpu --shape tiny --out /tmp/x.json  # 2 CPU ranks

The parent process starts two worker processes (this file with ``--worker-rank``; one per GPU, NCCL on CUDA,
gloo on CPU) and watches them. Worker rank 0 builds the random model into a temporary folder while rank 1
waits at a barrier. Then, in one launch, for each layout the workers build ``MegatronEngine``
(``tensor_parallel`` / ``pipeline_parallel`` options; data parallel = 2 / tp / pp), take the log-probs of
their data-parallel share of a fixed batch (8 rows of 64 prompt + 64 response tokens, left/right padding),
run ONE update with a fixed policy-gradient objective, export the weights (HF names, gathered) and write
their results to the work folder; Megatron's parallel state is torn down between layouts as
``tests/megatron/_mg_worker.py`` does. Each layout runs in try/except; a layout that hangs or kills a
worker is cut off by the parent (``--layout-timeout``) and the layouts after it run in a fresh launch, so
one failure loses only that layout. The parent then compares TP2 and PP2 with TP1, prints a table and
writes ``--out``; exit status 1 if a check failed.

What is compared, and why the tolerances (``TOLERANCES``):

* loss and gradient norm, relative to TP1. The advantages are drawn from U(0.5, 1.5), so the loss is a
  positively weighted mean negative log-likelihood (about log V = 11.9 for a random model), not a
  cancelling sum near zero, and a relative difference means something. A wrong reduction (a missing data-
  parallel average, a double-counted tied embedding) moves either by tens of percent. In bf16 the layouts
  differ only in summation order (tensor-parallel all-reduces, split GEMMs): each op is good to 2^-8 =
  0.4% relative and the loss is a mean over ~800 tokens, so 1e-2 for the loss and 2e-2 for the norm (a
  root of a sum of squares of bf16 gradients) leave a wide margin for rounding while any structural error
  is far beyond them. fp32 on CPU: 1e-4.
* log-probs of the batch before the step: mean and max |diff| over response tokens. The reference log-probs
  spread over about +-0.6 nats (reported as ``lp_ref_std``) for the default 0.02 init, so a mis-ordered
  vocabulary shard or a wrong layer shows up as ~0.5 mean; bf16 summation order gives ~1e-2 or less.
  Tolerances: mean 2e-2, max 0.25 (bf16; the one-GPU CUDA check allows 0.05 / 0.5 against transformers);
  fp32: 1e-4 / 1e-3.
* exported weights after the step. Adam's first step moves each element by lr * g / (|g| + eps), i.e. by
  at most lr, whatever the gradient's scale; so two correct layouts differ by at most 2 * lr (elements
  whose near-zero gradient has a different sign in the two layouts, e.g. the attention key bias, whose
  exact gradient is zero) plus one rounding of the stored dtype (eps(dtype) * max|w|). Checked per tensor
  (``weights_bound``); a wrong shard or layer would differ by the weight scale (~0.02, 10x the bound at
  lr=1e-3). A tensor that is not updated at all would stay within that bound, so two more checks compare
  the update (after - initial): its cosine with TP1's over all weights (1 - 2 x the fraction of flipped
  signs; >= 0.8 in bf16, >= 0.99 in fp32) and, per tensor, the fraction of elements that moved (must agree
  within 0.1). Also reported: the largest |diff| relative to the weight scale (max|w|) of its tensor.
* every rank holds every exported tensor; their float64 sums agree across ranks (``export_same_on_ranks``).

Timings are per layout, the slowest rank, with the device synchronised: engine build, the log-prob
forward, the (single, so partly cold) update, and the export of all weights.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

#: the model of ``tests/megatron/_mg_gpu_worker.py`` (QWEN25_05B), and a small Qwen2 for CPU runs.
SHAPES = {
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                         rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True, initializer_range=0.02),
    "tiny": dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rope_theta=1e6,
                 rms_norm_eps=1e-6, tie_word_embeddings=True, initializer_range=0.2),
}
#: name -> (tensor_parallel, pipeline_parallel); data parallel = world / tp / pp. The first is the reference.
LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}
REFERENCE = "tp1"
TOLERANCES = {
    "cuda": {"loss_rel": 1e-2, "grad_norm_rel": 2e-2, "lp_mean": 2e-2, "lp_max": 0.25, "update_cos": 0.8,
             "moved_frac": 0.1},
    "cpu": {"loss_rel": 1e-4, "grad_norm_rel": 1e-4, "lp_mean": 1e-4, "lp_max": 1e-3, "update_cos": 0.99,
            "moved_frac": 0.1},
}
#: NVLink multicast stays off wherever this starts processes (it can take shared GPUs out of service).
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", flush=True)


# --- the worker (one rank) ------------------------------------------------------------------------------
def make_batch(rows: int, prompt: int, response: int, vocab: int, seed: int = 0):
    """Random tokens; every other row's prompt is half left padding, every other row's response half right
    padding; advantages U(0.5, 1.5) (see the module docstring)."""
    import torch

    from hybridrl.engines.batch import ADVANTAGES, PROMPT_IDS, PROMPT_MASK, RESPONSE_IDS, RESPONSE_MASK, Batch

    gen = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(1, vocab, (rows, prompt), generator=gen)
    response_ids = torch.randint(1, vocab, (rows, response), generator=gen)
    prompt_mask = torch.ones(rows, prompt, dtype=torch.long)
    prompt_mask[::2, : prompt // 2] = 0
    response_mask = torch.ones(rows, response, dtype=torch.long)
    response_mask[1::2, response // 2:] = 0
    prompt_ids = prompt_ids * prompt_mask
    response_ids = response_ids * response_mask
    advantages = (0.5 + torch.rand(rows, response, generator=gen)) * response_mask
    return Batch.from_tensors({PROMPT_IDS: prompt_ids, PROMPT_MASK: prompt_mask, RESPONSE_IDS: response_ids,
                               RESPONSE_MASK: response_mask, ADVANTAGES: advantages})


class PolicyGradient:
    """``tests/megatron/_mg_helpers.PolicyGradient``: ``-(log_probs * adv * mask).sum() / total_tokens *
    dp_size``, this micro-batch's exact share of the global token-mean loss."""

    needs = ("log_probs",)

    def __call__(self, outputs, micro_batch, scale):
        from hybridrl.engines.batch import ADVANTAGES, RESPONSE_MASK

        mask = micro_batch[RESPONSE_MASK].float()
        loss = -(outputs["log_probs"] * micro_batch[ADVANTAGES] * mask).sum() / scale.total_tokens * scale.dp_size
        return loss, {"tokens": float(mask.sum())}


def build_model(path: Path, shape: dict, dtype, device: str) -> None:
    """A random Qwen2 of ``shape`` (initialised on ``device``, fast for 0.5B on a GPU), saved in ``dtype``.
    The q/k/v biases and the norms are randomised (zero / one by default) so that their sharding and loading
    show in the results."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**shape))
    std = shape["initializer_range"]
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, std)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    tmp = path.with_name(path.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.to(dtype).save_pretrained(tmp)
    tmp.rename(path)
    del model


def worker(rank: int, cfg: dict, layouts: list[str]) -> None:
    os.environ["LOCAL_RANK"] = str(rank)  # init_process_group picks the CUDA device from it
    import torch
    import torch.distributed as dist

    device = cfg["device"]
    if device == "cpu":
        torch.set_num_threads(1)  # the two ranks share the cores
    from megatron.core import parallel_state

    from hybridrl.runtime.distributed import init_process_group

    work = Path(cfg["work"])
    init_process_group(rank, cfg["world"], "127.0.0.1", cfg["port"], device, timeout_s=cfg["collective_timeout"])
    dtype = getattr(torch, cfg["dtype"])
    model_path = work / "model"
    if rank == 0 and not model_path.exists():
        t = time.perf_counter()
        build_model(model_path, cfg["shape"], dtype, "cuda" if device == "cuda" else "cpu")
        print(f"rank 0 built the model in {time.perf_counter() - t:.1f}s", flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    dist.barrier()
    if not model_path.exists():
        raise RuntimeError(f"{model_path} was not built")
    batch = make_batch(cfg["rows"], cfg["prompt"], cfg["response"], cfg["shape"]["vocab_size"])
    for name in layouts:
        (work / f"{name}.rank{rank}.started").write_text(str(time.time()))
        result: dict = {"layout": name, "rank": rank}
        try:
            result.update(run_layout(cfg, rank, model_path, batch, *LAYOUTS[name], name))
            result["ok"] = True
        except Exception as exc:  # noqa: BLE001 - recorded, the next layout still runs
            result.update(ok=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-4000:])
            print(f"rank {rank} layout {name} FAILED:\n{result['traceback']}", flush=True)
            (work / f"{name}.rank{rank}.failed").write_text(str(time.time()))
        finally:
            import gc

            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
            parallel_state.destroy_model_parallel()
        tmp = work / f"{name}.rank{rank}.pt.partial"
        torch.save(result, tmp)
        tmp.rename(work / f"{name}.rank{rank}.pt")
        print(f"rank {rank} layout {name} {'ok' if result['ok'] else 'failed'}", flush=True)
    dist.destroy_process_group()


def run_layout(cfg: dict, rank: int, model_path: Path, batch, tp: int, pp: int, name: str) -> dict:
    import torch
    import torch.distributed as dist

    from hybridrl.engines import EngineContext, TrainingOptions
    from hybridrl.engines.batch import LOG_PROBS
    from hybridrl_megatron.engine import MegatronEngine

    cuda = cfg["device"] == "cuda"

    def sync() -> float:
        """Everyone here, device idle: a timer start/stop point."""
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    options = {"micro_batch": cfg["micro_batch"], "lr": cfg["lr"], "grad_clip": cfg["grad_clip"],
               "tensor_parallel": tp, "pipeline_parallel": pp}
    ctx = EngineContext(role="actor", backend="megatron", model_path=str(model_path), rank=rank,
                        world_size=cfg["world"], device=cfg["device"], dtype=cfg["dtype"], seed=0,
                        training=TrainingOptions.split(options)[0], options=TrainingOptions.split(options)[1])
    out: dict = {}
    t = sync()
    engine = MegatronEngine(ctx)
    out["build_s"] = sync() - t
    _fault(name, rank)
    info = engine.data_parallel()
    out.update(tp=engine.layout.tp, pp=engine.layout.pp, dp=engine.layout.dp, dp_rank=info.dp_rank,
               returns_output=info.returns_output)
    rows = torch.arange(len(batch)).chunk(info.dp_size)[info.dp_rank]
    local = batch.chunk(info.dp_size)[info.dp_rank]
    out["rows"] = rows

    t = sync()
    out["log_probs_before"] = engine.compute_log_probs(local)[LOG_PROBS]
    out["logprob_s"] = sync() - t

    t = sync()
    metrics = engine.update(local, PolicyGradient())
    out["step_s"] = sync() - t
    out["metrics"] = metrics

    t = sync()
    weights = {n: w for bucket in engine.export_weights(cfg["bucket_bytes"]) for n, w in bucket}
    out["export_s"] = sync() - t
    out["export_sums"] = {n: float(w.double().sum()) for n, w in weights.items()}
    out["log_probs_after"] = engine.compute_log_probs(local)[LOG_PROBS]
    if cuda:
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if rank == 0:
        tmp = Path(cfg["work"]) / f"{name}.weights.pt.partial"
        torch.save({n: w.detach().cpu() for n, w in weights.items()}, tmp)
        tmp.rename(Path(cfg["work"]) / f"{name}.weights.pt")
    del weights, engine
    return out


def _fault(name: str, rank: int) -> None:
    """Test hook for the watchdog: ``TP_PP_GPU_FAULT=LAYOUT:RANK:raise|hang|crash`` makes that rank of that
    layout raise, sleep forever, or exit, right after building the engine (its peer then waits in a
    collective)."""
    spec = os.environ.get("TP_PP_GPU_FAULT", "")
    if not spec:
        return
    layout, fault_rank, kind = spec.split(":")
    if layout != name or int(fault_rank) != rank:
        return
    if kind == "raise":
        raise RuntimeError(f"injected fault in layout {name} rank {rank}")
    if kind == "hang":
        time.sleep(10**6)
    if kind == "crash":
        os._exit(3)


# --- the parent: launches, watchdog ---------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the worker's own session: it and its children only
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass


def launch(cfg: dict, layouts: list[str], attempt: int, deadline: float) -> tuple[str | None, str]:
    """One launch of ``world`` workers over ``layouts``. Returns (the layout that was cut off or whose worker
    died, or None, and why)."""
    work = Path(cfg["work"])
    cfg = {**cfg, "port": free_port()}
    cfg_path = work / f"launch{attempt}.json"
    cfg_path.write_text(json.dumps(cfg))
    for n in layouts:  # markers and results that an earlier, cut-off launch left for layouts run again here
        for stale in work.glob(f"{n}.rank*"):
            stale.unlink()
    env = {**os.environ, **NO_MULTICAST, "PYTHONUNBUFFERED": "1"}
    logs = [work / f"launch{attempt}.rank{r}.log" for r in range(cfg["world"])]
    procs = []
    for r in range(cfg["world"]):
        with open(logs[r], "w") as f:
            procs.append(subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--worker-rank", str(r), "--config", str(cfg_path),
                 "--layouts", ",".join(layouts)], stdout=f, stderr=subprocess.STDOUT, env=env,
                start_new_session=True))
    try:
        started_at = time.time()
        reported: set[str] = set()
        exited_at: float | None = None
        while True:
            time.sleep(0.5)
            done = [n for n in layouts if all((work / f"{n}.rank{r}.pt").exists() for r in range(cfg["world"]))]
            for n in done:
                if n not in reported:
                    reported.add(n)
                    log(f"layout {n} finished")
            current = next((n for n in layouts if n not in done), None)
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                if current is None:
                    return None, ""
                why = f"workers exited (codes {codes}) before layout {current} finished"
                break
            if any(c is not None for c in codes):
                exited_at = exited_at or time.time()
                if time.time() - exited_at > 20:  # a dead peer leaves the other one hanging in a collective
                    why = f"a worker exited (codes {codes}) during layout {current}; the other was stopped"
                    break
            if time.time() > deadline:
                why = f"the run's deadline passed during layout {current}"
                break
            failed = [work / f"{current}.rank{r}.failed" for r in range(cfg["world"])]
            if any(m.exists() for m in failed):  # a rank raised; its peers may be stuck in a collective
                first = min(m.stat().st_mtime for m in failed if m.exists())
                if time.time() - first > 20:
                    why = f"a rank failed in layout {current} and the others did not finish within 20s"
                    break
            marks = [work / f"{current}.rank{r}.started" for r in range(cfg["world"])]
            if any(m.exists() for m in marks):
                began = min(m.stat().st_mtime for m in marks if m.exists())
                if time.time() - began > cfg["layout_timeout"]:
                    why = f"layout {current} ran past --layout-timeout {cfg['layout_timeout']}s"
                    break
            elif current == layouts[0] and time.time() - started_at > cfg["startup_timeout"]:
                why = f"workers did not start (model build, process group) within {cfg['startup_timeout']}s"
                break
    finally:
        kill_all(procs)  # also on Ctrl-C / SIGTERM: the workers run in their own sessions
    why += "".join(f"\n--- launch {attempt} rank {r} log (tail) ---\n{tail(logs[r])}" for r in range(cfg["world"]))
    return current, why


def run_all(cfg: dict, layouts: list[str], budget_s: float) -> dict[str, str]:
    """Every layout, relaunching after a cut-off one; returns {layout: why it has no complete result}."""
    deadline = time.time() + budget_s
    failures: dict[str, str] = {}
    remaining = list(layouts)
    attempt = 0
    while remaining:
        log(f"launch {attempt}: {cfg['world']} workers for {', '.join(remaining)}")
        cut, why = launch(cfg, remaining, attempt, deadline)
        attempt += 1
        if cut is None:
            break
        log(f"launch stopped: {why.splitlines()[0]}")
        failures[cut] = why
        remaining = remaining[remaining.index(cut) + 1:]
        nothing_started = not any(Path(cfg["work"], f"{cut}.rank{r}.started").exists() for r in range(cfg["world"]))
        if nothing_started or time.time() > deadline - 60:
            for n in remaining:
                failures[n] = f"not run: {'the workers never started' if nothing_started else 'no time left'}"
            break
    return failures


# --- the parent: comparisons ----------------------------------------------------------------------------
def load_layout(work: Path, name: str, world: int) -> list[dict] | None:
    import torch

    paths = [work / f"{name}.rank{r}.pt" for r in range(world)]
    return [torch.load(p, weights_only=False) for p in paths if p.exists()] or None


def summarize(ranks: list[dict]) -> tuple[dict, dict]:
    """One layout's numbers from its ranks' results (the returning ranks' loss and log-probs, slowest-rank
    timings)."""
    import torch

    outputs = sorted((r for r in ranks if r["returns_output"]), key=lambda r: r["dp_rank"])
    losses = [r["metrics"]["loss"] for r in outputs]
    norms = [r["metrics"]["grad_norm"] for r in ranks]
    s = {"tp": ranks[0]["tp"], "pp": ranks[0]["pp"], "dp": ranks[0]["dp"], "loss": losses[0],
         "grad_norm": norms[0], "skipped_step": max(r["metrics"]["skipped_step"] for r in ranks),
         "loss_same_on_output_ranks": max(losses) - min(losses) <= 1e-6 * abs(losses[0]),
         "grad_norm_same_on_ranks": max(norms) - min(norms) <= 1e-6 * abs(norms[0])}
    for key in ("build_s", "logprob_s", "step_s", "export_s", "peak_mem_gib"):
        if key in ranks[0]:
            s[key] = max(r[key] for r in ranks)
    names = [set(r["export_sums"]) for r in ranks]
    s["export_same_on_ranks"] = all(n == names[0] for n in names) and all(
        r["export_sums"][k] == ranks[0]["export_sums"][k] for r in ranks for k in names[0])
    order = torch.cat([r["rows"] for r in outputs])
    lp = {}
    for key in ("log_probs_before", "log_probs_after"):
        rows = torch.cat([r[key] for r in outputs])
        lp[key] = torch.empty_like(rows)
        lp[key][order] = rows
    return s, lp


def weight_diffs(ref: dict, got: dict, initial: dict, lr: float, tol: dict, device: str) -> dict:
    """Per-tensor bound ``|got - ref| <= 2 lr + eps(dtype) max|ref|``, the update cosine and moved fractions."""
    import torch

    out: dict = {"same_names": set(ref) == set(got)}
    worst_rel, worst_ratio, worst_name, violations, frac_mismatch = 0.0, 0.0, "", [], []
    dot = na = nb = 0.0
    for name in sorted(set(ref) & set(got)):
        a = got[name].to(device)
        b = ref[name].to(device)
        w0 = initial[name].to(device=device, dtype=b.dtype)
        diff = float((a.float() - b.float()).abs().max())
        scale = float(b.float().abs().max())
        bound = 2 * lr + torch.finfo(b.dtype).eps * scale
        if diff > bound * (1 + 1e-3):
            violations.append(f"{name}: {diff:.3g} > {bound:.3g}")
        if scale > 0 and diff / scale > worst_rel:
            worst_rel, worst_name = diff / scale, name
        worst_ratio = max(worst_ratio, diff / lr)
        ua = (a.float() - w0.float()).double()
        ub = (b.float() - w0.float()).double()
        dot += float((ua * ub).sum())
        na += float((ua * ua).sum())
        nb += float((ub * ub).sum())
        fa, fb = float((ua != 0).double().mean()), float((ub != 0).double().mean())
        if abs(fa - fb) > tol["moved_frac"]:
            frac_mismatch.append(f"{name}: moved {fa:.3f} vs {fb:.3f}")
    out.update(weights_max_abs_diff_over_lr=worst_ratio, weights_max_rel_to_scale=worst_rel,
               weights_worst_tensor=worst_name, weights_bound_violations=violations[:10],
               weights_bound_violation_count=len(violations), moved_fraction_mismatches=frac_mismatch[:10],
               update_cos=dot / math.sqrt(na * nb) if na > 0 and nb > 0 else 0.0,
               update_norm_ratio=math.sqrt(na / nb) if nb > 0 else float("nan"))
    return out


def compare(cfg: dict, layouts: list[str], failures: dict[str, str]) -> dict:
    import torch
    from safetensors.torch import load_file

    work = Path(cfg["work"])
    tol = TOLERANCES[cfg["device"]]
    device = "cuda" if cfg["device"] == "cuda" and torch.cuda.is_available() else "cpu"
    results: dict = {}
    lps: dict = {}
    for name in layouts:
        ranks = load_layout(work, name, cfg["world"])
        entry: dict = {"tensor_parallel": LAYOUTS[name][0], "pipeline_parallel": LAYOUTS[name][1]}
        if failures.get(name):
            entry["error"] = failures[name]
        if ranks:
            errors = [f"rank {r['rank']}: {r['error']}\n{r.get('traceback', '')}" for r in ranks if not r["ok"]]
            if errors:
                entry["error"] = "\n".join(errors) + ("\n" + entry["error"] if "error" in entry else "")
        if ranks and len(ranks) == cfg["world"] and all(r["ok"] for r in ranks):
            s, lps[name] = summarize(ranks)
            entry.update(s)
            entry["ok"] = True
        else:
            entry["ok"] = False
        results[name] = entry

    mask = make_batch(cfg["rows"], cfg["prompt"], cfg["response"], cfg["shape"]["vocab_size"])["response_mask"].bool()
    ref = results.get(REFERENCE, {})
    weights_path = work / f"{REFERENCE}.weights.pt"
    ref_weights = torch.load(weights_path) if ref.get("ok") and weights_path.exists() else None
    initial = {n: t for f in sorted((work / "model").glob("*.safetensors")) for n, t in load_file(str(f)).items()}
    initial = initial or None
    if REFERENCE in lps:
        ref["lp_ref_std"] = float(lps[REFERENCE]["log_probs_before"][mask].std())
        ref["lp_ref_mean"] = float(lps[REFERENCE]["log_probs_before"][mask].mean())
    for name in layouts:
        e = results[name]
        checks: dict[str, bool] = {"ran": e["ok"]}
        if e["ok"]:
            checks["step_taken"] = e["skipped_step"] == 0.0 and math.isfinite(e["loss"]) and e["grad_norm"] > 0
            checks["export_same_on_ranks"] = e["export_same_on_ranks"]
            checks["metrics_same_on_ranks"] = e["loss_same_on_output_ranks"] and e["grad_norm_same_on_ranks"]
        if name != REFERENCE:
            if e["ok"] and ref.get("ok"):
                e["loss_rel_diff"] = abs(e["loss"] - ref["loss"]) / abs(ref["loss"])
                e["grad_norm_rel_diff"] = abs(e["grad_norm"] - ref["grad_norm"]) / abs(ref["grad_norm"])
                for key, short in (("log_probs_before", "lp"), ("log_probs_after", "lp_after")):
                    d = (lps[name][key] - lps[REFERENCE][key]).abs()[mask]
                    e[f"{short}_mean_abs_diff"], e[f"{short}_max_abs_diff"] = float(d.mean()), float(d.max())
                checks["loss"] = e["loss_rel_diff"] <= tol["loss_rel"]
                checks["grad_norm"] = e["grad_norm_rel_diff"] <= tol["grad_norm_rel"]
                checks["log_probs"] = e["lp_mean_abs_diff"] <= tol["lp_mean"] and e["lp_max_abs_diff"] <= tol["lp_max"]
                got_path = work / f"{name}.weights.pt"
                if ref_weights is not None and initial is not None and got_path.exists():
                    got = torch.load(got_path)
                    e.update(weight_diffs(ref_weights, got, initial, cfg["lr"], tol, device))
                    del got
                    checks["weights_bound"] = e["same_names"] and e["weights_bound_violation_count"] == 0
                    checks["weights_update"] = (e["update_cos"] >= tol["update_cos"]
                                                and not e["moved_fraction_mismatches"])
                else:
                    checks["weights_bound"] = checks["weights_update"] = False
            else:
                checks["vs_reference"] = False  # no comparison possible
        e["checks"] = checks
        e["passed"] = all(checks.values())
    if ref_weights is not None and initial is not None:
        moved = max(float((ref_weights[n].float() - initial[n].float()).abs().max()) for n in ref_weights)
        ref["weights_moved_max"] = moved
        ref["checks"]["weights_moved"] = moved > 0
        ref["passed"] = all(ref["checks"].values())
    return results


def fmt(v, spec: str = ".3g") -> str:
    return "-" if v is None else format(v, spec) if isinstance(v, (int, float)) else str(v)


def print_table(results: dict, tol: dict) -> None:
    cols = [("layout", None, "<6"), ("tp", "tp", ">2"), ("pp", "pp", ">2"), ("dp", "dp", ">2"),
            ("loss", "loss", ">9"), ("grad_norm", "grad_norm", ">9"), ("build_s", "build_s", ">7"),
            ("lp_s", "logprob_s", ">6"), ("step_s", "step_s", ">6"), ("export_s", "export_s", ">8"),
            ("mem_GiB", "peak_mem_gib", ">7"), ("loss_rel", "loss_rel_diff", ">8"),
            ("gn_rel", "grad_norm_rel_diff", ">8"), ("lp_mean", "lp_mean_abs_diff", ">8"),
            ("lp_max", "lp_max_abs_diff", ">8"), ("w_diff/lr", "weights_max_abs_diff_over_lr", ">9"),
            ("w_rel", "weights_max_rel_to_scale", ">8"), ("upd_cos", "update_cos", ">7"), ("pass", "passed", ">5")]
    print(" ".join(format(h, f) for h, _, f in cols))
    for name, e in results.items():
        cells = []
        for _h, key, f in cols:
            v = name if key is None else e.get(key)
            if isinstance(v, float) and key in ("build_s", "logprob_s", "step_s", "export_s", "peak_mem_gib"):
                s = f"{v:.2f}"
            elif isinstance(v, bool):
                s = "PASS" if v else "FAIL"
            else:
                s = fmt(v, ".4g" if key in ("loss", "grad_norm") else ".2g")
            cells.append(format(s, f))
        print(" ".join(cells))
    print(f"tolerances: {tol}  (weights: |diff| <= 2*lr + eps(dtype)*max|w| per tensor)")
    for name, e in results.items():
        bad = [k for k, ok in e.get("checks", {}).items() if not ok]
        if bad:
            print(f"{name}: FAILED {bad}")
            for key in ("weights_bound_violations", "moved_fraction_mismatches"):
                if e.get(key):
                    print(f"  {key}: {e[key]}")
            if e.get("error"):
                print("  " + e["error"][-2500:].replace("\n", "\n  "))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default: qwen2.5-0.5b on cuda, tiny on cpu")
    p.add_argument("--out", type=Path, required=False, default=None, help="where to write the JSON results")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"subset of {','.join(LAYOUTS)} (tp1 is the reference)")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 64 for qwen2.5-0.5b, 16 tiny)")
    p.add_argument("--response", type=int, default=None, help="response tokens (default 64 / 16)")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--budget", type=float, default=270.0, help="seconds for all launches (then what finished is "
                                                                  "compared and reported)")
    p.add_argument("--layout-timeout", type=float, default=120.0)
    p.add_argument("--startup-timeout", type=float, default=150.0)
    p.add_argument("--workdir", type=Path, default=None, help="default: a temporary folder, removed at the end")
    p.add_argument("--keep", action="store_true", help="keep the work folder (model, weights, logs)")
    p.add_argument("--worker-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--config", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.worker_rank is not None:
        worker(args.worker_rank, json.loads(args.config.read_text()), args.layouts.split(","))
        return

    t_start = time.perf_counter()
    shape_name = args.shape or ("qwen2.5-0.5b" if args.device == "cuda" else "tiny")
    seq = 64 if shape_name == "qwen2.5-0.5b" else 16
    layouts = [n.strip() for n in args.layouts.split(",") if n.strip()]
    unknown = [n for n in layouts if n not in LAYOUTS]
    if unknown:
        p.error(f"unknown layouts {unknown}; choose from {list(LAYOUTS)}")
    if REFERENCE not in layouts:
        layouts.insert(0, REFERENCE)
    layouts.sort(key=list(LAYOUTS).index)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="tp_pp_gpu_"))
    work.mkdir(parents=True, exist_ok=True)
    for pattern in ("*.rank*", "*.weights.pt*"):  # an earlier run's results in a kept --workdir (not its model)
        for stale in work.glob(pattern):
            stale.unlink()
    if args.device == "cuda":
        import torch

        if torch.cuda.device_count() < args.world:
            p.error(f"--device cuda needs {args.world} GPUs, this process sees {torch.cuda.device_count()}")
    cfg = {"device": args.device, "dtype": "bfloat16" if args.device == "cuda" else "float32",
           "shape_name": shape_name, "shape": SHAPES[shape_name], "world": args.world, "rows": args.rows,
           "prompt": args.prompt or seq, "response": args.response or seq, "micro_batch": args.micro_batch,
           "lr": args.lr, "grad_clip": args.grad_clip, "bucket_bytes": 256 << 20, "work": str(work),
           "layout_timeout": args.layout_timeout, "startup_timeout": args.startup_timeout,
           "collective_timeout": max(args.layout_timeout, args.startup_timeout) + 60}
    if args.rows % args.world:
        p.error("--rows must divide over the data-parallel ranks of tp1 (--world)")
    log(f"{args.device}: {shape_name} {cfg['dtype']}, {args.world} ranks, batch {args.rows} x ({cfg['prompt']} + "
        f"{cfg['response']}), micro-batch {args.micro_batch}, lr {args.lr}, layouts {layouts}, work {work}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the workers too (launch's finally)
    try:
        failures = run_all(cfg, layouts, args.budget)
        log("comparing")
        results = compare(cfg, layouts, failures)
    finally:
        if args.workdir is None and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    tol = TOLERANCES[args.device]
    print_table(results, tol)
    passed = all(e.get("passed", False) for e in results.values())
    report = {"issue": 12, "config": {k: v for k, v in cfg.items() if k != "work"}, "reference": REFERENCE,
              "tolerances": tol, "results": results, "passed": passed,
              "elapsed_s": time.perf_counter() - t_start}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2, default=str))
        log(f"written to {args.out}")
    log(f"{'PASSED' if passed else 'FAILED'} in {report['elapsed_s']:.0f}s")
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
