"""The device-map advisor's predicted step against measured runs of the same maps.

``hybridrl plan --advise`` ranks maps by a cost model fitted from one profiled run; this checks that model where
it matters, on maps it was not fitted from. It (1) trains the config as given for ``--steps`` steps into a fresh
folder (the profile), (2) fits the cost model on it (``fit_profile``) and ranks the cluster's candidate maps
(``advise``), (3) trains the config with each chosen candidate's overrides for ``--steps`` steps and takes the
mean ``timing/step`` after the first ``--skip`` steps (the profile run is the measurement of its own map when
that map is a candidate), and (4) prints the table and merges the rows into ``--out``, replacing those of the same
(device, map, workload), so CPU and GPU rows live in one file. A run that fails or times out becomes a row with
an ``error``. ``--rounds N`` runs the arms back to back N times (a shared machine drifts): the measured figure
is the mean of the rounds, ``spread_s`` their range. On CPU (``--control``) each round first trains the profile's
own map again, and each row's ``vs_control`` compares the map with that control of its round: how far the
advisor's figure relative to the profile's map held, apart from the machine's drift since the profile.
``--budget S`` keeps the whole call inside S seconds (a GPU host's limit on one command): a map starts only when
the longest run of the call so far would still end in time, and the same command again with ``--reuse`` trains
the maps left out.

    python benchmarks/advice_validation.py --rounds 3                      # CPU: quick start, 1x2
    python benchmarks/advice_validation.py --config examples/configs/qwen2.5-0.5b --steps 6 --skip 2   # 1 GPU

A model-shape folder (``examples/configs/<shape>``, a ``config.json`` of a Hugging Face model) as ``--config`` runs
the standard GRPO workload of ``benchmarks/model_sizes.py`` on random weights built by its helpers (or on
``--model-path``); trailing ``key=value`` overrides go to every run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))

from grpo_step import STANDARD, write_prompts  # noqa: E402
from model_sizes import SHAPES, ensure_model, train_run, workload_config  # noqa: E402  (benchmarks/: no package)
from run_steps import steady_steps  # noqa: E402

#: keys every run gets: a fresh folder, no checkpoints, metrics as JSON lines only
RUN_KEYS = ["trainer.save_every=0", "trainer.trackers=[jsonl]", "trainer.progress=false"]
#: the file in a run folder that names its arm (``arm_key``), for ``--reuse``
ARM_KEY = "advice_arm.json"
#: what the generation did, kept beside the phases: the rounds, tokens resumed, thrown away and carried in flight
ROLLOUT_METRICS = ("rollout/", "async/", "gen/")
#: each phase's NVML busy share of its devices (``busy/<phase>``, GPUs with nvidia-ml-py) and the step's
BUSY_METRICS = ("busy/", "device/")
#: the phases compared per row (measured ``timing/<phase>`` means beside the predicted seconds)
PHASES = ("wake", "gen", "sleep", "reward", "ref", "old_log_prob", "values", "update_critic", "update_actor", "reshard")


# --- what runs where ------------------------------------------------------------------------------------------
def gpu_names() -> list[str]:
    """The GPUs' names from ``nvidia-smi`` (the driver opens no CUDA context on a GPU the runs will use)."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def device_label(device: str) -> str:
    """The row's device: the GPU's name (and count), or the CPU's cores; no host name."""
    if device == "cuda":
        names = gpu_names()
        return f"{len(names)}x {names[0]}" if names else "cuda"
    return f"cpu {os.cpu_count() or 1} cores ({platform.machine()})"


def shape_size(config: Path) -> str | None:
    """The ``model_sizes`` size whose shape folder ``config`` is (``examples/configs/qwen2.5-0.5b`` -> 0.5b)."""
    if not config.is_dir():
        return None
    return next((size for size, folder in SHAPES.items() if folder == config.name), None)


def workload_file(args: argparse.Namespace, size: str, workdir: Path) -> Path:
    """The standard workload's run config for a model-shape folder, written by ``model_sizes``' helpers: random
    weights built once into ``workdir`` (or ``--model-path``), prompts enough for every step."""
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    model_dir = Path(args.model_path) if args.model_path else ensure_model(size, dtype, workdir)[0]
    data = workdir / "prompts.jsonl"
    write_prompts(data, args.prompts * max(args.steps, 1), args.prompt_len)
    shape = argparse.Namespace(device=args.device, prompt_len=args.prompt_len, prompts=args.prompts,
                               samples=args.samples, backend=args.backend, new_tokens=args.new_tokens,
                               steps=args.steps)
    cfg = workload_config(shape, size, model_dir, data, workdir / "unused")
    path = workdir / f"config-{size}.json"
    path.write_text(json.dumps(cfg))
    return path


# --- the call's seconds ---------------------------------------------------------------------------------------
@dataclass
class CallBudget:
    """The seconds one call may take (``--budget``; None: no limit). A run starts only when the longest run the
    call has trained so far would end inside what is left (a reused run, read and not trained, teaches nothing),
    and no run may outlast the budget: a call cut short by the host would leave its engine holding the GPU."""

    seconds: float | None
    margin: float = 15.0  # the rows' writing and the report after the last run
    start: float = field(default_factory=time.perf_counter)
    longest: float = 0.0

    def left(self) -> float:
        return float("inf") if self.seconds is None else self.seconds - (time.perf_counter() - self.start)

    def room(self) -> bool:
        """Whether another run can start: the longest so far fits in what is left, less the margin."""
        return self.left() - self.margin > self.longest

    def timeout(self, timeout: float) -> float:
        """A run's timeout: ``timeout``, or what is left of the budget when that is less."""
        return min(timeout, self.left() - self.margin)

    def spent(self, run: dict[str, Any]) -> None:
        self.longest = max(self.longest, float(run.get("wall_s") or 0.0))


# --- one run --------------------------------------------------------------------------------------------------
def run_arm(config: Path, overrides: list[str], steps: int, skip: int, out: Path, timeout: float,
            reuse: bool = False) -> dict[str, Any]:
    """Train ``config`` with ``overrides`` into ``out`` (made fresh) and read its steps back: the mean step after
    ``skip``, every step's seconds, the phases' means; ``error`` when it failed or finished fewer steps. With
    ``reuse``, a folder that already holds this arm's finished steps (same config, overrides, steps) is read
    instead of trained again: a second call on the same GPU host measures new maps against the same profile."""
    rows = read_metrics(out) if reuse and finished(config, overrides, steps, out) else []
    if rows:  # the same arm, finished by an earlier call on this machine
        print(f"  reusing {out} ({len(rows)} steps)", flush=True)
        code, log, wall = 0, "", 0.0
    else:
        shutil.rmtree(out, ignore_errors=True)
        code, log, wall = train_run(config, [*overrides, f"trainer.steps={steps}", f"trainer.out={out}",
                                             *RUN_KEYS], timeout)
        rows = read_metrics(out)
        if out.is_dir():
            (out / ARM_KEY).write_text(json.dumps(arm_key(config, overrides, steps)))
    result: dict[str, Any] = {"folder": str(out), "wall_s": round(wall, 1), "returncode": code,
                              "step_seconds": [round(r["timing/step"], 4) for r in rows if "timing/step" in r]}
    later = steady_steps(rows, skip)
    if later:
        result["mean_step_s"] = statistics.fmean(r["timing/step"] for r in later)
        result["steady_seconds"] = [round(r["timing/step"], 4) for r in later]
        result["steady_steps"] = [r["step"] for r in later]
        result["phases_s"] = {p: statistics.fmean(r.get(f"timing/{p}", 0.0) for r in later) for p in PHASES
                              if any(f"timing/{p}" in r for r in later)}
        for field, prefixes in (("rollout", ROLLOUT_METRICS), ("busy", BUSY_METRICS)):
            result[field] = {k: statistics.fmean(r.get(k, 0.0) for r in later) for k in sorted(
                {k for r in later for k in r if k.startswith(prefixes)})}
    if code != 0 or len(rows) < steps or not later:
        what = "timed out" if code == -1 else f"exit status {code}"
        result["error"] = f"{what}, {len(rows)} of {steps} steps: {error_line(log)[-300:]}"
        result["log_tail"] = log[-3000:]
    return result


def error_line(log: str) -> str:
    """The log's last line that names an error (a run's last line is often a hint printed after it), else its
    last line."""
    lines = [line.strip() for line in log.strip().splitlines() if line.strip()] or ["(no output)"]
    return next((line for line in reversed(lines) if "Error" in line or "error:" in line), lines[-1])


def finished(config: Path, overrides: list[str], steps: int, out: Path) -> bool:
    """Whether ``out`` holds this arm's ``steps`` steps, trained by an earlier call (``--reuse`` reads it)."""
    return _read_json(out / ARM_KEY) == arm_key(config, overrides, steps) and len(read_metrics(out)) >= steps


def arm_key(config: Path, overrides: list[str], steps: int) -> dict[str, Any]:
    """What makes two runs the same arm: the config's text, the overrides and the step count."""
    return {"config": config.read_text() if config.is_file() else str(config), "overrides": list(overrides),
            "steps": steps}


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def profile_started(folder: Path) -> str | None:
    """When the run in ``folder`` began (its first span, UTC, ISO 8601): which profile a GPU row was measured
    against (``row_key``)."""
    try:
        with (folder / "spans.jsonl").open() as f:
            first = json.loads(f.readline())
    except (OSError, ValueError):
        return None
    start = first.get("start") if isinstance(first, dict) else None
    if not isinstance(start, (int, float)):
        return None
    return datetime.datetime.fromtimestamp(start, datetime.timezone.utc).isoformat(timespec="seconds")


def read_metrics(folder: Path) -> list[dict[str, Any]]:
    path = folder / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return sorted((r for r in rows if "step" in r), key=lambda r: r["step"])


# --- the advice -----------------------------------------------------------------------------------------------
def ranked_maps(config: Path, overrides: list[str], cluster: Any,
                profile_dir: Path | None) -> tuple[list[Any], Any, Any]:
    """The candidates ranked as ``hybridrl plan --advise --profile`` ranks them (its planner, shape and
    registry), the fitted profile (``profile_dir`` None: the default one, as without ``--profile``), and the
    profile run's own map as planned (``Planned``)."""
    from hybridrl.config import load_config
    from hybridrl.placement.advice.advise import advise, plan_candidate
    from hybridrl.placement.advice.profile import default_profile, fit_profile
    from hybridrl.placement.memory import (
        MemoryEstimateError,
        model_shape,
        model_shapes_by_role,
        planned_device_memory_bytes,
    )
    from hybridrl.plugins.discovery import get_registry
    from hybridrl.plugins.registry import RegistryError
    from hybridrl.run.preflight import with_algorithm_roles

    cfg = load_config(config, overrides)
    registry = get_registry(tuple(cfg.plugins))
    bases = (config.resolve().parent, config.resolve().parent.parent)
    try:
        shape, _ = model_shape(cfg, None, bases)
    except MemoryEstimateError:
        shape = None
    if profile_dir is None:
        profile = default_profile(cluster.device, shape.active_param_count() if shape else None)
    else:
        profile = fit_profile(profile_dir)
    memory = planned_device_memory_bytes(cluster.device, cfg.cluster.device_memory_gb, local=True)  # runs here
    planner = plan_candidate(cluster, registry, memory, shape, model_shapes_by_role(cfg, bases))
    try:
        rollout_tp = registry.backend("rollout", cfg.roles.rollout.backend).can("tensor_parallel")
    except RegistryError:
        rollout_tp = True
    ranked = advise(config, overrides, cluster, profile, planner, rollout_tp=rollout_tp, registry=registry)
    own = planner(with_algorithm_roles(cfg, registry)[0], None)
    return ranked, profile, own


def as_given(own: Any, profile: Any) -> Any:
    """The profile run's own map as a ranked entry (predicted from the profile fitted on it): the fit checked
    on the steps it was fitted from, for a map that is no candidate of the cluster (quick start: 1 of 2 slots)."""
    from hybridrl.placement.advice.advise import Ranked
    from hybridrl.placement.advice.candidates import Candidate
    from hybridrl.placement.advice.predict import predict

    layout, tp, pipelined, _mode = signature(own.cfg, own.plan)
    kind = "pipelined" if pipelined else "colocated" if len(layout) == 1 else "split"
    label = ":".join(f"{'+'.join(roles)} {n}" for roles, n in layout)
    candidate = Candidate(f"as given ({kind} {label})", kind, tuple((pool, 1, len(d)) for pool, d in
                                                                    own.plan.pools.items()), tp, ())
    return Ranked(candidate, own, predict(candidate, own.cfg, own.plan, profile, own.reshard, own.shape,
                                          own.log_prob_cost))


def signature(cfg: Any, plan: Any) -> tuple[Any, ...]:
    """What makes two configs the same device map: each pool's roles and device count, the rollout's tensor
    parallelism, pipelined or not, the trainer's mode (an in-flight map is not its synchronous twin) (pool names
    aside: the profile's ``main`` is a candidate's ``main``)."""
    pools = {pool: [] for pool in plan.pools}
    for role, pool in plan.role_pool.items():
        pools[pool].append(role)
    layout = tuple(sorted((tuple(sorted(roles)), len(plan.pools[pool])) for pool, roles in pools.items() if roles))
    return layout, max(1, cfg.roles.rollout.tensor_parallel), bool(cfg.trainer.pipelined), cfg.trainer.mode


def choose(ranked: list[Any], wanted: list[str], device: str) -> list[Any]:
    """The candidates to validate: those named (a name, or a kind: the best-ranked of that kind), else on CPU
    the best map of every kind, on a GPU the colocated one."""
    kept = [r for r in ranked if r.prediction is not None]
    if not wanted:
        wanted = ["colocated", "split", "pipelined", "in_flight", "fractional"] if device == "cpu" else ["colocated"]
    out: list[Any] = []
    for name in wanted:
        match = next((r for r in ranked if r.candidate.name == name), None) or \
            next((r for r in kept if r.candidate.kind == name), None)
        if match is None:
            raise SystemExit(f"advice_validation: no candidate map '{name}' (maps: "
                             f"{', '.join(r.candidate.name for r in ranked)})")
        if match not in out:
            out.append(match)
    return out


# --- the result file ------------------------------------------------------------------------------------------
def profile_key(row: dict[str, Any]) -> tuple[Any, ...]:
    """Which profile run a row (or a run's context) was measured against: its (device, workload), on a GPU also
    the run's start (``profile_started``), so that the rows of each GPU machine stay beside their own profile:
    machines of one kind differ by up to 1.5x, and the one-GPU fits (``fit_one_gpu_maps.py``) pair each map with
    its own. CPU rows of a new profile replace the old ones."""
    key = (row.get("device"), row.get("workload"))
    return key if str(row.get("device", "")).startswith("cpu") else (*key, row.get("profile_started"))


def row_key(row: dict[str, Any]) -> tuple[Any, ...]:
    """What a new row replaces: the row of the same map against the same profile (``profile_key``)."""
    return (*profile_key(row), row.get("map"))


def merge(path: Path, rows: list[dict[str, Any]], context: dict[str, Any]) -> dict[str, Any]:
    """The file's rows with those of the same ``row_key`` replaced; ``runs`` keeps each (device, workload)'s
    context (command, steps, profile), per profile run on a GPU."""
    data: dict[str, Any] = {}
    if path.is_file():
        try:
            data = json.loads(path.read_text())
        except ValueError:
            data = {}
    new = {row_key(r) for r in rows}
    kept = [r for r in data.get("rows", []) if row_key(r) not in new]
    runs = [c for c in data.get("runs", []) if profile_key(c) != profile_key(context)]
    return {"benchmark": "advice_validation",
            "about": "predicted step (hybridrl plan --advise, fitted from the profile run) against the mean "
                     "measured timing/step after the warm-up steps (a pipelined run's last step, a drain that only "
                     "trains, left out); ratio = measured / predicted",
            "rows": kept + rows, "runs": runs + [context]}


def table(rows: list[dict[str, Any]]) -> str:
    head = ("map", "predicted s", "measured s", "ratio", "vs control", "spread s", "note")
    lines = [head]
    for r in rows:
        spread = r.get("spread_s")
        lines.append((r["map"], _num(r.get("predicted_step_s")), _num(r.get("measured_step_s")),
                      _num(r.get("ratio"), "{:.2f}"), _num(r.get("vs_control"), "{:.2f}"),
                      f"{spread[0]:.3f}-{spread[1]:.3f}" if spread else "-",
                      r.get("error") or ("profile run" if r.get("profile_run") else "")))
    widths = [max(len(line[c]) for line in lines) for c in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)


def _num(value: Any, fmt: str = "{:.3f}") -> str:
    return "-" if value is None else fmt.format(value)


# --- main -----------------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="examples/quickstart.yaml",
                        help="a run config, or a model-shape folder (examples/configs/qwen2.5-0.5b)")
    parser.add_argument("--cluster", default=None, help="NODESxDEVICES the maps are made for (default: detected)")
    parser.add_argument("--maps", default="", help="comma-separated candidate names or kinds (colocated, split, "
                                                  "pipelined, in_flight, fractional); default: CPU all five "
                                                  "kinds, a GPU colocated")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--skip", type=int, default=1, help="warm-up steps left out of the mean")
    parser.add_argument("--rounds", type=int, default=1, help="run the arms back to back this many times")
    parser.add_argument("--control", action=argparse.BooleanOptionalAction, default=None,
                        help="train the profile's own map again at the start of every round, the control each "
                             "arm of the round is compared with (default: on CPU, where the machine drifts)")
    parser.add_argument("--workload", default=None, help="the rows' workload label (default: the config's name)")
    parser.add_argument("--out", default=str(RESULTS / "advice_validation.json"))
    parser.add_argument("--workdir", default=None, help="run folders and built models (default: a fresh temp)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for one run")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for the whole call: maps that would not end in time are left for the same "
                             "command with --reuse")
    parser.add_argument("--reuse", action="store_true",
                        help="read a run folder in --workdir that already finished the same arm instead of "
                             "training it again (a second call on the same machine)")
    parser.add_argument("--model-path", default=None, help="a model-shape config: use this model folder")
    parser.add_argument("--backend", default="vllm", help="a model-shape config: the rollout backend")
    parser.add_argument("--prompts", type=int, default=STANDARD["prompts"])
    parser.add_argument("--samples", type=int, default=STANDARD["samples"])
    parser.add_argument("--prompt-len", type=int, default=STANDARD["prompt_len"])
    parser.add_argument("--new-tokens", type=int, default=STANDARD["new_tokens"])
    parser.add_argument("override", nargs="*", help="config overrides (key=value) for every run")
    args = parser.parse_args()
    if args.skip >= args.steps:
        raise SystemExit("advice_validation: --skip must leave steps to measure")
    if args.budget is not None and args.budget <= 60:
        raise SystemExit(f"advice_validation: --budget {args.budget:g} leaves no time for a run (give more than 60 s)")

    from hybridrl.cli import parse_cluster
    from hybridrl.placement.plan import ClusterSpec

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="advice-validation-"))
    workdir.mkdir(parents=True, exist_ok=True)
    given = Path(args.config)
    size = shape_size(given)
    args.device = "cuda" if gpu_names() else "cpu"
    if given.is_dir() and size is None:
        raise SystemExit(f"advice_validation: {given} is no known model-shape folder ({', '.join(SHAPES.values())})")
    config = workload_file(args, size, workdir) if size else given
    workload = args.workload or (f"{size} grpo {args.prompts}x{args.samples} {args.prompt_len}+{args.new_tokens} "
                                 f"{args.backend}" if size else given.stem)
    overrides = list(args.override)
    if args.cluster:  # a declared cluster: the runs place on it too (CPU slots may oversubscribe the cores)
        cluster = parse_cluster(args.cluster, args.device)
        overrides += [f"cluster.device={args.device}", f"cluster.nodes={cluster.nodes}",
                      f"cluster.devices_per_node={cluster.devices_per_node}"]
    else:
        count = len(gpu_names()) if args.device == "cuda" else (os.cpu_count() or 1)
        cluster = ClusterSpec(1, count, args.device, declared=True)
    device = device_label(args.device)
    command = " ".join(["python", "benchmarks/advice_validation.py", *sys.argv[1:]])
    print(f"advice_validation: {workload} on {device}, maps for {cluster.describe()}, {args.steps} steps "
          f"(skip {args.skip}) x {args.rounds} round(s); runs in {workdir}", flush=True)

    start = time.perf_counter()
    out = Path(args.out)
    profile_dir = workdir / "profile"
    budget = CallBudget(args.budget)
    profile_run = run_arm(config, overrides, args.steps, args.skip, profile_dir, budget.timeout(args.timeout),
                          args.reuse)
    budget.spent(profile_run)
    print(f"profile: {profile_run.get('mean_step_s', float('nan')):.3f} s a step ({profile_run['wall_s']} s)",
          flush=True)
    context: dict[str, Any] = {"device": device, "workload": workload, "command": command, "config": str(given),
                               "overrides": overrides, "cluster": cluster.describe(), "steps": args.steps,
                               "skip": args.skip, "rounds": args.rounds, "profile_step_s": profile_run.get(
                                   "mean_step_s"), "profile_step_seconds": profile_run["step_seconds"],
                               "profile_started": profile_started(profile_dir)}
    rows: list[dict[str, Any]] = []
    try:
        ranked, profile, own = ranked_maps(config, overrides, cluster, profile_dir)
    except Exception as exc:  # noqa: BLE001  (a failed profile or fit is the file's answer, not a crash)
        error = profile_run.get("error") or f"{type(exc).__name__}: {exc}"
        context["error"] = error
        rows.append({"device": device, "map": "(profile)", "workload": workload, "predicted_step_s": None,
                     "measured_step_s": profile_run.get("mean_step_s"), "error": error[:500],
                     "log_tail": profile_run.get("log_tail", "")})
        ranked, profile, own = [], None, None
    if ranked:
        mine = signature(own.cfg, own.plan) if own is not None and own.plan is not None else None
        context["profile"] = {k: v for k, v in vars(profile).items() if k not in ("bandwidth",)}
        chosen = choose(ranked, [m.strip() for m in args.maps.split(",") if m.strip()], args.device)
        measured: dict[str, list[dict[str, Any]]] = {r.candidate.name: [] for r in chosen}

        def rows_so_far() -> list[dict[str, Any]]:
            """The rows of the maps measured so far (the profile's own map first when it is no candidate)."""
            done: list[dict[str, Any]] = []
            if mine is not None and not any(a.get("profile_run") for arms in measured.values() for a in arms):
                done.append(row_of(as_given(own, profile), [{**profile_run, "profile_run": True}], device,
                                   workload, command, args, control_of))
            return done + [row_of(r, measured[r.candidate.name], device, workload, command, args, control_of)
                           for r in chosen if measured[r.candidate.name]]

        def control_of(arm: dict[str, Any]) -> tuple[float, float] | None:
            """The control's measured and predicted step for ``arm``'s round (the profile run for itself)."""
            if predicted_control is None:
                return None
            if arm.get("profile_run"):
                return profile_run["mean_step_s"], predicted_control.step
            mine_round = controls.get(arm.get("round", -1))
            return (mine_round["mean_step_s"], predicted_control.step) if mine_round else None

        control = args.control if args.control is not None else args.device == "cpu"
        controls: dict[int, dict[str, Any]] = {}
        predicted_control = as_given(own, profile).prediction if control and mine is not None else None
        left_out: list[str] = []

        def budgeted_arm(label: str, arm_overrides: list[str], folder: Path) -> dict[str, Any] | None:
            """``run_arm`` inside the call's budget: None, and ``label`` left out, where the arm has no earlier
            finished run to read and no time to train (nor has any arm after one left out: they keep their order)."""
            if not (args.reuse and finished(config, arm_overrides, args.steps, folder)) and (
                    left_out or not budget.room()):
                left_out.append(label)
                return None
            arm = run_arm(config, arm_overrides, args.steps, args.skip, folder, budget.timeout(args.timeout),
                          args.reuse)
            budget.spent(arm)
            return arm

        for round_no in range(args.rounds):
            if predicted_control is not None:
                arm = budgeted_arm(f"control round {round_no + 1}", overrides, workdir / f"control-{round_no}")
                if arm is not None:
                    print(f"  control (the profile's map) round {round_no + 1}: "
                          f"{arm.get('mean_step_s', float('nan')):.3f} s a step", flush=True)
                if arm is not None and "mean_step_s" in arm:
                    controls[round_no] = arm
            for r in chosen:
                name = r.candidate.name
                if r.planned.plan is not None and signature(r.planned.cfg, r.planned.plan) == mine \
                        and round_no == 0:
                    measured[name].append({**profile_run, "profile_run": True, "round": round_no})
                    continue
                folder = workdir / f"{name.replace(' ', '_').replace(':', '-')}-{round_no}"
                arm = budgeted_arm(f"{name} round {round_no + 1}", [*overrides, *r.candidate.overrides], folder)
                if arm is None:
                    continue
                print(f"  {name} round {round_no + 1}: {arm.get('mean_step_s', float('nan')):.3f} s a step "
                      f"({arm['wall_s']} s){'  ' + arm['error'] if 'error' in arm else ''}", flush=True)
                measured[name].append({**arm, "round": round_no})
                write_rows(out, rows_so_far(), context, start)  # a call cut short keeps the maps it measured
        if left_out:
            context["left_out"] = left_out
            print(f"no time left in the {args.budget:.0f} s budget for: {', '.join(left_out)}; the same command "
                  f"with --reuse (on this machine, same --workdir) trains them", flush=True)
        if controls:
            context["control_step_s"] = [round(controls[n]["mean_step_s"], 4) for n in sorted(controls)]
        rows += rows_so_far()
    write_rows(out, rows, context, start)
    print(table(rows))
    print(f"wrote {out} ({context['wall_s']} s)")


def write_rows(out: Path, rows: list[dict[str, Any]], context: dict[str, Any], start: float) -> None:
    """Merge ``rows``, each stamped with its profile run's start (``row_key``), into the result file ``out``
    (``merge``), with the time spent so far in ``context``."""
    context["wall_s"] = round(time.perf_counter() - start, 1)
    rows = [{**r, "profile_started": context.get("profile_started")} for r in rows]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(merge(out, rows, context), indent=2) + "\n")


def _arm_means(arms: list[dict[str, Any]], field: str) -> dict[str, float] | None:
    """The mean over ``arms`` of each metric in their ``field`` (``run_arm``'s ``rollout`` or ``busy``)."""
    if not arms:
        return None
    keys = sorted({k for a in arms for k in a.get(field, {})})
    return {k: round(statistics.fmean(a.get(field, {}).get(k, 0.0) for a in arms), 4) for k in keys}


def row_of(r: Any, arms: list[dict[str, Any]], device: str, workload: str, command: str,
           args: argparse.Namespace, control_of: Any = None) -> dict[str, Any]:
    """One map's row: the prediction (step and phases) beside the rounds' measurements. With ``control_of`` (an
    arm -> its round's control: measured and predicted step of the profile's own map), ``vs_control``: the mean
    over rounds of (measured / control measured) / (predicted / control predicted), the map's speed relative to
    the profile's map as measured in the same round against as predicted (1.0: the advisor's relative figure
    held, whatever the machine's drift between the profile and the round)."""
    p = r.prediction
    good = [a for a in arms if "mean_step_s" in a and "error" not in a]
    means = [a["mean_step_s"] for a in good]
    row: dict[str, Any] = {
        "device": device, "map": r.candidate.name, "workload": workload,
        "predicted_step_s": round(p.step, 4) if p else None,
        "measured_step_s": round(statistics.fmean(means), 4) if means else None,
        "kind": r.candidate.kind, "overrides": list(r.candidate.overrides), "steps": args.steps, "skip": args.skip,
        "rounds": len(good), "round_step_s": [round(m, 4) for m in means],
        "spread_s": [round(min(means), 4), round(max(means), 4)] if means else None,
        "step_seconds": [a["step_seconds"] for a in good],
        "steady_steps": [a["steady_steps"] for a in good],
        "step_stdev_s": round(statistics.stdev(s for a in good for s in a["steady_seconds"]), 4)
        if sum(len(a["steady_seconds"]) for a in good) > 1 else None,
        "profile_run": any(a.get("profile_run") for a in arms),
        "predicted_phases_s": {k: round(v, 4) for k, v in p.phases.items()} if p else None,
        "measured_phases_s": {k: round(statistics.fmean(a["phases_s"].get(k, 0.0) for a in good), 4)
                              for k in PHASES if any(k in a.get("phases_s", {}) for a in good)} if good else None,
        "measured_rollout": _arm_means(good, "rollout"),
        "measured_busy": _arm_means(good, "busy"),
        "command": command,
    }
    if p is None:
        row["error"] = f"dropped by the advisor: {r.why}"
    elif row["measured_step_s"]:
        row["ratio"] = round(row["measured_step_s"] / p.step, 3)
        pairs = [(a["mean_step_s"], c) for a in good if (c := control_of(a) if control_of else None)]
        if pairs:
            row["control_step_s"] = [round(c[0], 4) for _, c in pairs]
            row["vs_control"] = round(statistics.fmean((m / c[0]) / (p.step / c[1]) for m, c in pairs), 3)
    failed = [a["error"] for a in arms if "error" in a]
    if failed:
        row["error"] = "; ".join(failed)[:500]
        row["log_tail"] = next(a.get("log_tail", "") for a in arms if "error" in a)
    return row


if __name__ == "__main__":
    main()
