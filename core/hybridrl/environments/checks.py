"""Pre-flight checks of the ``environment`` section, each problem under its key path (``hybridrl.run.preflight``
calls them): registered names, the rollout's capability for the per-request mode, what the episode loop does
not support, and, once the model and prompts are there, an episode opened on the longest prompt (in a child
process for user code, so bad options, a failing ``reset`` or one that hangs or exits are reported before any
worker starts) and the context it needs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybridrl.plugins.registry import BackendEntry, Registry, RegistryError

Problems = list[tuple[str, str]]


def environment_problems(cfg: Any, registry: Registry, backends: dict[str, BackendEntry],
                         greedy_baseline: bool) -> Problems:
    """Names, mode and algorithm (no model, no files)."""
    env = cfg.environment
    problems: Problems = []
    for category, name, key in (("environment", env.name, "environment.name"),
                                *(("tool", tool, "environment.tools") for tool in env.tools),
                                *((("tool_parser", env.tool_parser, "environment.tool_parser"),) if env.tool_parser
                                  else ())):
        try:
            registry.get(category, name)
        except RegistryError as exc:
            problems.append((key, str(exc)))
    unused = sorted(set(env.tool_options) - set(env.tools))
    if unused:
        problems.append(("environment.tool_options", f"options for tool(s) {unused} that environment.tools does not "
                                                     "list"))
    problems += tool_option_problems(env.tools, env.tool_options, registry)
    rollout = backends.get("rollout")
    if env.mode == "requests" and rollout is not None and not rollout.can("requests"):
        problems.append(("environment.mode", f"requests needs a rollout backend that serves single requests; "
                                             f"'{rollout.name}' does not declare the 'requests' capability "
                                             "(use batched or auto)"))
    if multi_turn(cfg, registry) and greedy_baseline:
        problems.append(("environment.name", f"algorithm '{cfg.algorithm.name}' compares each sample with a greedy "
                                             "single generation, which multi-turn episodes do not have"))
    return problems


def tool_option_problems(tools: Sequence[str], options: dict[str, dict[str, Any]], registry: Registry) -> Problems:
    """Each registered tool built with its ``environment.tool_options.<name>`` (tools are cheap to build and
    keep no state), so an unknown or out-of-range option is reported under its tool's key before any worker
    starts, rather than by the first rollout call."""
    problems: Problems = []
    for name in tools:
        try:
            factory = registry.get("tool", name)
        except RegistryError:
            continue  # reported under environment.tools
        given = dict(options.get(name, {}))
        key = f"environment.tool_options.{name}" if given else "environment.tools"
        try:
            factory(**given)
        except TypeError as exc:
            problems.append((key, f"tool '{name}' does not take the option(s) {sorted(given)}: {exc}" if given
                             else f"tool '{name}' could not be built without options: {exc}"))
        except (ValueError, OSError) as exc:
            problems.append((key, str(exc) if name in str(exc) else f"tool '{name}': {exc}"))
    return problems


def multi_turn(cfg: Any, registry: Registry) -> bool:
    """Whether the run plays episodes (anything but the single-turn default)."""
    from hybridrl.environments.runner import is_single_turn
    from hybridrl.environments.spec import EnvironmentSpec

    try:
        return not is_single_turn(EnvironmentSpec(name=cfg.environment.name, max_turns=cfg.environment.max_turns),
                                  registry)
    except RegistryError:
        return cfg.environment.name != "single_turn"


#: seconds an environment's first episode may take to build and reset at pre-flight, in its own process.
PROBE_TIMEOUT_S = 60.0


def probe_problems(cfg: Any, registry: Registry, tokenizer: Any, prompts: Sequence[Any],
                   max_positions: int | None) -> Problems:
    """Open an episode on the longest prompt (with the policy's tokenizer; nothing is written): the environment
    builds with its options and resets, and its opening plus ``max_total_tokens`` fits the model's positions.
    An environment of hybridrl's own opens in the driver; any other in a spawned child with a deadline of
    ``PROBE_TIMEOUT_S`` (``hybridrl.run.guarded_call``), so that one that hangs, exits or kills its process is
    one problem under ``environment.name``, not a driver that never returns or ends without a word."""
    from hybridrl.environments.base import EpisodeRow
    from hybridrl.run.guarded_call import ChildFailure, call_in_child

    if not prompts or not multi_turn(cfg, registry):
        return []
    longest = max(prompts, key=lambda p: len(p.token_ids))
    row = EpisodeRow(0, longest.prompt, list(longest.token_ids), dict(longest.meta), longest.messages)
    entry = registry.named.get(("environment", cfg.environment.name))
    if entry is not None and isinstance(entry.target, str) and entry.target.startswith("hybridrl."):
        return probe_episode(cfg, registry, tokenizer, row, max_positions)
    try:
        return call_in_child(probe_episode, (cfg, None, tokenizer, row, max_positions), PROBE_TIMEOUT_S, noted=True)
    except ChildFailure as exc:
        return [("environment.name", f"environment '{cfg.environment.name}' {exc.reason} while its first episode "
                                     "was built and reset on the longest prompt, in a process of its own; an "
                                     "environment must return from reset, not hang or end its process")]


def probe_episode(cfg: Any, registry: Registry | None, tokenizer: Any, row: Any, max_positions: int | None
                  ) -> Problems:
    """``probe_problems``'s episode, in the driver or in a child (``registry`` None: the child builds its own)."""
    from hybridrl.environments.runner import EpisodeError, build_runner
    from hybridrl.environments.spec import EnvironmentSpec
    from hybridrl.run.guarded_call import note

    try:
        spec = EnvironmentSpec.from_config(cfg)
        stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        runner = build_runner(spec, None, cfg.roles.rollout.max_new_tokens, cfg.trainer.seed, registry,
                              tokenizer=tokenizer, stop_ids=stop)
    except (ValueError, TypeError, OSError) as exc:
        return [("environment", f"{type(exc).__name__}: {exc}")]
    note(f"environment '{cfg.environment.name}'")  # its build and reset: the user code's time from here
    try:
        env, trajectory = runner.start(row)
        env.close()
    except EpisodeError as exc:
        return [("environment.options" if exc.phase == "build" else "environment.name", str(exc))]
    total = len(trajectory.prompt_ids) + runner.limits.max_total_tokens
    if max_positions is not None and total > max_positions:
        return [("environment.max_total_tokens",
                 f"an episode's opening ({len(trajectory.prompt_ids)} tokens for the longest prompt) plus "
                 f"max_total_tokens={runner.limits.max_total_tokens} is {total} tokens, more than the model's "
                 f"max_position_embeddings={max_positions}")]
    return []
