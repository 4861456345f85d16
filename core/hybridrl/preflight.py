"""Everything checked before any process starts: config semantics, plugins, model, data, placement.

``prepare_run`` either returns a ``RunSetup`` ready to launch or raises ``ConfigError`` listing every
problem it found, each with its key path or file name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from hybridrl.config import ConfigError, RunConfig
from hybridrl.placement import ClusterSpec, PlacementPlan, plan_placement, resolve_backends
from hybridrl.registry import BackendEntry, Registry, RegistryError, load_object


@dataclass
class RunSetup:
    cfg: RunConfig
    registry: Registry
    backends: dict[str, BackendEntry]
    plan: PlacementPlan
    model_path: str
    tokenizer: Any
    prompts: list[Any]  # tokenised prompt rows
    reward_fn: Callable[..., float]
    dropped_prompts: int = 0


def resolve_reward(spec: str, registry: Registry) -> Callable[..., float]:
    if ":" in spec:
        try:
            fn = load_object(spec)
        except (ImportError, AttributeError, RegistryError) as exc:
            raise RegistryError(f"cannot import reward function '{spec}': {exc}") from None
    else:
        fn = registry.get("reward", spec)
    if not callable(fn):
        raise RegistryError(f"reward '{spec}' is not callable")
    return fn


def check_config(cfg: RunConfig, registry: Registry, cluster: ClusterSpec, check_engines: bool = True
                 ) -> tuple[dict[str, BackendEntry], PlacementPlan | None, list[tuple[str, str]]]:
    """Semantic checks that need the registry and the cluster (no files, no model)."""
    from hybridrl.algorithms.objective import resolve_algorithm

    problems: list[tuple[str, str]] = []
    backends, backend_problems = resolve_backends(cfg, registry, check_engines)
    problems += backend_problems
    try:
        algo = resolve_algorithm(cfg.algorithm, registry)
        for category, name, key in (("advantage", algo.advantage, "algorithm.advantage"),
                                    ("policy_loss", algo.policy_loss, "algorithm.policy_loss"),
                                    ("loss_aggregation", algo.loss_agg, "algorithm.loss_agg")):
            try:
                registry.get(category, name)
            except RegistryError as exc:
                problems.append((key, str(exc)))
        if cfg.algorithm.kl is not None and cfg.algorithm.kl.coef > 0:
            try:
                registry.get("kl_estimator", cfg.algorithm.kl.estimator)
            except RegistryError as exc:
                problems.append(("algorithm.kl.estimator", str(exc)))
        if algo.uses_ref and cfg.roles.ref is None:
            problems.append(("roles.ref", f"algorithm '{cfg.algorithm.name}' with a KL term needs a reference role"))
    except RegistryError as exc:
        problems.append(("algorithm.name", str(exc)))
    batch_size = cfg.data.prompts_per_step * cfg.algorithm.n_samples
    if cfg.roles.actor.mini_batch and batch_size % cfg.roles.actor.mini_batch:
        problems.append(("roles.actor.mini_batch", f"{cfg.roles.actor.mini_batch} does not divide the batch of "
                                                   f"{batch_size} sequences (data.prompts_per_step x algorithm.n_samples)"))
    try:
        resolve_reward(cfg.roles.reward.fn, registry)
    except RegistryError as exc:
        problems.append(("roles.reward.fn", str(exc)))
    for key in cfg.trainer.trackers:
        if ("tracker", key) not in registry.named:
            problems.append(("trainer.trackers", f"unknown tracker '{key}' (known: {', '.join(registry.names('tracker'))})"))
    plan = None
    try:
        plan = plan_placement(cfg, cluster, backends)
    except ConfigError as exc:
        problems += exc.problems
    return backends, plan, problems


def prepare_model(cfg: RunConfig) -> tuple[str, Any]:
    """The HF checkpoint folder every role loads (building the tiny model when asked) and its tokenizer."""
    from hybridrl.tokenizer import load_tokenizer

    if cfg.model.tiny is not None:
        from hybridrl.tasks.tiny_model import build_tiny_model

        path = build_tiny_model(cfg.model.tiny, Path(cfg.trainer.out) / "init_model")
    else:
        path = Path(cfg.model.path)
        if not (path / "config.json").is_file():
            raise ConfigError([("model.path", f"'{path}' is not an HF checkpoint folder (no config.json)")])
    return str(path), load_tokenizer(str(path))


def prepare_run(cfg: RunConfig, registry: Registry, cluster: ClusterSpec) -> RunSetup:
    from hybridrl.data import DataError, load_rows, tokenize_rows

    backends, plan, problems = check_config(cfg, registry, cluster)
    rows = None
    try:
        rows = load_rows(cfg.data, registry)
    except (DataError, RegistryError) as exc:
        problems.append(("data.train" if cfg.data.train else "data.dataset", str(exc)))
    if problems:
        raise ConfigError(problems)
    model_path, tokenizer = prepare_model(cfg)
    try:
        prompts = tokenize_rows(rows, tokenizer, cfg.data)
    except DataError as exc:
        raise ConfigError([("data", str(exc))]) from None
    assert plan is not None
    return RunSetup(cfg, registry, backends, plan, model_path, tokenizer, list(prompts),
                    resolve_reward(cfg.roles.reward.fn, registry), prompts.dropped)
