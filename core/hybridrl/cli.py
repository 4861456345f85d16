"""``hybridrl train | plan | report | export | plugins``."""

from __future__ import annotations

import argparse
import re
import signal
import sys
import traceback
from typing import Any

from hybridrl.config import ConfigError, RunConfig, load_config
from hybridrl.errors import HybridRLError
from hybridrl.placement.plan import ClusterSpec
from hybridrl.run.faults import Terminated

#: what the CLI says before the traceback of an exception that is not a ``HybridRLError``.
BUG_LINE = ("hybridrl: internal error: this is a bug in hybridrl or in a plugin, not a problem with your config or "
            "data; please report it with the traceback below")


def _registry(cfg: RunConfig | None = None):
    from hybridrl.plugins.discovery import get_registry

    return get_registry(tuple(cfg.plugins) if cfg else ())


def parse_cluster(text: str, device: str) -> ClusterSpec:
    m = re.fullmatch(r"(\d+)x(\d+)", text.strip())
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ConfigError([("--cluster", f"expected NODESxDEVICES like 2x8, each at least 1, got '{text}'")])
    return ClusterSpec(int(m.group(1)), int(m.group(2)), device, declared=True)


def check_plan_flags(args: argparse.Namespace) -> None:
    """``hybridrl plan``'s own flags, before anything is planned or profiled: every problem named by its flag,
    in one ``ConfigError`` (a run to profile, or an advice, is not started only to fail at the end)."""
    from pathlib import Path

    from hybridrl.model.shape import MemoryEstimateError, read_hf_config
    from hybridrl.run.faults import not_writable

    problems: list[tuple[str, str]] = []
    for flag, value in (("--device-memory", args.device_memory), ("--host-memory", args.host_memory)):
        if value is not None and not value > 0:
            problems.append((flag, f"expected a positive number of GiB, got {value:g}"))
    if args.model_config is not None:
        try:
            read_hf_config(args.model_config)
        except MemoryEstimateError as exc:
            problems.append(("--model-config", str(exc)))
    if args.profile and args.profile_steps is not None:
        problems.append(("--profile-steps", "give either --profile RUN or --profile-steps N, not both"))
    config = Path(args.config).resolve()
    outputs = [(flag, Path(value)) for flag, value in (("--write", args.write), ("--json", args.json)) if value]
    for flag, path in outputs:
        if path.resolve() == config:
            problems.append((flag, f"'{path}' is the config being planned; write the advice to another file"))
        elif path.is_dir():
            problems.append((flag, f"'{path}' is a folder; give a file path"))
        elif not path.resolve().parent.is_dir():
            problems.append((flag, f"the folder of '{path}' does not exist"))
        elif why := not_writable(path.resolve().parent):
            problems.append((flag, f"{why}, the folder of '{path}'"))
    if len(outputs) == 2 and outputs[0][1].resolve() == outputs[1][1].resolve():
        problems.append(("--json", f"'{outputs[1][1]}' is also --write's file; give them different paths"))
    if problems:
        raise ConfigError(problems)


def cmd_plan(args: argparse.Namespace) -> int:
    """The device map, the auto choices and the memory per device. Needs no engine installed: a backend whose
    engine is missing here is a warning (``hybridrl train`` refuses it)."""
    from hybridrl.placement.plan import engine_warnings
    from hybridrl.placement.topology import Topology
    from hybridrl.run.lora_setup import with_lora
    from hybridrl.run.preflight import check_config, check_links, with_algorithm_roles
    from hybridrl.runtime.cluster import detect_cluster
    from hybridrl.tools.sandbox import isolation_warnings

    check_plan_flags(args)
    cfg = load_config(args.config, args.overrides)
    registry = _registry(cfg)
    cluster = parse_cluster(args.cluster, args.device) if args.cluster else detect_cluster(cfg.cluster)
    if args.advise:
        return _advise(args, cfg, registry, cluster)
    if args.profile or args.write or args.json or args.profile_steps is not None:
        flag = ("--profile" if args.profile else "--write" if args.write else "--json" if args.json
                else "--profile-steps")
        raise ConfigError([(flag, "only with --advise")])
    backends, plan, problems = check_config(cfg, registry, cluster, check_engines=False)
    if problems:
        raise ConfigError(problems)
    assert plan is not None
    run_cfg, notes = with_algorithm_roles(cfg, registry)
    run_cfg, lora_notes = with_lora(run_cfg, plan, backends)
    auto_notes = _plan_memory(args, run_cfg, plan, registry, backends)
    link_warnings = check_links(run_cfg, plan, Topology.load(args.topology) if args.topology else None)
    print(plan.render())
    for note in notes + lora_notes + auto_notes:
        print(f"note: {note}")
    for warning in link_warnings:
        print(f"WARNING: {warning}")
    if not args.skip_engine_check:
        for warning in engine_warnings(backends):
            print(f"WARNING: {warning}")
    for warning in isolation_warnings(cfg.environment.tools, cfg.environment.tool_options):
        print(f"WARNING: {warning}")
    return 0


def _plan_memory(args: argparse.Namespace, cfg: RunConfig, plan, registry, backends) -> list[str]:
    """Resolve the auto settings against the declared device and put the memory table into the plan (or why
    there is none: it never fails the plan). Returns the auto choices as notes."""
    from pathlib import Path

    from hybridrl.placement.auto import resolve_auto
    from hybridrl.placement.memory import (
        GIB,
        MemoryEstimateError,
        model_shape,
        model_shapes_by_role,
        planned_device_memory_bytes,
        render_memory,
    )

    here = Path(args.config).resolve().parent
    bases = (here, here.parent)  # model.path relative to the config's folder, or to the project holding it
    declared = args.device_memory if args.device_memory is not None else cfg.cluster.device_memory_gb
    device_bytes = planned_device_memory_bytes(plan.cluster.device, declared, not plan.cluster.declared)
    names = {role: entry.name for role, entry in backends.items()}
    try:
        shape, source = model_shape(cfg, args.model_config, bases)
    except MemoryEstimateError as exc:
        auto = resolve_auto(cfg, plan, registry, names, None, device_bytes)
        plan.memory_table = f"memory estimate: skipped ({exc})"
        return auto.notes()
    host_gib = args.host_memory if args.host_memory is not None else cfg.cluster.host_memory_gb
    host_bytes = None if host_gib is None else host_gib * GIB
    auto = resolve_auto(cfg, plan, registry, names, shape, device_bytes, source, model_shapes_by_role(cfg, bases),
                        host_bytes)
    if auto.problems:
        raise ConfigError(auto.problems)
    tables = ([render_memory(auto.estimate)] if auto.estimate is not None else []) + _reshard_lines(cfg, plan, shape)
    plan.memory_table = "\n".join(tables) or None
    return auto.notes()


def profile_run(config: str, overrides: list[str], steps: int) -> str:
    """``plan --advise --profile-steps N``: the config trained for ``steps`` steps as it is (its own device map)
    into a fresh folder, whose spans and metrics the cost model is fitted from; the folder is kept and named, so
    that a later ``--profile RUN`` reuses it. A run that fails ends the command with its own message."""
    import subprocess
    import sys
    import tempfile

    if steps < 2:
        raise ConfigError([("--profile-steps", f"needs at least 2 steps (the first is warm-up and left out), got "
                                               f"{steps}")])
    folder = tempfile.mkdtemp(prefix="hybridrl-profile-")
    print(f"profiling: {steps} steps of {config} into {folder} ...", flush=True)
    command = [sys.executable, "-m", "hybridrl.cli", "train", config, *overrides, f"trainer.steps={steps}",
               f"trainer.out={folder}", "trainer.resume=never", "trainer.save_every=0", "trainer.trackers=[jsonl]",
               "trainer.progress=false"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ConfigError([("--profile-steps", f"the profiling run failed (exit status {done.returncode}): {last}; "
                                               f"its folder is {folder}")])
    print(f"profiled: reuse it with --profile {folder}", flush=True)
    return folder


def _advise(args: argparse.Namespace, cfg: RunConfig, registry, cluster: ClusterSpec) -> int:
    """``plan --advise``: the candidate maps ranked by the cost model (``hybridrl.placement.advice``)."""
    from pathlib import Path

    from hybridrl.placement.advice.advise import advise, plan_candidate, ranked_json, render, write_config
    from hybridrl.placement.advice.from_run import auto_resets
    from hybridrl.placement.advice.profile import default_profile, fit_profile
    from hybridrl.placement.memory import (
        GIB,
        MemoryEstimateError,
        model_shape,
        model_shapes_by_role,
        planned_device_memory_bytes,
    )

    bandwidth = parse_bandwidths(args.bandwidth or [])
    latency = parse_latencies(args.latency or [])
    here = Path(args.config).resolve().parent
    bases = (here, here.parent)
    try:
        shape, _ = model_shape(cfg, args.model_config, bases)
    except MemoryEstimateError:
        shape = None
    if args.profile_steps is not None:
        args.profile = profile_run(args.config, args.overrides, args.profile_steps)
    if args.profile:
        profile = fit_profile(args.profile, bandwidth, latency)
    else:
        profile = default_profile(cluster.device, shape.active_param_count() if shape else None)
        profile.bandwidth.update(bandwidth)
        profile.latency.update(latency)
    declared = args.device_memory if args.device_memory is not None else cfg.cluster.device_memory_gb
    host_gib = args.host_memory if args.host_memory is not None else cfg.cluster.host_memory_gb
    device_bytes = planned_device_memory_bytes(cluster.device, declared, not cluster.declared)
    planner = plan_candidate(cluster, registry, device_bytes, shape,
                             model_shapes_by_role(cfg, bases), None if host_gib is None else host_gib * GIB)
    from hybridrl.plugins.registry import RegistryError

    try:  # a rollout that runs one engine per rank is offered no tensor parallelism
        rollout_tp = registry.backend("rollout", cfg.roles.rollout.backend).can("tensor_parallel")
    except RegistryError:
        rollout_tp = True  # an unknown backend is named by the planner's own check
    resets = auto_resets(args.config)  # a run's config.json: its auto choices re-resolved for each map
    if resets:
        print(f"{args.config} is a run's resolved config: its {len(resets)} auto settings (run_plan.json) are "
              "resolved again for each map")
    overrides = [*resets, *args.overrides]
    ranked = advise(args.config, overrides, cluster, profile, planner, rollout_tp=rollout_tp, registry=registry)
    print(render(ranked, profile, cluster))
    if args.json:
        import json

        table = ranked_json(ranked, profile, cluster)
        table.update(config=args.config, overrides=overrides,
                     device_memory_gib=None if device_bytes is None else device_bytes / GIB)
        Path(args.json).write_text(json.dumps(table, indent=1) + "\n")
        print(f"wrote {args.json}")
    if args.write:
        best = next((r for r in ranked if r.prediction is not None), None)
        if best is None:
            raise ConfigError([("--write", "no candidate map fits, nothing to write")])
        print(f"wrote {write_config(args.config, overrides, best.candidate, args.write)}")
    return 0


def parse_bandwidths(items: list[str]) -> dict[str, float]:
    """``--bandwidth nvlink=300`` (GB/s) -> ``{"nvlink": 300e9}``; an unknown link kind or a bad number: one
    sentence naming it."""
    return _parse_links("--bandwidth", "GB/s", items, 1e9, positive=True)


def parse_latencies(items: list[str]) -> dict[str, float]:
    """``--latency tcp=1.3`` (ms per collective) -> ``{"tcp": 0.0013}``, checked as ``--bandwidth`` is."""
    return _parse_links("--latency", "ms", items, 1e-3, positive=False)


def _parse_links(flag: str, unit: str, items: list[str], scale: float, positive: bool) -> dict[str, float]:
    """``KIND=number`` items of a link kind of ``LINK_BANDWIDTH`` -> ``{kind: number x scale}``; one sentence naming
    a bad one (an unknown kind, not a number, not positive or negative)."""
    from hybridrl.placement.advice.profile import LINK_BANDWIDTH

    out = {}
    for item in items:
        kind, _, value = item.partition("=")
        try:
            number = float(value)
        except ValueError:
            number = -1.0
        if kind not in LINK_BANDWIDTH or number < 0 or (positive and number == 0):
            sign = "positive" if positive else "non-negative"
            raise ConfigError([(flag, f"expected KIND={unit} with KIND one of {', '.join(LINK_BANDWIDTH)} "
                                      f"and a {sign} number, got '{item}'")])
        out[kind] = number * scale
    return out


def _reshard_lines(cfg: RunConfig, plan, shape) -> list[str]:
    """The bytes each weight sync moves (``hybridrl.placement.reshard``), when the run has one."""
    from hybridrl.placement.reshard import estimate_reshard, render_reshard

    reshard = estimate_reshard(cfg, plan, shape)
    return [] if reshard is None else [render_reshard(reshard, shape)]


def cmd_report(args: argparse.Namespace) -> int:
    from hybridrl.observe.report import write_report
    from hybridrl.observe.timeline import missing_spans

    written = write_report(args.run, args.out, args.step)  # a ReportError: exit 2 (``main``)
    for path in written:
        print(path)
    if (why := missing_spans(args.run)) is not None:
        print(f"note: no device timeline: {why}", file=sys.stderr)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from hybridrl.run.faults import signals_deferred, signals_raise
    from hybridrl.run.run_lock import release
    from hybridrl.runtime.local_ray import stop_local_ray

    cfg = load_config(args.config, args.overrides)
    with signals_raise():  # SIGTERM unwinds like Ctrl-C: the workers and the run's Ray are stopped
        try:
            return _train(cfg, args.overwrite)
        finally:
            with signals_deferred():  # a second Ctrl-C cannot cut the shutdown short
                stop_local_ray()
                release(cfg.trainer.out)  # the run folder's lock (hybridrl.run.run_lock), once all has stopped


def _train(cfg: RunConfig, overwrite: bool) -> int:
    """Exit status: 0 done, 1 a fault (named), 130 / 143 stopped by Ctrl-C / SIGTERM (after saving, or at once
    on a second signal)."""
    from hybridrl.rewards.calling import RewardError
    from hybridrl.run.checkpoint import CheckpointError
    from hybridrl.run.faults import EXIT_STATUS, RunFailure, Terminated, signal_name, signals_deferred
    from hybridrl.run.oom import OutOfMemoryStop, memory_stop
    from hybridrl.run.preflight import prepare_run
    from hybridrl.run.trainer import Trainer
    from hybridrl.runtime.cluster import detect_cluster
    from hybridrl.runtime.launch import EngineStartError
    from hybridrl.tools.sandbox import isolation_warnings

    setup = prepare_run(cfg, _registry(cfg), detect_cluster(cfg.cluster), overwrite=overwrite)
    for warning in setup.warnings + isolation_warnings(cfg.environment.tools, cfg.environment.tool_options):
        print(f"WARNING: {warning}", file=sys.stderr)
    trainer = Trainer(setup)
    try:
        with trainer.guard.explaining(lambda: trainer.groups, lambda: "during start-up"):
            trainer.start()
        with trainer.guard.explaining(lambda: trainer.groups, lambda: f"after step {trainer.step}"):
            history = trainer.fit()  # (faults inside a step are explained by fit itself)
    except (RunFailure, CheckpointError, RewardError, OutOfMemoryStop) as exc:
        print(f"hybridrl: {exc}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, Terminated) as exc:
        signum = getattr(exc, "signum", signal.SIGINT)
        print(f"hybridrl: stopped at once by {signal_name(signum)} after step {trainer.step}. "
              f"{trainer.checkpointer.last_checkpoint_message()}", file=sys.stderr)
        return EXIT_STATUS[signum]
    except Exception as exc:  # out of memory while the engines start (the training loop's guard is not up yet)
        started = exc.__cause__ if isinstance(exc, EngineStartError) and exc.__cause__ is not None else exc
        stop = memory_stop(started, setup.plan, None, trainer.checkpointer.last_checkpoint_message())
        if stop is None and isinstance(exc, EngineStartError):  # an engine refused to start: its own one line
            stop = exc
        if stop is None:
            raise  # ``main``: a HybridRLError's sentences, anything else as a bug with its traceback
        print(f"hybridrl: {stop}", file=sys.stderr)
        return 1
    finally:
        with signals_deferred():
            trainer.shutdown()
    if trainer.interrupted:
        return EXIT_STATUS.get(trainer.guard.stop_signal or signal.SIGINT, 130)
    if history:
        last = history[-10:]
        mean = sum(m["reward/mean"] for m in last) / len(last)
        print(f"done: {len(history)} steps, mean reward of the last {len(last)}: {mean:.3f}; "
              f"metrics in {cfg.trainer.out}/metrics.jsonl")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from hybridrl.run.export import export_checkpoint

    out = export_checkpoint(args.run, args.out, step=args.step, dtype=args.dtype, force=args.force,
                            adapter=args.adapter, unverified=args.unverified)  # an ExportError: exit 2 (``main``)
    print(f"exported to {out}")
    return 0


def cmd_cluster(args: argparse.Namespace) -> int:
    """``hybridrl cluster up | down | env`` (``hybridrl.runtime.ray_nodes``)."""
    from hybridrl.runtime import ray_nodes

    folder = args.dir.resolve()
    try:
        if args.cluster_command == "up":
            if args.head and args.address:
                raise ray_nodes.ClusterError("--head starts a head, --address joins one: give one of them (a worker "
                                             "without --address joins the head recorded in --dir)")
            node = ray_nodes.start_node(folder, head=args.head, address=args.address, node_ip=args.node_ip,
                                        port=args.port, num_cpus=args.num_cpus, num_gpus=args.num_gpus)
            print(f"started {node.name}, cluster {node.address}; log: {node.log}")
            if node.head:
                print(f"  join a worker: hybridrl cluster up --address {node.address} --dir {folder} [--node-ip IP]\n"
                      f"  run a driver:  eval \"$(hybridrl cluster env --dir {folder})\" && hybridrl train CONFIG\n"
                      f"  stop:          hybridrl cluster down --dir {folder}   (on every machine)")
        elif args.cluster_command == "down":
            stopped = ray_nodes.stop_nodes(folder)
            print("\n".join(f"stopped {node.name}" for node in stopped) or f"no node of {folder} runs here")
        else:
            for key, value in ray_nodes.driver_env(folder).items():
                print(f"export {key}={value}")
    except ray_nodes.ClusterError as exc:
        print(f"hybridrl: {exc}", file=sys.stderr)
        return 2
    return 0


def cmd_plugins(args: argparse.Namespace) -> int:
    from hybridrl.plugins.discovery import describe_plugins

    registry = _registry()
    rows = describe_plugins()
    if args.name:
        return _describe_backend(registry, rows, args.name)
    print(f"{'plugin':<18} {'distribution':<20} {'version':<9} registers")
    for row in rows:
        items = []
        for item in row.registers:
            kind, _, name = item.partition(":")
            if kind in ("train", "rollout"):
                problem = registry.backend(kind, name).engine_problem()  # type: ignore[arg-type]
                item += " (engine available)" if problem is None else f" ({problem})"
            items.append(item)
        if row.error is not None:  # installed, but its import raised: skipped by runs (hybridrl.plugins.discovery)
            items = [f"FAILED TO IMPORT: {row.error}"]
        print(f"{row.name:<18} {row.distribution:<20} {row.version:<9} {', '.join(items) or '-'}")
    return 0


def _describe_backend(registry: Any, rows: list[Any], name: str) -> int:
    """``hybridrl plugins NAME``: the backend(s) of that name (``hybridrl.plugins.describe``)."""
    from hybridrl.plugins.describe import UnknownBackend, describe_backend, find_backends

    try:
        specs = find_backends(registry, name)
    except UnknownBackend as exc:
        print(f"hybridrl: {exc}", file=sys.stderr)
        return exc.exit_status
    dists = {row.name: (row.distribution, row.version) for row in rows}
    for i, spec in enumerate(specs):
        distribution, version = dists.get(spec.plugin, ("(unknown)", "-"))
        print(("\n" if i else "") + "\n".join(describe_backend(spec, distribution, version)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridrl", description="RL for LLMs with flexible device mapping")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run training from a YAML config")
    train.add_argument("config")
    train.add_argument("overrides", nargs="*", help="dotted overrides: roles.actor.lr=1e-5 (key=null unsets a key)")
    train.add_argument("--overwrite", action="store_true",
                       help="start a new run even if trainer.out holds one: the old run is moved to <out>.old-<time>")
    train.set_defaults(func=cmd_train)
    plan = sub.add_parser("plan", help="print the device map without starting anything")
    plan.add_argument("config")
    plan.add_argument("overrides", nargs="*")
    plan.add_argument("--cluster", help="declare the cluster as NODESxDEVICES (e.g. 2x8) instead of detecting it")
    plan.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="device kind of --cluster")
    plan.add_argument("--topology", metavar="FILE", help="check the plan against the GPU links recorded in FILE "
                                                         "(JSON, docs/cluster.md) instead of this "
                                                         "machine's")
    plan.add_argument("--skip-engine-check", action="store_true",
                      help="no warning for backends whose engines are not installed here")
    plan.add_argument("--device-memory", type=float, metavar="GIB",
                      help="memory of one device in GiB for the estimate "
                           "(default: cluster.device_memory_gb, else the GPUs of this machine, else 80 on cuda)")
    plan.add_argument("--host-memory", type=float, metavar="GIB",
                      help="host memory of one node in GiB, checked against what offloading and a sleeping rollout "
                           "keep there (default: cluster.host_memory_gb, else not checked)")
    plan.add_argument("--model-config", metavar="PATH", help="HF config.json (or its folder) to size the model from")
    plan.add_argument("--advise", action="store_true",
                      help="rank candidate device maps of --cluster by predicted step time (docs/advisor.md)")
    plan.add_argument("--profile", metavar="RUN", help="with --advise: fit the cost model from this run folder "
                                                       "(spans.jsonl, metrics.jsonl) instead of the default profile")
    plan.add_argument("--profile-steps", metavar="N", type=int, default=None,
                      help="with --advise: train the config as it is for N steps first and fit the cost model "
                           "from that run (its folder is printed, for --profile)")
    plan.add_argument("--write", metavar="FILE", help="with --advise: write the best map's config (your YAML plus "
                                                      "its overrides) to FILE")
    plan.add_argument("--json", metavar="FILE", help="with --advise: write the ranked table as JSON to FILE")
    plan.add_argument("--bandwidth", action="append", metavar="KIND=GB/s",
                      help="with --advise: a link's bandwidth (nvlink, pcie, net, ...), repeatable")
    plan.add_argument("--latency", action="append", metavar="KIND=ms",
                      help="with --advise: a link's latency per collective (tcp, nvlink, ...), repeatable")
    plan.set_defaults(func=cmd_plan)
    report = sub.add_parser("report", help="plots and a Markdown summary of a run, in RUN/report/")
    report.add_argument("run", help="the run folder (trainer.out) holding metrics.jsonl and config.json")
    report.add_argument("--out", help="where to write (default: RUN/report)")
    report.add_argument("--step", type=int, help="the step whose device timeline is drawn (default: the last)")
    report.set_defaults(func=cmd_report)
    export = sub.add_parser("export", help="the actor of a checkpoint as a Hugging Face model folder")
    export.add_argument("run", help="the run folder (trainer.out) or one checkpoint folder (checkpoints/step_N)")
    export.add_argument("--step", type=int, help="the checkpoint of this step (default: the latest)")
    export.add_argument("--out", required=True,
                        help="the folder to write: new or empty (or a previous export, with --force)")
    export.add_argument("--force", action="store_true", help="replace --out when it holds a previous export")
    export.add_argument("--adapter", action="store_true",
                        help="a LoRA actor's adapters alone, as a peft adapter folder (default: the merged model)")
    export.add_argument("--unverified", action="store_true",
                        help="export a checkpoint that has no manifest.json (its files cannot be verified)")
    export.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                        help="dtype of the saved weights (default: the run's model.dtype)")
    export.set_defaults(func=cmd_export)
    _cluster_parser(sub)
    plugins = sub.add_parser("plugins", help="list plugins, what they register, and engine availability; "
                                             "with NAME, one backend's capabilities and options")
    plugins.add_argument("name", nargs="?", help="a backend name (fsdp, hf, vllm ...): its kind, distribution, "
                                                 "capabilities, max ranks and option keys")
    plugins.set_defaults(func=cmd_plugins)
    return parser


def _cluster_parser(sub: Any) -> None:
    from pathlib import Path

    from hybridrl.runtime.ray_nodes import default_folder

    cluster = sub.add_parser("cluster", help="start or stop the Ray nodes of a cluster on this machine")
    cluster.set_defaults(func=cmd_cluster)
    commands = cluster.add_subparsers(dest="cluster_command", required=True)
    up = commands.add_parser("up", help="start a node: the head (--head) or a worker that joins it")
    up.add_argument("--head", action="store_true", help="start the cluster's head")
    up.add_argument("--address", help="HOST:PORT of the head to join (default: the head recorded in --dir)")
    up.add_argument("--node-ip", help="the address this node binds and is reached on (default: Ray's choice, the "
                                      "outward interface); on one machine 127.0.0.2, 127.0.0.3, ...")
    up.add_argument("--port", type=int, help="the head's port (default 6379)")
    up.add_argument("--num-cpus", type=int, help="CPU slots of this node (default: its cores)")
    up.add_argument("--num-gpus", type=int, help="GPUs of this node (default: those it has)")
    down = commands.add_parser("down", help="stop the nodes of --dir that run on this machine")
    env = commands.add_parser("env", help="the environment a driver sets to join the cluster (shell exports)")
    for command in (up, down, env):
        command.add_argument("--dir", type=Path, default=default_folder(),
                             help="the cluster folder (shared by the nodes on a real cluster; default "
                                  "$HYBRIDRL_CLUSTER_DIR or ~/.hybridrl/cluster)")


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Like ``parse_args``, but ``key=value`` overrides may also follow options (``plan CFG --cluster 2x8
    a.b=1``): argparse stops filling a ``nargs='*'`` positional at the first option, and its intermixed
    parser does not work with sub-commands, so the leftovers that look like overrides are appended in order."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        stray = [e for e in extra if e.startswith("-") or "=" not in e]
        if stray or not hasattr(args, "overrides"):
            parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
        args.overrides = [*args.overrides, *extra]
    return args


def main(argv: list[str] | None = None) -> int:
    from hybridrl.observe.console import enable_console

    enable_console()
    args = parse_args(build_parser(), argv)
    try:
        return args.func(args)
    except HybridRLError as exc:  # the user's to fix: its sentences, no traceback
        print(f"hybridrl: {exc}", file=sys.stderr)
        return exc.exit_status
    except KeyboardInterrupt:
        print("hybridrl: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print("hybridrl: terminated (SIGTERM)", file=sys.stderr)
        return 143
    except Exception:  # anything else is not the user's doing: say so, with the traceback to report
        print(BUG_LINE, file=sys.stderr)
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main())
