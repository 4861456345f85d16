"""Where vLLM's generation time goes at the standard step's shape, and what the engine's settings change.

The 0.5B step's generation phase (512 rows x 256 new tokens, EOS ignored) runs at 30-55k tokens/s on one H200,
varying from call to call, while the device's kernels would allow several times that: the decode loop is bound
by the host's Python. This measures it, one process per variant (each starts its own engine), the same random
weights and prompts:

* ``inproc``: the engine as hybridrl builds it (``VLLMRollout``: the in-process engine core, vLLM joining a
  one-rank process group as an external launcher, as in a colocated worker), each repeat driven two ways,
  interleaved: ``llm_generate`` (``LLM.generate``, vLLM's output processor making ``RequestOutput`` objects),
  ``direct`` (``hybridrl_vllm.compat.generate_direct``: the engine core stepped directly), and the rollout
  engine's own calls as a step makes them (``rollout``: ``generate``; ``rollout_logprobs``: the same returning
  the sampled tokens' log-probs; ``rollout_until``: ``generate_until``, as groups in flight call it). For each,
  host seconds per engine step by phase (``schedule``, ``execute`` the launch, ``sample``, ``update`` the
  scheduler's bookkeeping, ``outputs`` the output processor, ``wait`` the rest of the core's step: mostly
  waiting for the device), and the device's kernel seconds of one profiled repeat (``torch.profiler``).
* ``inproc_async_off``: the same with ``async_scheduling: false`` (vLLM's default is on where the executor allows).
* ``mp``: vLLM's own offline path (``LLM`` with its engine core in a process of its own), no process group.
* ``inproc+key=value+...``: ``inproc`` with more of vLLM's engine arguments (JSON values), e.g.
  ``inproc+enable_prefix_caching=false+block_size=64``.

Writes ``gen_profile_<shape>.json``: tokens/s per repeat and their median per variant and path.

    python benchmarks/gen_profile.py                       # on one GPU (see benchmarks/gpu)
    python benchmarks/gen_profile.py --variants inproc --repeats 4
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

VARIANTS = ("inproc", "inproc_async_off", "mp")


def prompts(n_prompts: int, n_samples: int, prompt_len: int, vocab: int = 150000) -> list[list[int]]:
    """``n_prompts`` random prompts of ``prompt_len`` tokens, each repeated ``n_samples`` times (a GRPO group)."""
    rng = random.Random(0)
    distinct = [[rng.randrange(100, vocab) for _ in range(prompt_len)] for _ in range(n_prompts)]
    return [p for p in distinct for _ in range(n_samples)]


class PhaseTimer:
    """Seconds spent inside named methods of live objects (wrapped in place)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, obj: Any, name: str, label: str) -> None:
        fn = getattr(obj, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start
                self.calls[label] += 1
        setattr(obj, name, timed)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def per_step_ms(self) -> dict[str, float]:
        steps = max(self.calls.get("core_step", 0), 1)
        out = {k: 1000 * v / steps for k, v in self.seconds.items()}
        inner = sum(out.get(k, 0.0) for k in ("schedule", "execute", "sample", "update"))
        out["wait"] = out.get("core_step", 0.0) - inner
        out["steps"] = float(steps)
        return out


def _engine_facts(llm: Any) -> dict[str, Any]:
    cfg = llm.llm_engine.vllm_config
    comp = cfg.compilation_config
    return {"async_scheduling": cfg.scheduler_config.async_scheduling,
            "max_num_seqs": cfg.scheduler_config.max_num_seqs,
            "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
            "cudagraph_mode": str(getattr(comp, "cudagraph_mode", None)),
            "max_cudagraph_capture_size": getattr(comp, "max_cudagraph_capture_size", None),
            "executor": type(getattr(getattr(llm.llm_engine.engine_core, "engine_core", None), "model_executor",
                                     None)).__name__}


def _kernel_seconds(fn: Callable[[], Any]) -> float:
    """Device kernel seconds of one call (``torch.profiler``, CUDA activity; kernels inside CUDA graphs count)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e6


def rollout_paths(rollout: Any, rows: list[list[int]], new_tokens: int, samples: int) -> dict[str, Callable[[], int]]:
    """The rollout engine's own calls on the same rows, as a step makes them: ``rollout`` (``generate``, the
    synchronous step: no log-probs), ``rollout_logprobs`` (``generate`` returning the sampled tokens' log-probs)
    and ``rollout_until`` (``generate_until`` of groups in flight: log-probs, each row's cap, stopping once every
    group is complete). Each returns the tokens generated."""
    from hybridrl.engines import SamplingParams
    from hybridrl.engines.batch import PROMPT_IDS, PROMPT_MASK, RESPONSE_MASK
    from hybridrl.testing.partial import requests

    pad = rollout.pad_id
    batch = requests(rows, pad, [new_tokens] * len(rows), [i // samples for i in range(len(rows))])
    plain = batch.select(PROMPT_IDS, PROMPT_MASK)

    def params(logprobs: bool) -> SamplingParams:
        return SamplingParams(temperature=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens, ignore_eos=True,
                              seed=0, logprobs=logprobs)

    def tokens(out: Any) -> int:
        return int(out[RESPONSE_MASK].sum())

    return {"rollout": lambda: tokens(rollout.generate(plain, params(False))),
            "rollout_logprobs": lambda: tokens(rollout.generate(plain, params(True))),
            "rollout_until": lambda: tokens(rollout.generate_until(batch, params(True), 1.0))}


def worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", "bfloat16") if cuda else ("cpu", "float32")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    rows = prompts(args.prompts, args.samples, args.prompt_len, args.vocab)
    tokens = len(rows) * args.new_tokens
    out: dict[str, Any] = {"variant": args.variant, "rows": len(rows), "new_tokens": args.new_tokens}
    t0 = time.perf_counter()
    if args.variant == "mp":
        from vllm import LLM
        llm = LLM(model=args.model, dtype=dtype, skip_tokenizer_init=True, seed=0, enable_sleep_mode=cuda,
                  gpu_memory_utilization=args.gpu_memory_utilization, disable_log_stats=True)
    else:
        from hybridrl.engines import EngineContext
        from hybridrl.runtime.distributed import free_port, init_process_group
        from hybridrl_vllm.engine import VLLMRollout

        os.environ.setdefault("LOCAL_RANK", "0")
        init_process_group(0, 1, "127.0.0.1", free_port(), device)
        options: dict[str, Any] = {"gpu_memory_utilization": args.gpu_memory_utilization}
        base, *settings = args.variant.split("+")
        engine_kwargs = {k: json.loads(v) for k, _, v in (item.partition("=") for item in settings)}
        if base == "inproc_async_off":
            engine_kwargs["async_scheduling"] = False
        if engine_kwargs:
            options["engine_kwargs"] = engine_kwargs
        ctx = EngineContext(role="rollout", backend="vllm", trainable=False, options=options, model_path=args.model,
                            rank=0, world_size=1, device=device, dtype=dtype, seed=0)
        rollout = VLLMRollout(ctx)
        llm = rollout.llm
    out["engine_build_s"] = time.perf_counter() - t0
    out["engine"] = _engine_facts(llm)
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    def params() -> Any:
        return SamplingParams(temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True, detokenize=False)

    vprompts = [TokensPrompt(prompt_token_ids=p) for p in rows]

    def llm_generate() -> int:
        outs = llm.generate(vprompts, params(), use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    paths: dict[str, Callable[[], int]] = {"llm_generate": llm_generate}
    timer = PhaseTimer()
    if args.variant != "mp":
        from hybridrl_vllm import compat

        def direct() -> int:
            return sum(len(t) for t, _ in compat.generate_direct(llm, vprompts, [params() for _ in vprompts]))
        paths["direct"] = direct
        paths.update(rollout_paths(rollout, rows, args.new_tokens, args.samples))
        core = llm.llm_engine.engine_core.engine_core
        timer.wrap(llm.llm_engine.engine_core, "get_output", "core_step")
        timer.wrap(core.scheduler, "schedule", "schedule")
        timer.wrap(core.scheduler, "update_from_output", "update")
        timer.wrap(core.model_executor, "execute_model", "execute")
        timer.wrap(core.model_executor, "sample_tokens", "sample")
        timer.wrap(llm.llm_engine.output_processor, "process_outputs", "outputs")
    for name, fn in paths.items():  # warm-up: the first calls fill caches and settle the allocator
        assert fn() == tokens, f"{name}: wrong token count"
        fn()
    samples: dict[str, list[float]] = {name: [] for name in paths}
    phases: dict[str, list[dict[str, float]]] = {name: [] for name in paths}
    for _ in range(args.repeats):
        for name, fn in paths.items():
            timer.reset()
            sync()
            start = time.perf_counter()
            n = fn()
            sync()
            seconds = time.perf_counter() - start
            samples[name].append(n / seconds)
            if args.variant != "mp":
                phases[name].append(timer.per_step_ms())
    out["tokens_per_s"] = samples
    out["tokens_per_s_median"] = {k: statistics.median(v) for k, v in samples.items()}
    if args.variant != "mp":
        out["host_ms_per_step_median"] = {name: {k: statistics.median(p[k] for p in rows_) for k in rows_[0]}
                                          for name, rows_ in phases.items() if rows_}
    if args.variant != "mp" and cuda:
        start = time.perf_counter()
        kernels = _kernel_seconds(llm_generate)
        out["profiled_llm_generate"] = {"wall_s": time.perf_counter() - start, "kernel_s": kernels}
    return out


def run_variant(variant: str, args: argparse.Namespace, model: Path) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        path = tmp.name
    cmd = [sys.executable, __file__, "--worker", "--variant", variant, "--model", str(model), "--worker-out", path,
           "--repeats", str(args.repeats), "--prompts", str(args.prompts), "--samples", str(args.samples),
           "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens), "--vocab", str(args.vocab),
           "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    env = dict(os.environ)
    if variant == "mp":
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"  # this process has touched CUDA: a forked core cannot
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, timeout=args.timeout)
        result = json.loads(Path(path).read_text()) if proc.returncode == 0 else {"returncode": proc.returncode}
    except subprocess.TimeoutExpired:
        result = {"error": f"timed out after {args.timeout}s"}
    result["wall_s"] = time.perf_counter() - start
    print(json.dumps({variant: {k: result.get(k) for k in ("tokens_per_s_median", "host_ms_per_step_median",
                                                          "profiled_llm_generate", "engine", "wall_s")}}), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="0.5b")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=150000, help="prompt token ids are drawn below it")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--workdir", default="/tmp/model-sizes")
    parser.add_argument("--model-dir", default=None, help="an existing model folder instead of --size's random one")
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        Path(args.worker_out).write_text(json.dumps(worker(args)))
        return
    from model_sizes import ensure_model

    model = Path(args.model_dir) if args.model_dir else ensure_model(args.size, "bfloat16", Path(args.workdir))[0]
    results = {"benchmark": "gen_profile", "size": args.size, "workload": {
        "prompts": args.prompts, "samples": args.samples, "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens}, "variants": {}}
    for variant in args.variants.split(","):
        results["variants"][variant] = run_variant(variant, args, model)
    out = Path(args.out or HERE / "results" / f"gen_profile_{args.size}.json")
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
