"""Everything checked before any process starts: config semantics, plugins, model, data, placement.

``prepare_run`` either returns a ``RunSetup`` ready to launch or raises ``ConfigError`` listing every
problem it found, each with its key path or file name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from hybridrl.config import ConfigError, CriticConfig, RunConfig
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
    reward_fn: Callable[..., float] | None  # None: the reward model alone scores
    dropped_prompts: int = 0
    role_model_paths: dict[str, str] = field(default_factory=dict)  # critic backbone, reward model
    notes: list[str] = field(default_factory=list)  # what the pre-flight changed, printed at start-up


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


def with_algorithm_roles(cfg: RunConfig, registry: Registry) -> tuple[RunConfig, list[str]]:
    """The config the run uses: ``algorithm`` with its preset's defaults filled in, a critic role added
    (with the actor, default settings) when the advantage estimator needs values, and an unused critic
    dropped. Returns it with notes on what changed. Unknown presets are left for ``check_config`` to report."""
    from hybridrl.algorithms.objective import resolve_algorithm

    try:
        algo = resolve_algorithm(cfg.algorithm, registry)
    except RegistryError:
        return cfg, []
    notes: list[str] = []
    roles = cfg.roles
    if algo.uses_critic and roles.critic is None:
        roles = roles.model_copy(update={"critic": CriticConfig()})
        notes.append(f"algorithm '{cfg.algorithm.name}' ({algo.advantage}) needs values: a critic is placed "
                     "with the actor (settings under roles.critic)")
    elif not algo.uses_critic and roles.critic is not None:
        roles = roles.model_copy(update={"critic": None})
        notes.append(f"roles.critic is not used by advantage '{algo.advantage}': no critic is started")
    return cfg.model_copy(update={"algorithm": algo.config, "roles": roles}), notes


def check_config(cfg: RunConfig, registry: Registry, cluster: ClusterSpec, check_engines: bool = True
                 ) -> tuple[dict[str, BackendEntry], PlacementPlan | None, list[tuple[str, str]]]:
    """Semantic checks that need the registry and the cluster (no files, no model)."""
    from hybridrl.algorithms.objective import resolve_algorithm

    problems: list[tuple[str, str]] = []
    cfg, _ = with_algorithm_roles(cfg, registry)
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
    for role in ("actor", "critic"):
        rcfg = getattr(cfg.roles, role)
        if rcfg is not None and rcfg.mini_batch and batch_size % rcfg.mini_batch:
            problems.append((f"roles.{role}.mini_batch", f"{rcfg.mini_batch} does not divide the batch of {batch_size} "
                                                         "sequences (data.prompts_per_step x algorithm.n_samples)"))
    if cfg.roles.critic is not None:
        try:
            registry.get("loss_aggregation", cfg.roles.critic.loss_agg)
        except RegistryError as exc:
            problems.append(("roles.critic.loss_agg", str(exc)))
        path = cfg.roles.critic.model_path
        if path is not None and not (Path(path) / "config.json").is_file():
            problems.append(("roles.critic.model_path", f"'{path}' is not an HF checkpoint folder (no config.json)"))
    problems += _reward_problems(cfg, registry)
    for key in cfg.trainer.trackers:
        if ("tracker", key) not in registry.named:
            problems.append(("trainer.trackers", f"unknown tracker '{key}' (known: {', '.join(registry.names('tracker'))})"))
    plan = None
    try:
        plan = plan_placement(cfg, cluster, backends)
    except ConfigError as exc:
        problems += exc.problems
    return backends, plan, problems


def _reward_problems(cfg: RunConfig, registry: Registry) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    reward = cfg.roles.reward
    if reward.fn is not None:
        try:
            resolve_reward(reward.fn, registry)
        except RegistryError as exc:
            problems.append(("roles.reward.fn", str(exc)))
    model = reward.model
    if model is not None:
        if model.path is not None and not (Path(model.path) / "config.json").is_file():
            problems.append(("roles.reward.model.path", f"'{model.path}' is not an HF checkpoint folder (no config.json)"))
        if model.tiny is not None and cfg.model.tiny is None:
            problems.append(("roles.reward.model.tiny", "a tiny reward model uses the bundled character tokenizer, "
                                                        "so the policy must be model.tiny too"))
    return problems


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


def role_model_paths(cfg: RunConfig) -> dict[str, str]:
    """Checkpoints of the roles that do not load the policy's: the critic's backbone when set apart, the
    reward model (a tiny one is built under ``<trainer.out>/reward_model``)."""
    paths: dict[str, str] = {}
    if cfg.roles.critic is not None and cfg.roles.critic.model_path:
        paths["critic"] = cfg.roles.critic.model_path
    model = cfg.roles.reward.model
    if model is not None:
        if model.tiny is not None:
            from hybridrl.rewarding import build_tiny_reward_model

            paths["reward"] = str(build_tiny_reward_model(model.tiny, Path(cfg.trainer.out) / "reward_model"))
        else:
            paths["reward"] = str(model.path)
    return paths


def prepare_run(cfg: RunConfig, registry: Registry, cluster: ClusterSpec) -> RunSetup:
    """Every check, with every problem collected: config, placement, files, packages, checkpoints; then, when
    the model and data are there, the tokenised prompts, the context length and a probe of the reward."""
    from hybridrl import run_checks
    from hybridrl.data import DataError, load_rows, tokenize_rows
    from hybridrl.run_state import TRAINABLE_ROLES

    backends, plan, problems = check_config(cfg, registry, cluster)
    run_cfg, notes = with_algorithm_roles(cfg, registry)
    trained = {r: b.name for r, b in backends.items() if r in TRAINABLE_ROLES}
    problems += run_checks.tracker_problems(cfg, registry) + run_checks.checkpoint_problems(cfg, registry, trained)
    rows = None
    try:
        rows = load_rows(cfg.data, registry)
    except (DataError, RegistryError) as exc:
        problems.append(("data.train" if cfg.data.train else "data.dataset", str(exc)))
    model_problems = run_checks.model_problems(cfg)
    problems += model_problems
    if model_problems:
        raise ConfigError(problems)
    model_path, tokenizer = prepare_model(cfg)
    prompts = None
    if rows is not None:
        try:
            prompts = tokenize_rows(rows, tokenizer, cfg.data)
        except DataError as exc:
            problems.append(("data", str(exc)))
    if prompts:
        problems += run_checks.context_problems(cfg, model_path, max(len(p.token_ids) for p in prompts))
    reward_fn = None
    if run_cfg.roles.reward.fn is not None and not any(k == "roles.reward.fn" for k, _ in problems):
        reward_fn = resolve_reward(run_cfg.roles.reward.fn, registry)
        if rows:
            problems += run_checks.reward_probe_problems(reward_fn, run_cfg.roles.reward.fn, rows[0],
                                                         cfg.data.prompt_key)
    if problems:
        raise ConfigError(problems)
    assert plan is not None and prompts is not None
    return RunSetup(run_cfg, registry, backends, plan, model_path, tokenizer, list(prompts), reward_fn,
                    prompts.dropped, role_model_paths(run_cfg), notes)
