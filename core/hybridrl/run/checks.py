"""Pre-flight checks of what a training run needs beyond a valid config: files, packages, the reward
function's behaviour, the model's context length, checkpoint support. Each returns ``(key path, reason)``
problems so that ``prepare_run`` reports them all at once, before any process starts."""

from __future__ import annotations

import importlib.util
import json
import numbers
from pathlib import Path
from typing import Any, Callable

from hybridrl.config import RunConfig
from hybridrl.placement.plan import PlacementPlan
from hybridrl.plugins.capabilities import HEAD_CAPABILITY
from hybridrl.plugins.registry import BackendEntry, Registry, RegistryError
from hybridrl.roles import role_spec

Problems = list[tuple[str, str]]


def model_problems(cfg: RunConfig) -> Problems:
    if cfg.model.tiny is not None:
        from hybridrl.tasks.tiny_model import tokenizer_problem

        problem = tokenizer_problem(cfg.model.tiny)
        return [] if problem is None else [("model.tiny.tokenizer", problem)]
    if cfg.model.path is None:
        return []
    path = Path(cfg.model.path)
    if not path.exists():
        return [("model.path", f"'{path}' does not exist")]
    if not (path / "config.json").is_file():
        return [("model.path", f"'{path}' is not an HF checkpoint folder (no config.json)")]
    return []


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


def checkpoint_problems(cfg: RunConfig, registry: Registry, trained: dict[str, str]) -> Problems:
    """``trainer.out`` usable, ``trainer.resume`` pointing at a checkpoint, and, when ``save_every`` asks
    for checkpoints or a run resumes, train backends (role -> backend of the trained roles) that declare the
    ``checkpoint`` capability (read from the registry: no engine is imported)."""
    from hybridrl.run import checkpoint as ckpt

    problems: Problems = []
    out = Path(cfg.trainer.out)
    if out.exists() and not out.is_dir():
        problems.append(("trainer.out", f"'{out}' exists and is not a folder"))
    try:
        resume_from = ckpt.resolve_resume(cfg.trainer.resume, out)
    except ckpt.CheckpointError as exc:
        problems.append(("trainer.resume", str(exc).removeprefix("trainer.resume: ")))
        resume_from = None
    if resume_from is not None:
        problems += _resume_fit_problems(resume_from, trained)
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


def _resume_fit_problems(folder: Path, trained: dict[str, str]) -> Problems:
    """The checkpoint must hold every trained role, saved by the same backend (formats differ)."""
    from hybridrl.run import checkpoint as ckpt

    try:
        saved = json.loads((folder / ckpt.DRIVER_SUMMARY).read_text()).get("roles", {})
    except (OSError, json.JSONDecodeError) as exc:
        return [("trainer.resume", f"cannot read {folder / ckpt.DRIVER_SUMMARY}: {exc}")]
    problems: Problems = []
    for role, backend in trained.items():
        if role not in saved:
            problems.append(("trainer.resume", f"checkpoint '{folder}' holds no {role} state (saved by a run with "
                                               "another algorithm?); set trainer.resume=never to start afresh"))
        elif saved[role] != backend:
            problems.append(("trainer.resume", f"checkpoint '{folder}' holds a '{saved[role]}' {role}, this run uses "
                                               f"'{backend}'"))
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


def reward_probe_problems(fn: Callable[..., Any] | None, spec: str | None, row: dict[str, Any],
                          prompt_key: str) -> Problems:
    """Call the rule reward once, on the first prompt with an empty response, as the trainer will: it must
    not raise and must return a number (NaN passes here; NaN steps are caught while training)."""
    if fn is None:
        return []
    meta = {k: v for k, v in row.items() if k != prompt_key}
    try:
        value = fn(row[prompt_key], "", **meta)
    except Exception as exc:  # noqa: BLE001 - whatever it raises, the run would crash on it later
        return [("roles.reward.fn", f"'{spec}' raised {type(exc).__name__}: {exc} when probed on the first prompt "
                                    f"with an empty response (fields: {sorted(meta)})")]
    if not is_number(value):
        return [("roles.reward.fn", f"'{spec}' returned {type(value).__name__} {value!r} for the first prompt; a "
                                    "reward must be a number")]
    return []


def is_number(value: Any) -> bool:
    """A real number: Python's, NumPy's, or a one-element tensor (never a string or None)."""
    if isinstance(value, (str, bytes)) or value is None:
        return False
    if isinstance(value, numbers.Real):
        return True
    numel = getattr(value, "numel", None) or getattr(value, "size", None)
    try:
        count = numel() if callable(numel) else numel
        return count == 1 and isinstance(float(value), float)
    except (TypeError, ValueError):
        return False
