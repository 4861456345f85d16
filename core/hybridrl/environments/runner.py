"""Playing episodes next to the rollout engine: ``run_episodes`` (what ``RolloutEngine.generate_episodes`` calls
in the rollout worker) turns a batch of prompt rows into one trained row per trajectory.

Two ways to drive the engine (``EnvironmentSpec.mode``):

* **requests**: every trajectory is a coroutine that awaits one ``engine.generate_request`` per turn and steps
  its environment in a thread pool; an engine with continuous batching (vLLM, SGLang) keeps all requests in
  flight, so a trajectory whose tool is slow or whose conversation is long holds up no other;
* **batched**: each round, the next turn of every live trajectory in one ``engine.generate`` call, then every
  environment's step (any engine; the ``hf`` rollout's simple loop). A round lasts as long as its longest turn.

Both apply the limits the same way (``EpisodeLimits``; see ``hybridrl.environments.base``): a turn gets at most
``min(max_new_tokens, tokens left)`` tokens; after ``max_turns`` turns, or when no token is left, or when an
observation would leave no room for another turn, the episode ends on the model's turn (``truncated``). A turn
cut by a budget before its stop token is closed with the model's first EOS id as context before the next
observation, so every turn in the context ends like a finished one.

An environment marked ``single_turn`` (the default) skips all of this: the batch goes to ``engine.generate``
as it is, which is exactly the single-turn path.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from hybridrl.engines.batch import (
    MESSAGES,
    META,
    PROMPT_IDS,
    PROMPT_MASK,
    PROMPT_TEXT,
    RESPONSE_IDS,
    RESPONSE_MASK,
    ROLLOUT_LOG_PROBS,
    Batch,
    left_pad,
)
from hybridrl.engines.rollout_kit import mix_seed, special_ids, unpad_prompts
from hybridrl.environments.base import Environment, EnvironmentContext, EpisodeLimits, EpisodeRow, ModelTurn, StepResult
from hybridrl.environments.chat import ChatFormat
from hybridrl.environments.spec import EnvironmentSpec
from hybridrl.environments.trajectory import Trajectory, pack_trajectories
from hybridrl.errors import HybridRLError

if TYPE_CHECKING:  # types only: the engine contract runs this module (RolloutEngine.generate_episodes)
    from hybridrl.engines import RolloutEngine, SamplingParams

log = logging.getLogger(__name__)

EnvironmentFactory = Callable[..., Environment]


class EpisodeError(HybridRLError, RuntimeError):
    """An environment raised; the message names it, the row and the turn. ``phase``: ``build``, ``reset`` or
    ``step``."""

    def __init__(self, message: str, phase: str) -> None:
        super().__init__(message)
        self.phase = phase


@lru_cache(maxsize=4)
def _tokenizer(model_path: str) -> Any:
    from hybridrl.model.tokenizer import load_tokenizer

    return load_tokenizer(model_path)


@lru_cache(maxsize=4)
def _special_ids(model_path: str) -> tuple[tuple[int, ...], int]:
    eos, pad = special_ids(model_path)
    return tuple(eos), pad


def episode_rows(batch: Batch) -> list[EpisodeRow]:
    """The rows of a prompt batch as episodes see them (its ``prompt``, ``meta`` and ``messages`` fields when
    it has them)."""
    prompts = unpad_prompts(batch[PROMPT_IDS], batch[PROMPT_MASK])
    n = len(prompts)
    texts = batch[PROMPT_TEXT] if PROMPT_TEXT in batch else [""] * n
    metas = batch[META] if META in batch else [{}] * n
    chats = batch[MESSAGES] if MESSAGES in batch else [None] * n
    return [EpisodeRow(i, str(texts[i]), prompts[i], dict(metas[i] or {}),
                       [dict(m) for m in chats[i]] if chats[i] else None) for i in range(n)]


def turn_seed(seed: int | None, *parts: int) -> int | None:
    """A sampling seed of its own for a (row,) turn; the first turn of a batched round keeps the call's seed,
    so a one-turn episode samples exactly what ``generate`` would."""
    if seed is None or not any(parts):
        return seed
    return mix_seed(seed, *parts) % (2**31 - 1)


class EpisodeRunner:
    """The episodes of one rollout call: their environments, trajectories and limits, and the rules that
    advance a trajectory by one model turn (shared by both modes)."""

    def __init__(self, factory: EnvironmentFactory, context: EnvironmentContext, options: dict[str, Any],
                 name: str, stop_ids: Sequence[int]) -> None:
        self.factory = factory
        self.context = context
        self.options = dict(options)
        self.name = name
        self.stop_ids = list(stop_ids)
        self.limits: EpisodeLimits = context.limits

    # --- one episode ----------------------------------------------------------------------------------
    def start(self, row: EpisodeRow) -> tuple[Environment, Trajectory]:
        start = time.perf_counter()
        try:
            env = self.factory(self.context, **self.options)
        except Exception as exc:
            raise EpisodeError(f"environment '{self.name}' could not be built (environment.options "
                               f"{self.options}): {type(exc).__name__}: {exc}", "build") from exc
        try:
            prompt = self.context.chat.initial_ids(env.reset(row), self.context.tools.schemas() or None)
        except Exception as exc:
            env.close()
            raise EpisodeError(f"environment '{self.name}': reset of row {row.index} failed: "
                               f"{type(exc).__name__}: {exc}", "reset") from exc
        if not prompt:
            env.close()
            raise EpisodeError(f"environment '{self.name}': reset of row {row.index} gave an empty prompt", "reset")
        trajectory = Trajectory(prompt_ids=prompt)
        trajectory.env_seconds += time.perf_counter() - start
        return env, trajectory

    def turn_params(self, params: SamplingParams, trajectory: Trajectory, seed: int | None) -> SamplingParams:
        width = min(int(params.max_new_tokens), self.limits.max_total_tokens - trajectory.length)
        return replace(params, max_new_tokens=width, min_new_tokens=min(int(params.min_new_tokens), width), seed=seed)

    def record_turn(self, trajectory: Trajectory, token_ids: list[int], log_probs: list[float] | None) -> ModelTurn:
        """Append a model turn (cut to the tokens left) and describe it to the environment."""
        room = self.limits.max_total_tokens - trajectory.length
        token_ids = token_ids[:room]
        log_probs = log_probs[:room] if log_probs is not None else None
        index = trajectory.turns
        trajectory.add_model_turn(token_ids, log_probs)
        stopped = bool(token_ids) and token_ids[-1] in self.stop_ids
        last = trajectory.turns >= self.limits.max_turns or trajectory.length >= self.limits.max_total_tokens
        text = self.context.tokenizer.decode(token_ids, skip_special_tokens=True)
        return ModelTurn(list(token_ids), text, stopped, index, last)

    def step(self, env: Environment, turn: ModelTurn, row: int) -> tuple[StepResult, float]:
        start = time.perf_counter()
        try:
            result = env.step(turn)
        except Exception as exc:
            raise EpisodeError(f"environment '{self.name}': step of row {row}, turn {turn.index} failed: "
                               f"{type(exc).__name__}: {exc}", "step") from exc
        if not isinstance(result, StepResult):
            raise EpisodeError(f"environment '{self.name}': step of row {row} returned {type(result).__name__}, "
                               "not a StepResult", "step")
        return result, time.perf_counter() - start

    def apply(self, trajectory: Trajectory, turn: ModelTurn, result: StepResult, env_seconds: float) -> None:
        """Rewards and metrics count always; the observation only when another turn can follow it."""
        trajectory.env_seconds += env_seconds
        trajectory.add_reward(result.reward)
        trajectory.add_metrics(result.metrics)
        if result.done:
            trajectory.done = True
            return
        if turn.last:
            trajectory.done = trajectory.truncated = True
            return
        start = time.perf_counter()
        observation = self.context.chat.step_ids(result.observation)
        trajectory.env_seconds += time.perf_counter() - start
        if not turn.stopped and self.stop_ids:
            observation = [self.stop_ids[0], *observation]
        if trajectory.length + len(observation) >= self.limits.max_total_tokens:
            trajectory.done = trajectory.truncated = True  # no room for a model token after it
            return
        trajectory.add_observation(observation)

    # --- the two modes --------------------------------------------------------------------------------
    def play_batched(self, engine: RolloutEngine, rows: list[EpisodeRow], params: SamplingParams,
                     pad_id: int) -> list[Trajectory]:
        envs, trajectories = self._start_all(rows)
        try:
            for round_index in range(self.limits.max_turns):
                live = [i for i, t in enumerate(trajectories) if not t.done]
                if not live:
                    break
                widest = max(self.turn_params(params, trajectories[i], None).max_new_tokens for i in live)
                round_params = replace(params, max_new_tokens=widest, min_new_tokens=min(params.min_new_tokens, widest),
                                       seed=turn_seed(params.seed, round_index))
                ids, mask = left_pad([trajectories[i].context() for i in live], pad_id)
                out = engine.generate(Batch.from_tensors({PROMPT_IDS: ids, PROMPT_MASK: mask}), round_params)
                lengths = out[RESPONSE_MASK].sum(-1).tolist()
                for k, i in enumerate(live):
                    n = int(lengths[k])
                    tokens = out[RESPONSE_IDS][k, :n].tolist()
                    lps = out[ROLLOUT_LOG_PROBS][k, :n].tolist() if ROLLOUT_LOG_PROBS in out else None
                    turn = self.record_turn(trajectories[i], tokens, lps)
                    result, seconds = self.step(envs[i], turn, i)
                    self.apply(trajectories[i], turn, result, seconds)
        finally:
            for env in envs:
                env.close()
        return trajectories

    def play_requests(self, engine: RolloutEngine, rows: list[EpisodeRow], params: SamplingParams,
                      workers: int) -> list[Trajectory]:
        envs, trajectories = self._start_all(rows)
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hybridrl-env")
        try:
            return engine.run_requests(self._requests(engine, envs, trajectories, params, pool))
        finally:
            pool.shutdown(wait=True)
            for env in envs:
                env.close()

    async def _requests(self, engine: RolloutEngine, envs: list[Environment], trajectories: list[Trajectory],
                        params: SamplingParams, pool: ThreadPoolExecutor) -> list[Trajectory]:
        loop = asyncio.get_running_loop()

        async def episode(i: int) -> None:
            trajectory = trajectories[i]
            while not trajectory.done:
                turn_params = self.turn_params(params, trajectory, turn_seed(params.seed, i + 1, trajectory.turns))
                out = await engine.generate_request(trajectory.context(), turn_params)
                turn = self.record_turn(trajectory, list(out.token_ids), out.log_probs if params.logprobs else None)
                result, seconds = await loop.run_in_executor(pool, self.step, envs[i], turn, i)
                self.apply(trajectory, turn, result, seconds)

        tasks = [asyncio.ensure_future(episode(i)) for i in range(len(trajectories))]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:  # the others would keep requests running in the engine
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return trajectories

    def _start_all(self, rows: list[EpisodeRow]) -> tuple[list[Environment], list[Trajectory]]:
        envs: list[Environment] = []
        trajectories: list[Trajectory] = []
        try:
            for row in rows:
                env, trajectory = self.start(row)
                envs.append(env)
                trajectories.append(trajectory)
        except BaseException:
            for env in envs:
                env.close()
            raise
        return envs, trajectories


def build_runner(spec: EnvironmentSpec, model_path: str | None, max_new_tokens: int, seed: int | None,
                 registry: Any = None, tokenizer: Any = None, stop_ids: Sequence[int] | None = None) -> EpisodeRunner:
    """The runner for ``spec`` with the tokenizer, stop ids, tools and parser of the model at ``model_path``
    (or the ``tokenizer`` and ``stop_ids`` given: the driver's pre-flight, before any model folder exists)."""
    from hybridrl.plugins.discovery import get_registry
    from hybridrl.tools.toolbox import ToolBox

    registry = registry if registry is not None else get_registry(tuple(spec.plugins))
    factory = registry.get("environment", spec.name)
    tokenizer = tokenizer if tokenizer is not None else _tokenizer(model_path)
    eos = tuple(stop_ids) if stop_ids is not None else _special_ids(model_path)[0]
    chat = ChatFormat(tokenizer, eos, spec.plain_template, spec.use_chat_template, spec.chat_template)
    tools = ToolBox.build(registry, spec.tools, spec.tool_options, spec.tool_deadline_s)
    parser = registry.get("tool_parser", spec.tool_parser) if spec.tool_parser else None
    context = EnvironmentContext(tokenizer, chat, spec.limits(max_new_tokens), tools, parser, seed)
    return EpisodeRunner(factory, context, spec.options, spec.name, eos)


def is_single_turn(spec: EnvironmentSpec, registry: Any = None) -> bool:
    """Whether ``spec``'s episodes are plain generations (a ``single_turn`` environment, one turn)."""
    from hybridrl.plugins.discovery import get_registry

    registry = registry if registry is not None else get_registry(tuple(spec.plugins))
    return bool(getattr(registry.get("environment", spec.name), "single_turn", False)) and spec.max_turns == 1


def _declares_requests(engine: RolloutEngine, spec: EnvironmentSpec) -> bool:
    from hybridrl.plugins.discovery import get_registry

    entry = get_registry(tuple(spec.plugins)).backends.get(("rollout", engine.ctx.backend))
    return entry is not None and entry.can("requests")


def run_episodes(engine: RolloutEngine, batch: Batch, params: SamplingParams, spec: EnvironmentSpec,
                 force_loop: bool = False, runner: EpisodeRunner | None = None) -> Batch:
    """One trajectory per row of ``batch`` (see the module docstring). ``force_loop`` plays a single-turn
    environment through the episode loop too (tests compare it with ``generate``); ``runner``: one built by
    ``build_runner`` already (the environment kit wraps its environments)."""
    if not force_loop and runner is None and is_single_turn(spec):
        return engine.generate(batch.select(PROMPT_IDS, PROMPT_MASK), params)
    model_path = engine.ctx.model_path
    if runner is None:
        runner = build_runner(spec, model_path, params.max_new_tokens, params.seed)
    rows = episode_rows(batch)
    _, pad_id = _special_ids(model_path)
    mode = spec.mode
    if mode == "auto":  # the driver resolves it (EnvironmentSpec.resolved); a direct call asks the registry
        mode = spec.resolved(_declares_requests(engine, spec)).mode
    if mode == "requests":
        trajectories = runner.play_requests(engine, rows, params, spec.env_workers)
    else:
        trajectories = runner.play_batched(engine, rows, params, pad_id)
    return pack_trajectories(trajectories, runner.limits.max_total_tokens, pad_id, with_log_probs=params.logprobs)
