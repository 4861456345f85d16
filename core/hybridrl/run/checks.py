"""Pre-flight checks of what a training run needs beyond a valid config: files, packages, the model's context
length and shape, checkpoint support (the rewards' own checks are in ``hybridrl.rewards.checks``). Each returns
``(key path, reason)`` problems so that ``prepare_run`` reports them all at once, before any process starts."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

from hybridrl.config import RunConfig
from hybridrl.engines.capabilities import HEAD_CAPABILITY
from hybridrl.placement.plan import PlacementPlan
from hybridrl.plugins.registry import BackendEntry, Registry, RegistryError, load_object
from hybridrl.roles import role_spec
from hybridrl.weights.experts import moe_layout_problem

Problems = list[tuple[str, str]]

logger = logging.getLogger(__name__)


#: files holding an HF model's weights, and those of which a tokenizer is made (any one of them).
WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin")
TOKENIZER_GLOBS = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "*.tiktoken")


def model_problems(cfg: RunConfig) -> Problems:
    """The policy's model folder (or tiny tokenizer), and the weights of every other model folder a role loads:
    found here rather than as a traceback from a worker after start-up."""
    problems: Problems = []
    if cfg.model.tiny is not None:
        from hybridrl.model.tiny import tokenizer_problem

        problem = tokenizer_problem(cfg.model.tiny)
        problems += [] if problem is None else [("model.tiny.tokenizer", problem)]
    else:
        problems += model_folder_problems("model.path", Path(cfg.model.path or ""), tokenizer=True)
    others = [("roles.critic.model_path", cfg.roles.critic.model_path if cfg.roles.critic is not None else None),
              ("roles.reward.model.path", cfg.roles.reward.model.path if cfg.roles.reward.model is not None else None)]
    for key, path in others:
        if path is not None and (Path(path) / "config.json").is_file():  # a missing config is check_config's
            problems += model_folder_problems(key, Path(path), tokenizer=False)
    return problems


def model_folder_problems(key: str, path: Path, tokenizer: bool) -> Problems:
    """An HF model folder holds its config, its weights (every shard its index lists) and, for the policy,
    a tokenizer."""
    if not path.exists():
        return [(key, f"'{path}' does not exist")]
    if not (path / "config.json").is_file():
        return [(key, f"'{path}' is not an HF checkpoint folder (no config.json)")]
    problems: Problems = []
    try:
        layout = moe_layout_problem(json.loads((path / "config.json").read_text()))
    except (OSError, ValueError, AttributeError):  # an unreadable config is reported where it is loaded
        layout = None
    if layout is not None:
        problems.append((key, f"'{path}': {layout}"))
    for index in sorted(path.glob("*.index.json")):
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as exc:
            problems.append((key, f"'{index}' is not a weight index ({exc})"))
            continue
        missing = [name for name in shards if not (path / name).is_file()]
        if missing:
            problems.append((key, f"'{path}' lacks {len(missing)} of the {len(shards)} weight files {index.name} lists "
                                  f"({', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''})"))
    if not any(next(path.glob(g), None) for g in WEIGHT_GLOBS):
        problems.append((key, f"'{path}' holds no weights "
                              "(no *.safetensors or pytorch_model*.bin next to its config.json)"))
    if tokenizer and not any(next(path.glob(g), None) for g in TOKENIZER_GLOBS):
        problems.append((key, f"'{path}' holds no tokenizer (none of {', '.join(TOKENIZER_GLOBS)}); copy the "
                              "tokenizer files of the model it was trained from into it"))
    return problems


def load_policy_tokenizer(cfg: RunConfig, problems: Problems) -> Any | None:
    """The policy's tokenizer, read without writing anything (a tiny model's is made in memory), or None with a
    problem added: one that does not load, or that encodes text to no tokens (an empty vocabulary)."""
    key = "model.tiny.tokenizer" if cfg.model.tiny is not None else "model.path"
    try:
        if cfg.model.tiny is not None:
            from hybridrl.model.tiny import tiny_tokenizer

            tokenizer = tiny_tokenizer(cfg.model.tiny)
        else:
            from hybridrl.model.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(cfg.model.path)
    except Exception as exc:  # noqa: BLE001 - whatever the tokenizer's loader raises, the run cannot start
        problems.append((key, f"the tokenizer does not load: {type(exc).__name__}: {str(exc).strip().splitlines()[0]}"))
        return None
    if not tokenizer("reverse 12 -> hello", add_special_tokens=False)["input_ids"]:
        problems.append((key, f"the tokenizer encodes text to no tokens (a vocabulary of {len(tokenizer)}): its "
                              "files are missing or empty"))
        return None
    return tokenizer


def model_signatures(cfg: RunConfig, trained: list[str]) -> dict[str, Any] | None:
    """Each trained role's model shape (``hybridrl.run.compat``), recorded in its checkpoints and compared on
    resume; None when transformers cannot build the model from its config here (custom code): the engines
    may still load it, so the run goes on without the shape check."""
    from hybridrl.run.compat import role_signatures

    try:
        return role_signatures(cfg, trained)
    except Exception as exc:  # noqa: BLE001 - whatever building the config raises, the check is skipped
        logger.warning("the model's shape is not recorded (transformers cannot build it from its config here: "
                       "%s: %s); a resume will not compare it", type(exc).__name__, exc)
        return None


def tracker_problems(cfg: RunConfig, registry: Registry) -> Problems:
    """Trackers whose package is missing (a tracker class lists them in ``requires``: module -> pip name),
    found here instead of after the workers have started."""
    problems: Problems = []
    for name in cfg.trainer.trackers:
        try:
            cls = registry.get("tracker", name)
        except RegistryError:
            continue  # an unknown tracker is reported by check_config
        for module, install in getattr(cls, "requires", {}).items():
            if importlib.util.find_spec(module) is None:
                problems.append(("trainer.trackers", f"the '{name}' tracker needs the '{module}' package, which is "
                                                     f"not installed: pip install {install}  (or drop '{name}')"))
    return problems


def checkpoint_problems(cfg: RunConfig, registry: Registry, trained: dict[str, str],
                        resume_from: Path | None) -> Problems:
    """When ``save_every`` asks for checkpoints or a run resumes (from ``resume_from``), train backends (role ->
    backend of the trained roles) that declare the ``checkpoint`` capability (read from the registry: no engine
    is imported). The run folder and the checkpoint to resume are ``hybridrl.run.run_folder``'s."""
    problems: Problems = []
    for role, backend in trained.items():
        try:
            entry = registry.backend("train", backend)
        except RegistryError:  # an unknown backend is reported by check_config
            continue
        if entry.can("checkpoint"):
            continue
        if cfg.trainer.save_every > 0:
            problems.append(("trainer.save_every", f"the '{backend}' backend of roles.{role} cannot save "
                                                   "checkpoints; set trainer.save_every=0 or use another backend"))
        if resume_from is not None:
            problems.append(("trainer.resume", f"the '{backend}' backend of roles.{role} cannot load checkpoints; "
                                               "set trainer.resume=never or use another backend"))
    return problems


def option_problems(cfg: RunConfig, backends: dict[str, BackendEntry]) -> Problems:
    """Each backend's own check of the settings its role hands it (``BackendEntry.check_options``), before any
    process starts. A key the check names is placed under ``roles.<role>.<key>`` when it is one of the role's
    typed keys or a shared training setting, else under ``roles.<role>.options.<key>``."""
    from hybridrl.runtime.launch import role_settings

    problems: Problems = []
    for role, entry in backends.items():
        problems += typed_option_problems(cfg, role, entry)
        if entry.check_options is None or any(k.startswith(f"roles.{role}.options") for k, _ in problems):
            continue
        try:
            check = load_object(entry.check_options)
        except (ImportError, AttributeError, RegistryError) as exc:
            problems.append((f"roles.{role}.backend", f"backend '{entry.name}' (plugin {entry.plugin}): cannot load "
                                                      f"its options check {entry.check_options}: {exc}"))
            continue
        training, options = role_settings(cfg, role)
        typed = set(type(getattr(cfg.roles, role)).model_fields) | {f.name for f in dataclasses.fields(training)}
        for key, reason in check(role, options, training):
            if not key:
                path = f"roles.{role}.options"
            elif key in typed and key != "options":
                path = f"roles.{role}.{key}"
            else:
                path = f"roles.{role}.options.{key}"
            problems.append((path, reason))
    return problems


def typed_option_problems(cfg: RunConfig, role: str, entry: BackendEntry) -> Problems:
    """``roles.<role>.options`` validated against the backend's options model, when it registered one
    (``hybridrl.engines.options.BackendOptions``), each problem under its key path."""
    from hybridrl.engines.options import is_options_model

    if entry.options is None:
        return []
    try:
        model = entry.hook("options")
    except RegistryError as exc:
        return [(f"roles.{role}.backend", str(exc))]
    if not is_options_model(model):
        return []
    _, found = model.read(getattr(cfg.roles, role).options)
    backend = f"unknown option of the {entry.name} backend"
    return [(f"roles.{role}.options" + (f".{key}" if key else ""), reason.replace("unknown option", backend, 1))
            for key, reason in found]


def capability_problems(plan: PlacementPlan, backends: dict[str, BackendEntry]) -> Problems:
    """What the placed roles need of their backends, from the registry's declarations: the critic's value head,
    the reward model's scoring head, and no more ranks than a backend can span."""
    problems: Problems = []
    for role, entry in backends.items():
        need = HEAD_CAPABILITY.get(role_spec(role).head or "")
        if need and not entry.can(need):
            problems.append((f"roles.{role}.backend", f"backend '{entry.name}' (plugin {entry.plugin}) has no "
                                                      f"{role_spec(role).head} head for roles.{role} (it does not "
                                                      f"declare '{need}')"))
        ranks = plan.group_of(role).world_size if role in plan.role_pool else 0
        if entry.max_ranks is not None and ranks > entry.max_ranks:
            pool = plan.role_pool[role]
            problems.append((f"pools.{pool}", f"roles.{role} runs on {ranks} devices, but backend '{entry.name}' "
                                              f"spans at most {entry.max_ranks} rank(s); shrink pools.{pool} or "
                                              "give the role a pool of its own"))
    return problems


def resume_fit_problems(folder: Path, trained: dict[str, str], signatures: dict[str, Any], data_rows: int) -> Problems:
    """Everything the checkpoint depends on must be this run's: every trained role, saved by the same backend
    (formats differ), from a model of the same shape, and the same number of prompts (its data position)."""
    from hybridrl.run import compat

    try:
        summary = compat.read_summary(folder)
    except (OSError, json.JSONDecodeError) as exc:
        return [("trainer.resume", f"cannot read the summary of '{folder}': {exc}")]
    saved = summary.get("roles", {})
    problems: Problems = []
    for role, backend in trained.items():
        if role not in saved:
            problems.append(("trainer.resume", f"checkpoint '{folder}' holds no {role} state (saved by a run with "
                                               "another algorithm?); start a new run (another trainer.out, or "
                                               "trainer.resume=never with --overwrite)"))
        elif saved[role] != backend:
            problems.append(("trainer.resume", f"checkpoint '{folder}' holds a '{saved[role]}' {role}, this run uses "
                                               f"'{backend}'"))
    recorded = compat.saved_signatures(summary)
    if recorded is not None:
        problems += [("trainer.resume", p) for p in compat.shape_problems(folder, recorded, signatures)]
    rows = compat.data_rows_problem(folder, summary, data_rows)
    if rows:
        problems.append(("trainer.resume", rows))
    return problems


def context_problems(cfg: RunConfig, model_path: str, longest_prompt: int) -> Problems:
    """The longest prompt plus ``max_new_tokens`` must fit the model's positions."""
    limit = max_positions(cfg, model_path)
    total = longest_prompt + cfg.roles.rollout.max_new_tokens
    if limit is None or total <= limit:
        return []
    return [("roles.rollout.max_new_tokens",
             f"the longest prompt ({longest_prompt} tokens; data.max_prompt_len={cfg.data.max_prompt_len}) plus "
             f"roles.rollout.max_new_tokens={cfg.roles.rollout.max_new_tokens} is {total} tokens, more than the "
             f"model's max_position_embeddings={limit}")]


def max_positions(cfg: RunConfig, model_path: str) -> int | None:
    if cfg.model.tiny is not None:
        return cfg.model.tiny.max_position
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        if isinstance(config.get(key), int):
            return config[key]
    return None
