"""Groups in flight: over-provisioned generation with partial rollouts (``roles.rollout.oversample``).

A synchronous step waits for its longest response: with ragged, long-tailed lengths the last rows decode at a
batch of a few while the device idles. Here a step keeps ``ceil(oversample * prompts_per_step)`` prompt groups in
flight and asks the engine (``RolloutEngine.generate_until``) to stop as soon as ``prompts_per_step`` of them are
complete. The complete groups are trained; the others stay in flight into the next step:

* with partial rollouts (``roles.rollout.partial``), an unfinished sample keeps its tokens and is resumed as
  prompt + tokens so far, with the rest of its budget, under the weights of the next step;
* without, its group is dropped and its tokens thrown away: the step trains the groups that finish first, which
  favours short responses (the bias of over-sampling without partial rollouts).

Every response token records the actor version that sampled it (``token_versions``) beside its behaviour
log-prob (``rollout_log_probs``), which the truncated importance weight (``algorithm.tis_cap``) corrects with. A
token is trained at most ``trainer.max_staleness`` actor updates after it was sampled: a sample holding an older
token starts again (its tokens are counted as thrown away, never trained).

With ``refill`` (an engine that declares it: hf, vLLM) a round also holds a step's worth of fresh groups that wait:
the engine keeps the target's groups decoding and starts a waiting group each time a running one completes, so
its batch stays full instead of emptying into a tail of a few long rows.

With ``oversample`` 1 every group in flight must finish, nothing is carried over, and a step equals the
synchronous one (the same seeds, the same batch).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridrl.data.loading import PromptRow
from hybridrl.engines.batch import (
    FINISHED,
    GROUP_INDEX,
    MAX_NEW_TOKENS,
    MESSAGES,
    META,
    PROMPT_IDS,
    PROMPT_MASK,
    PROMPT_TEXT,
    RESPONSE_IDS,
    RESPONSE_MASK,
    ROLLOUT_LOG_PROBS,
    TOKEN_VERSIONS,
    Batch,
    left_pad,
    padded_rows,
)


@dataclass
class Sample:
    """One response in the making: its tokens so far, their behaviour log-probs and the versions that sampled
    them, its token budget (``cap``) and whether it has ended."""

    cap: int
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finished: bool = False

    def restart(self) -> int:
        """Throw the tokens away (the sample starts again); returns how many there were."""
        thrown = len(self.tokens)
        self.tokens, self.log_probs, self.versions, self.finished = [], [], [], False
        return thrown


@dataclass
class Group:
    """One prompt and its ``n_samples`` samples, in flight until every sample has finished."""

    gid: int
    row: PromptRow
    samples: list[Sample]

    @property
    def complete(self) -> bool:
        return all(s.finished for s in self.samples)


@dataclass
class StepRollout:
    """What one step's generation did, for its metrics."""

    rounds: int = 0
    resumed_tokens: int = 0  # tokens of the trained samples sampled in earlier steps
    thrown_tokens: int = 0  # tokens generated and thrown away (staleness bound, or no partial rollouts)
    carried_groups: int = 0  # groups left in flight for the next step
    dropped_groups: int = 0  # unfinished groups dropped (without partial rollouts)


class GroupsInFlight:
    """The groups in flight across steps, and the requests and training batches made of them."""

    def __init__(self, prompts_per_step: int, n_samples: int, oversample: float, partial: bool,
                 max_staleness: int, max_new_tokens: int, pad_id: int,
                 response_cap: Callable[[int, int], int] | None = None, refill: bool = False) -> None:
        self.prompts_per_step, self.n_samples = prompts_per_step, n_samples
        self.target = math.ceil(oversample * prompts_per_step - 1e-9)
        self.partial, self.max_staleness = partial, max_staleness
        #: keep ``target`` groups decoding: a round also holds a step's worth of waiting groups, each started by
        #: the engine as a running group completes (``generate_until``'s ``running``, capability ``refill``)
        self.refill = refill
        self.max_new_tokens, self.pad_id = max_new_tokens, pad_id
        #: ``(group id, sample) -> token budget`` (benchmarks force lengths); None: max_new_tokens
        self.response_cap = response_cap
        self.groups: list[Group] = []
        self.waiting: list[PromptRow] = []  # prompts drawn from the loader but not yet in flight
        self.next_gid = 0
        self.step = StepRollout()

    # --- a step's generation --------------------------------------------------------------------------
    def begin_step(self, train_version: int, next_prompts: Callable[[], list[PromptRow]]) -> None:
        """Restart every sample holding a token older than the staleness bound allows for a batch trained
        against actor version ``train_version``, then fill the groups in flight up to the target from the
        loader."""
        self.step = StepRollout()
        oldest_allowed = train_version - self.max_staleness
        for group in self.groups:
            for sample in group.samples:
                if sample.versions and min(sample.versions) < oldest_allowed:
                    self.step.thrown_tokens += sample.restart()
        self.top_up(next_prompts)

    def top_up(self, next_prompts: Callable[[], list[PromptRow]]) -> None:
        """Fill the groups in flight up to the target with new prompts (drawn a loader batch at a time), and
        with refill a step's worth of waiting groups beyond it."""
        while len(self.groups) < self.target + (self.prompts_per_step if self.refill else 0):
            if not self.waiting:
                self.waiting = list(next_prompts())
            self.groups.append(self._new_group(self.waiting.pop(0)))

    def _new_group(self, row: PromptRow) -> Group:
        gid, self.next_gid = self.next_gid, self.next_gid + 1
        caps = [self.response_cap(gid, i) if self.response_cap else self.max_new_tokens for i in range(self.n_samples)]
        return Group(gid, row, [Sample(min(cap, self.max_new_tokens)) for cap in caps])

    @property
    def complete_groups(self) -> int:
        return sum(g.complete for g in self.groups)

    @property
    def needs_more(self) -> bool:
        return self.complete_groups < self.prompts_per_step

    def share_to_complete(self) -> float:
        """The share of the unfinished groups that one more round must complete for the step to have its
        groups (``generate_until``'s ``share``)."""
        unfinished = len(self.groups) - self.complete_groups
        return min(1.0, (self.prompts_per_step - self.complete_groups) / max(unfinished, 1))

    def until_args(self) -> tuple[float, ...]:
        """``generate_until``'s arguments after the batch: ``(share,)``, and with refill the share of the round's
        groups that decode at once (``running``: the target)."""
        if not self.refill:
            return (self.share_to_complete(),)
        unfinished = len(self.groups) - self.complete_groups
        return self.share_to_complete(), min(1.0, self.target / max(unfinished, 1))

    def requests(self) -> tuple[Batch, list[tuple[Group, Sample]]]:
        """The unfinished samples as one generation batch (prompt + tokens so far, the rest of each budget),
        and which sample each row is. With refill the groups that hold tokens come first (they decode at once;
        the fresh ones wait their turn), each part oldest first."""
        groups = [g for g in self.groups if not g.complete]
        if self.refill:
            groups.sort(key=lambda g: not any(s.tokens for s in g.samples))  # stable: oldest first within each
        rows = [(g, s) for g in groups for s in g.samples if not s.finished]
        ids, mask = left_pad([g.row.token_ids + s.tokens for g, s in rows], self.pad_id)
        batch = Batch.from_tensors({
            PROMPT_IDS: ids, PROMPT_MASK: mask,
            GROUP_INDEX: torch.tensor([g.gid for g, _ in rows], dtype=torch.long),
            MAX_NEW_TOKENS: torch.tensor([s.cap - len(s.tokens) for _, s in rows], dtype=torch.long)})
        return batch, rows

    def absorb(self, rows: list[tuple[Group, Sample]], out: Batch, version: int) -> None:
        """A round's results: each row's new tokens (and log-probs, sampled by ``version``) join its sample."""
        self.step.rounds += 1
        mask = out[RESPONSE_MASK].bool()
        lengths = mask.sum(-1).tolist()
        tokens = out[RESPONSE_IDS][mask].tolist()  # every row's kept tokens, row after row: one conversion
        logps = out[ROLLOUT_LOG_PROBS][mask].tolist() if ROLLOUT_LOG_PROBS in out else [0.0] * len(tokens)
        finished = out[FINISHED].tolist()
        start = 0
        for i, (_, sample) in enumerate(rows):
            end = start + lengths[i]
            sample.tokens += tokens[start:end]
            sample.log_probs += logps[start:end]
            sample.versions += [version] * lengths[i]
            sample.finished = bool(finished[i]) or len(sample.tokens) >= sample.cap
            start = end

    def take(self, count: int) -> list[Group]:
        """Up to ``count`` complete groups, the oldest first, out of flight; at the end of a step without partial
        rollouts, the unfinished samples left behind restart."""
        done = [g for g in self.groups if g.complete][:count]
        taken = {id(g) for g in done}
        self.groups = [g for g in self.groups if id(g) not in taken]
        for sample in (s for g in done for s in g.samples if s.versions):
            newest = max(sample.versions)
            self.step.resumed_tokens += sum(v < newest for v in sample.versions)
        return done

    def end_step(self) -> None:
        """What stays in flight for the next step. Without partial rollouts an unfinished group is dropped, its
        tokens thrown away (restarting it would starve a long sample: shorter new groups always finish first)."""
        if not self.partial:
            unfinished = [g for g in self.groups if not g.complete]
            self.step.thrown_tokens += sum(len(s.tokens) for g in unfinished for s in g.samples)
            self.step.dropped_groups = len(unfinished)
            self.groups = [g for g in self.groups if g.complete]
        # with refill, the waiting groups that never started are not carried: they are next step's reserve
        self.step.carried_groups = sum(not self.refill or g.complete or any(s.tokens for s in g.samples)
                                       for g in self.groups)

    # --- the training batch ---------------------------------------------------------------------------
    def batch(self, groups: list[Group], with_messages: bool = False) -> Batch:
        """The groups' samples as the trainer's rows (group by group, ``group_index`` from 0): prompts
        left-padded, responses right-padded to ``max_new_tokens``, with their log-probs and versions."""
        pairs = [(g, s) for g in groups for s in g.samples]
        width = self.max_new_tokens
        ids, mask = left_pad([g.row.token_ids for g, _ in pairs], self.pad_id)
        response, kept = padded_rows([s.tokens for _, s in pairs], width, self.pad_id, torch.long)
        logps, _ = padded_rows([s.log_probs for _, s in pairs], width, 0.0, torch.float32)
        versions, _ = padded_rows([s.versions for _, s in pairs], width, 0, torch.long)
        response_mask = kept.long()
        fields: dict[str, list[Any]] = {PROMPT_TEXT: [g.row.prompt for g, _ in pairs],
                                        META: [g.row.meta for g, _ in pairs]}
        if with_messages:
            fields[MESSAGES] = [g.row.messages for g, _ in pairs]
        order = {id(g): i for i, g in enumerate(groups)}
        return Batch.from_tensors({
            PROMPT_IDS: ids, PROMPT_MASK: mask, RESPONSE_IDS: response, RESPONSE_MASK: response_mask,
            ROLLOUT_LOG_PROBS: logps, TOKEN_VERSIONS: versions,
            GROUP_INDEX: torch.tensor([order[id(g)] for g, _ in pairs], dtype=torch.long)}, fields)

    def metrics(self, batch: Batch, actor_version: int) -> dict[str, float]:
        """Version lag of the trained tokens (updates between the weights that sampled a token and the weights
        it trains against), the share of samples resumed across a weight update, and the tokens resumed and
        thrown away this step."""
        mask = batch[RESPONSE_MASK].bool()
        lag = (actor_version - batch[TOKEN_VERSIONS])[mask].double()
        versions = batch[TOKEN_VERSIONS].masked_fill(~mask, -1)
        first = batch[TOKEN_VERSIONS].masked_fill(~mask, 2**62).amin(-1)
        spans = (versions.amax(-1) > first) & mask.any(-1)
        return {"async/version_lag_mean": float(lag.mean()) if lag.numel() else 0.0,
                "async/version_lag_max": float(lag.max()) if lag.numel() else 0.0,
                "rollout/partial_share": float(spans.double().mean()) if len(batch) else 0.0,
                "rollout/resumed_tokens": float(self.step.resumed_tokens),
                "rollout/thrown_tokens": float(self.step.thrown_tokens),
                "rollout/rounds": float(self.step.rounds),
                "rollout/groups_carried": float(self.step.carried_groups),
                "rollout/groups_dropped": float(self.step.dropped_groups)}

    # --- Stateful -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain data (a checkpoint loads it with ``weights_only``): the groups in flight and waiting prompts."""
        def row(r: PromptRow) -> dict[str, Any]:
            return {"prompt": r.prompt, "token_ids": list(r.token_ids), "meta": r.meta, "messages": r.messages}

        return {"next_gid": self.next_gid, "waiting": [row(r) for r in self.waiting],
                "groups": [{"gid": g.gid, "row": row(g.row),
                            "samples": [{"cap": s.cap, "tokens": s.tokens, "log_probs": s.log_probs,
                                         "versions": s.versions, "finished": s.finished} for s in g.samples]}
                           for g in self.groups]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_gid = int(state["next_gid"])
        self.waiting = [PromptRow(**r) for r in state["waiting"]]
        self.groups = [Group(g["gid"], PromptRow(**g["row"]), [Sample(**s) for s in g["samples"]])
                       for g in state["groups"]]

    def __iter__(self) -> Iterator[Group]:
        return iter(self.groups)


def streams(cfg: Any) -> bool:
    """Whether the run's steps go through the groups in flight (``oversample`` above 1, partial rollouts or
    refill asked for) rather than one batch generated to its end."""
    rollout = cfg.roles.rollout
    return rollout.oversample > 1 or rollout.partial is True or getattr(rollout, "refill", False) is True


def partial_rollouts(cfg: Any, can_partial: bool) -> bool:
    """``roles.rollout.partial`` resolved: auto is on where groups stay in flight (oversampled, or refilled: the
    groups still decoding when a step has its own) and the backend stops early."""
    rollout = cfg.roles.rollout
    if rollout.partial != "auto":
        return bool(rollout.partial)
    return (rollout.oversample > 1 or getattr(rollout, "refill", False) is True) and can_partial


def refills(cfg: Any, can_refill: bool) -> bool:
    """``roles.rollout.refill`` resolved: auto is on where groups are over-provisioned and the backend starts
    waiting groups while it decodes."""
    refill = getattr(cfg.roles.rollout, "refill", False)
    return bool(refill) if refill != "auto" else cfg.roles.rollout.oversample > 1 and can_refill


def streaming_problems(cfg: Any, can_partial: bool, backend: str, multi_turn: bool,
                       can_refill: bool = False) -> list[tuple[str, str]]:
    """Why the groups in flight cannot run with this config (empty: they can)."""
    rollout = cfg.roles.rollout
    problems: list[tuple[str, str]] = []
    if rollout.response_lengths is not None and not rollout.ignore_eos:
        problems.append(("roles.rollout.response_lengths", "forced lengths need roles.rollout.ignore_eos=true (else "
                                                           "a response that stops early is shorter than drawn)"))
    if not streams(cfg):
        return problems
    key = "roles.rollout.oversample" if rollout.oversample > 1 else "roles.rollout.partial"
    if not can_partial:
        problems.append((key, f"the rollout backend '{backend}' cannot stop a generation once enough groups are "
                              "complete (it does not declare the `partial` capability); use a backend that does "
                              "(hf, vllm) or leave oversample at 1 and partial unset"))
    if rollout.refill is True and not can_refill:
        problems.append(("roles.rollout.refill", f"the rollout backend '{backend}' cannot start waiting groups while "
                                                 "it decodes (it does not declare the `refill` capability); use a "
                                                 "backend that does (hf, vllm) or leave refill off"))
    if multi_turn:
        problems.append((key, "multi-turn episodes (environment) are generated whole; leave oversample at 1 and "
                              "partial unset with an environment"))
    return problems


def forced_lengths(cfg: Any) -> Callable[[int, int], int] | None:
    """``(group id, sample) -> response length`` of ``roles.rollout.response_lengths`` (None when unset): a
    lognormal draw seeded by the group's place in the data order and the sample, the same in every run."""
    spec = cfg.roles.rollout.response_lengths
    if spec is None:
        return None
    cap = cfg.roles.rollout.max_new_tokens

    def length(gid: int, sample: int) -> int:
        generator = torch.Generator().manual_seed(spec.seed * 1_000_003 + gid * 4_099 + sample)
        draw = math.exp(math.log(spec.median) + spec.sigma * float(torch.randn((), generator=generator)))
        return max(1, min(cap, round(draw)))

    return length
