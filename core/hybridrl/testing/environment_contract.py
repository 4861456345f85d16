"""``EnvironmentContract``: the battery every environment must pass (subclass it with ``environment = "name"``).

The model is replaced by a ``ScriptedPolicy``: a rollout engine without weights whose turns are the texts of
``actions`` (the i-th turn of every episode says ``actions[i % len(actions)]``), each opened by a marker token
that decoding drops and closed by the model's EOS, with known log-probs. Every episode is played through the
real runner (``hybridrl.environments.runner``) in both modes, and the battery checks, exactly:

* **masks**: the tokens under ``response_mask`` are the policy's turns, in order, and nothing else; the tokens
  under the attention mask but not the trained mask are the environment's observations, in order; the
  rollout log-probs are the policy's on its tokens and 0 on observations;
* **round trip**: splitting a row at its mask gives back each turn and each observation as produced, and an
  environment that keeps its conversation (a ``messages`` attribute, as the tools environment does) renders,
  through the chat template, to exactly the row's prompt and response tokens;
* **limits**: no episode has more than ``max_turns`` model turns or ``max_total_tokens`` response tokens, every
  row ends on a model token, and an episode cut by a limit is marked truncated;
* **modes**: per-request and batched play give identical rows;
* rewards and metrics are finite numbers.

Class attributes: ``environment``, ``options``, ``tools``, ``tool_options``, ``tool_parser``, ``rows`` (data
rows: ``prompt`` plus fields), ``actions``, ``max_turns``, ``max_total_tokens``, ``tokenizer`` (``char`` or
``char_chat``, the bundled tiny model's), ``plain_template``, ``plugins``.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridrl.engines import EngineContext, GeneratedTokens, RolloutEngine, SamplingParams, WeightBucket
from hybridrl.engines.batch import (
    META,
    PROMPT_IDS,
    PROMPT_MASK,
    PROMPT_TEXT,
    RESPONSE_ATTENTION_MASK,
    RESPONSE_IDS,
    RESPONSE_MASK,
    ROLLOUT_LOG_PROBS,
    Batch,
    left_pad,
    right_pad,
)
from hybridrl.environments.spec import EnvironmentSpec
from hybridrl.environments.trajectory import ENV_METRICS, ENV_REWARD, NUM_TURNS, REWARD_PARTS, TRUNCATED

MASKS = "response_mask must be 1 exactly on the model's tokens (its turns, in order) and the attention mask on " \
        "the observations too"
ROUND_TRIP = "the row must split back into the turns and observations the episode produced"
LIMITS = "an episode must respect max_turns and max_total_tokens and end on a model token"
MODES = "per-request and batched play must give the same rows"
FINITE = "rewards and metrics must be finite numbers"

#: the log-prob the scripted policy reports for its i-th token of a turn (distinct, so a shift shows).
def scripted_log_prob(i: int) -> float:
    return -0.25 - 0.01 * i


class ScriptedPolicy(RolloutEngine):
    """A rollout engine without a model: turn ``k`` of an episode is ``[marker] + encode(actions[k % n]) + [EOS]``
    (cut to ``max_new_tokens``). The turn number is read off the context (markers in it), so the same policy
    serves batched rounds and single requests, in any order. ``completions[(prompt, turn)]`` records what it
    said (``prompt``: the context before the first marker)."""

    def __init__(self, ctx: EngineContext, actions: Sequence[str], marker_id: int) -> None:
        super().__init__(ctx)
        from hybridrl.environments.runner import _special_ids, _tokenizer

        self.tokenizer = _tokenizer(ctx.model_path)
        eos, self.pad_id = _special_ids(ctx.model_path)
        self.eos_id = eos[0]
        self.marker_id = int(marker_id)
        self.actions = [self.tokenizer(a, add_special_tokens=False)["input_ids"] for a in actions]
        self.completions: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def turn_of(self, context: Sequence[int]) -> tuple[tuple[int, ...], int]:
        marks = [i for i, t in enumerate(context) if t == self.marker_id]
        prompt = tuple(context[:marks[0]] if marks else context)
        return prompt, len(marks)

    def complete(self, context: Sequence[int], max_new_tokens: int) -> list[int]:
        prompt, turn = self.turn_of(context)
        tokens = ([self.marker_id] + list(self.actions[turn % len(self.actions)]) + [self.eos_id])[:max_new_tokens]
        self.completions[(prompt, turn)] = tokens
        return tokens

    def generate(self, batch: Batch, params: SamplingParams) -> Batch:
        contexts = [row[mask.bool()].tolist() for row, mask in zip(batch[PROMPT_IDS], batch[PROMPT_MASK])]
        turns = [self.complete(c, params.max_new_tokens) for c in contexts]
        ids, mask = right_pad(turns, self.pad_id, width=params.max_new_tokens)
        logps = torch.tensor([[scripted_log_prob(i) for i in range(params.max_new_tokens)]] * len(turns)) * mask
        return Batch.from_tensors({RESPONSE_IDS: ids, RESPONSE_MASK: mask, ROLLOUT_LOG_PROBS: logps.float()})

    async def generate_request(self, prompt_ids: list[int], params: SamplingParams) -> GeneratedTokens:
        # finish out of order: a request waits a little, more for some contexts than others
        await asyncio.sleep(0.001 * (sum(prompt_ids) % 5))
        tokens = self.complete(prompt_ids, params.max_new_tokens)
        return GeneratedTokens(tokens, [scripted_log_prob(i) for i in range(len(tokens))])

    def import_weights(self, bucket: WeightBucket) -> None:
        raise NotImplementedError("the scripted policy has no weights")


def build_policy_model(folder: Path, tokenizer: str = "char_chat") -> Path:
    """A tiny model folder (config and tokenizer; the weights go unused) for the scripted policy's runner.
    ``tokenizer``: ``char``, ``char_chat`` (the bundled ones) or ``qwen2`` (a Qwen2.5-style BPE tokenizer with
    its ChatML template, ``hybridrl.data.fixtures``)."""
    from hybridrl.config import TinyModelConfig
    from hybridrl.model.tiny import build_tiny_model

    if tokenizer == "qwen2":
        from hybridrl.data.fixtures import build_chat_tokenizer

        tokenizer = str(build_chat_tokenizer("qwen2", folder.parent / f"{folder.name}-tokenizer"))
    elif tokenizer not in ("char", "char_chat"):
        raise ValueError(f"the environment kit's tokenizer must be char, char_chat or qwen2, got '{tokenizer}'")
    return build_tiny_model(TinyModelConfig(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                                            intermediate_size=32, max_position=512, tokenizer=tokenizer), folder)


def marker_token(tokenizer: Any) -> int:
    """A special token that opens every scripted turn: decoding drops it, and no prompt of the kit holds it
    (the BOS of the char tokenizers, the pad token of the Qwen-style one, which has no BOS)."""
    for candidate in (tokenizer.bos_token_id, tokenizer.pad_token_id):
        if candidate is not None and candidate != tokenizer.eos_token_id:
            return int(candidate)
    raise ValueError("the tokenizer has no special token to mark scripted turns with")


def play(model_path: Path, spec: EnvironmentSpec, rows: Sequence[dict[str, Any]], actions: Sequence[str],
         max_new_tokens: int = 32, mode: str = "batched") -> tuple[Batch, ScriptedPolicy, list[Any]]:
    """Play ``rows`` with a scripted policy through the runner; returns the rows, the policy and every
    environment the runner built (wrapped to record their observations as tokens)."""
    from dataclasses import replace

    from hybridrl.environments import runner as runner_module

    tokenizer = runner_module._tokenizer(str(model_path))
    policy = ScriptedPolicy(EngineContext(role="rollout", backend="scripted", model_path=str(model_path), rank=0,
                                          world_size=1), actions, marker_token(tokenizer))
    prompts = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    ids, mask = left_pad(prompts, policy.pad_id)
    batch = Batch.from_tensors({PROMPT_IDS: ids, PROMPT_MASK: mask},
                               {PROMPT_TEXT: [r["prompt"] for r in rows],
                                META: [{k: v for k, v in r.items() if k != "prompt"} for r in rows]})
    runner = runner_module.build_runner(replace(spec, mode=mode), str(model_path), max_new_tokens, 0)
    built: list[Any] = []
    factory = runner.factory

    def recording_factory(context: Any, **options: Any) -> Any:
        env = factory(context, **options)
        env.kit_observations = []  # (turn, result) of every step
        step = env.step

        def recorded(turn: Any) -> Any:
            result = step(turn)
            env.kit_observations.append((turn, result))
            return result

        env.step = recorded
        built.append(env)
        return env

    runner.factory = recording_factory
    out = runner_module.run_episodes(policy, batch, SamplingParams(max_new_tokens=max_new_tokens, seed=0),
                                     replace(spec, mode=mode), runner=runner)
    return out, policy, built


def row_segments(batch: Batch, i: int) -> list[tuple[bool, list[int]]]:
    """Row ``i``'s response as ``(trained, tokens)`` runs, in order."""
    attention = batch[RESPONSE_ATTENTION_MASK][i].bool()
    tokens = batch[RESPONSE_IDS][i][attention].tolist()
    trained = batch[RESPONSE_MASK][i][attention].bool().tolist()
    runs: list[tuple[bool, list[int]]] = []
    for token, mark in zip(tokens, trained):
        if not runs or runs[-1][0] != mark:
            runs.append((mark, []))
        runs[-1][1].append(token)
    return runs


class EnvironmentContract:
    """The environment battery (see the module docstring). Subclass with ``environment = "<registered name>"``."""

    environment: str = ""
    options: dict[str, Any] = {}
    tools: tuple[str, ...] = ()
    tool_options: dict[str, dict[str, Any]] = {}
    tool_parser: str | None = "hermes"
    rows: tuple[dict[str, Any], ...] = ({"prompt": "12+30"}, {"prompt": "7+8"}, {"prompt": "100+1"})
    actions: tuple[str, ...] = ("hello",)
    max_turns: int = 3
    max_total_tokens: int = 96
    max_new_tokens: int = 32  # per turn
    tokenizer: str = "char_chat"
    plain_template: str = "{content}"
    plugins: tuple[str, ...] = ()

    # --- fixtures ---------------------------------------------------------------------------------------
    @pytest.fixture(scope="class")
    def policy_model(self, tmp_path_factory: pytest.TempPathFactory) -> Path:
        return build_policy_model(tmp_path_factory.mktemp("env-kit") / self.tokenizer, self.tokenizer)

    def spec(self, **changes: Any) -> EnvironmentSpec:
        if not self.environment:
            pytest.skip("set EnvironmentContract.environment to a registered environment name")
        fields = dict(name=self.environment, options=dict(self.options), max_turns=self.max_turns,
                      max_total_tokens=self.max_total_tokens, tools=tuple(self.tools),
                      tool_options={k: dict(v) for k, v in self.tool_options.items()}, tool_parser=self.tool_parser,
                      plain_template=self.plain_template, plugins=tuple(self.plugins))
        fields.update(changes)
        return EnvironmentSpec(**fields)

    @pytest.fixture(scope="class")
    def played(self, policy_model: Path) -> dict[str, tuple[Batch, ScriptedPolicy, list[Any]]]:
        return {mode: play(policy_model, self.spec(), self.rows, self.actions, self.max_new_tokens, mode)
                for mode in ("batched", "requests")}

    # --- the battery ------------------------------------------------------------------------------------
    def test_masks_mark_exactly_the_model_tokens(self, played, policy_model: Path) -> None:
        chat = runner_for(self.spec(), policy_model).context.chat
        for mode, (batch, policy, envs) in played.items():
            for i in range(len(batch)):
                prompt = tuple(batch[PROMPT_IDS][i][batch[PROMPT_MASK][i].bool()].tolist())
                steps = envs[i].kit_observations
                turns = [turn.token_ids for turn, _ in steps]
                assert len(turns) == int(batch[NUM_TURNS][i]), f"{MASKS}: turn count ({mode}, row {i})"
                for k, tokens in enumerate(turns):  # what the model said, cut to the tokens left
                    said = policy.completions[(prompt, k)]
                    assert tokens and tokens == said[:len(tokens)], f"{MASKS}: turn {k} ({mode}, row {i})"
                trained = batch[RESPONSE_MASK][i].bool()
                assert batch[RESPONSE_IDS][i][trained].tolist() == [t for turn in turns for t in turn], \
                    f"{MASKS} ({mode}, row {i})"
                runs = row_segments(batch, i)
                assert [tokens for is_model, tokens in runs if is_model] == turns, \
                    f"{MASKS}: turn order ({mode}, row {i})"
                got = [tokens for is_model, tokens in runs if not is_model]
                expected = [_closed(chat.step_ids(result.observation), turn, policy.eos_id)
                            for turn, result in steps][:len(got)]
                assert got == expected, f"{MASKS}: the observations differ ({mode}, row {i})"
                assert runs and runs[-1][0], f"{LIMITS}: row {i} does not end on a model token ({mode})"
                logps = batch[ROLLOUT_LOG_PROBS][i]
                want = torch.tensor([scripted_log_prob(k) for turn in turns for k in range(len(turn))])
                assert torch.allclose(logps[trained], want), f"{MASKS}: log-probs ({mode}, row {i})"
                assert (logps[~trained] == 0).all(), f"{MASKS}: observation log-probs must be 0 ({mode}, row {i})"

    def test_tokens_round_trip(self, played, policy_model: Path) -> None:
        runner = runner_for(self.spec(), policy_model)
        chat, schemas = runner.context.chat, runner.context.tools.schemas() or None
        batch, policy, envs = played["batched"]
        for i in range(len(batch)):
            turns = [tokens for is_model, tokens in row_segments(batch, i) if is_model]
            texts = [turn.text for turn, _ in envs[i].kit_observations]
            decoded = [policy.tokenizer.decode(t, skip_special_tokens=True) for t in turns]
            assert decoded == texts, f"{ROUND_TRIP}: the turns the environment read (row {i})"
            messages = getattr(envs[i], "messages", None)
            if messages and chat.has_template and messages[0].get("role") != "assistant":
                last_stopped = envs[i].kit_observations[len(turns) - 1][0].stopped
                rendered = _render_history(chat, messages, len(turns), schemas, last_stopped)
                row = batch[PROMPT_IDS][i][batch[PROMPT_MASK][i].bool()].tolist() + \
                    batch[RESPONSE_IDS][i][batch[RESPONSE_ATTENTION_MASK][i].bool()].tolist()
                assert rendered == _strip(row, policy.marker_id), \
                    f"{ROUND_TRIP}: the conversation renders differently from row {i}"

    def test_max_turns_is_honoured(self, policy_model: Path) -> None:
        for max_turns in (1, 2):
            batch, _, envs = play(policy_model, self.spec(max_turns=max_turns), self.rows, self.actions,
                                  self.max_new_tokens)
            for i in range(len(batch)):
                turns = int(batch[NUM_TURNS][i])
                assert 1 <= turns <= max_turns, f"{LIMITS}: {turns} turns with max_turns={max_turns}"
                assert sum(is_model for is_model, _ in row_segments(batch, i)) == turns, LIMITS
                finished = envs[i].kit_observations[-1][1].done
                assert int(batch[TRUNCATED][i]) == int(not finished), f"{LIMITS}: truncated flag (row {i})"
                assert finished or turns == max_turns, f"{LIMITS}: row {i} stopped early without being done"

    def test_max_total_tokens_is_honoured(self, policy_model: Path) -> None:
        limit = 12
        batch, _, envs = play(policy_model, self.spec(max_total_tokens=limit), self.rows, self.actions,
                              max_new_tokens=8)
        assert batch[RESPONSE_IDS].shape[1] == limit, f"{LIMITS}: the response width must be max_total_tokens"
        for i in range(len(batch)):
            runs = row_segments(batch, i)
            assert sum(len(t) for _, t in runs) <= limit and runs[-1][0], f"{LIMITS} (row {i})"
            finished = envs[i].kit_observations[-1][1].done
            assert int(batch[TRUNCATED][i]) == int(not finished), f"{LIMITS}: truncated flag (row {i})"

    def test_modes_give_the_same_rows(self, played) -> None:
        a, b = played["batched"][0], played["requests"][0]
        for key in (PROMPT_IDS, RESPONSE_IDS, RESPONSE_MASK, RESPONSE_ATTENTION_MASK, NUM_TURNS, ENV_REWARD):
            assert torch.equal(a[key], b[key]), f"{MODES} ({key})"
        assert a[REWARD_PARTS] == b[REWARD_PARTS], MODES

    def test_rewards_and_metrics_are_finite(self, played) -> None:
        for batch, _, _ in played.values():
            assert torch.isfinite(batch[ENV_REWARD]).all(), FINITE
            for parts, metrics in zip(batch[REWARD_PARTS], batch[ENV_METRICS]):
                for value in (*parts.values(), *metrics.values()):
                    assert isinstance(value, float) and math.isfinite(value), FINITE


def runner_for(spec: EnvironmentSpec, model_path: Path) -> Any:
    from hybridrl.environments.runner import build_runner

    return build_runner(spec, str(model_path), 32, 0)


def _closed(observation: list[int], turn: Any, eos_id: int) -> list[int]:
    """An observation as the runner appends it: after a turn cut before its stop token, the EOS first."""
    return observation if turn.stopped else [eos_id, *observation]


def _strip(tokens: Sequence[int], marker: int) -> list[int]:
    return [t for t in tokens if t != marker]


def _render_history(chat: Any, messages: list[dict[str, Any]], n_turns: int,
                    tools: list[dict[str, Any]] | None, last_stopped: bool) -> list[int]:
    """The conversation up to its ``n_turns``-th assistant message rendered as one chat, cut after that turn's
    stop token (what the template writes after it belongs to the next observation), or before it when the
    last turn was cut by a limit (the row then ends without one)."""
    kept: list[dict[str, Any]] = []
    seen = 0
    for m in messages:
        if m.get("role") == "assistant":
            seen += 1
        kept.append(m)
        if seen == n_turns:
            break
    ids = chat._template(kept, False, tools)
    last_stop = max((k for k, t in enumerate(ids) if t in chat.stop_ids), default=len(ids) - 1)
    return ids[:last_stop + 1] if last_stopped else ids[:last_stop]
