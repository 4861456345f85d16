"""Dynamic sampling (DAPO): keep the prompt groups whose samples disagree, and fill a step with them.

A group whose samples all score the same has advantages of zero under a group-relative estimator (GRPO,
RLOO): it costs a forward and a backward and teaches nothing. With ``algorithm.filter_groups`` the trainer
drops such groups and generates more prompts until the step holds ``data.prompts_per_step`` informative
groups, or stops the run after ``algorithm.max_refills`` extra batches in one step (a task too easy or too
hard for the policy, or samples that never differ).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from hybridrl.engines.batch import GROUP_INDEX, PROMPT_IDS, PROMPT_MASK, RESPONSE_IDS, SCORES, Batch
from hybridrl.run.faults import RunFailure


class GroupsNeverDiffer(RunFailure):
    """``algorithm.filter_groups`` could not fill a step: every group of every refill scored uniformly."""


def informative_groups(scores: torch.Tensor, group_index: torch.Tensor, atol: float = 1e-6) -> list[int]:
    """The groups, in order of first appearance, whose samples do not all share one score."""
    keep = []
    for group in dict.fromkeys(group_index.tolist()):
        group_scores = scores[group_index == group]
        if float(group_scores.max() - group_scores.min()) > atol:
            keep.append(group)
    return keep


def concat_padded(batches: Sequence[Batch], pad_id: int) -> Batch:
    """Rows of batches generated separately, in one batch: prompts left-padded and responses (every tensor
    as wide as a batch's ``response_ids``) right-padded to the widest, ids with ``pad_id`` and the rest with 0."""
    if len(batches) == 1:
        return batches[0]
    prompt_width = max(b[PROMPT_IDS].shape[1] for b in batches)
    response_width = max(b[RESPONSE_IDS].shape[1] for b in batches)
    padded = []
    for b in batches:
        own_prompt, own_response = b[PROMPT_IDS].shape[1], b[RESPONSE_IDS].shape[1]
        tensors = {}
        for key, value in b.tensors.items():
            fill = pad_id if key.endswith("_ids") else 0
            if key in (PROMPT_IDS, PROMPT_MASK):
                value = F.pad(value, (prompt_width - own_prompt, 0), value=fill)
            elif value.dim() == 2 and value.shape[1] == own_response:
                value = F.pad(value, (0, response_width - own_response), value=fill)
            tensors[key] = value
        padded.append(Batch.from_tensors(tensors, b.non_tensors, b.info))
    return Batch.concat(padded)


def merge_batch_metrics(rows: Sequence[dict[str, float]]) -> dict[str, float]:
    """The metrics of several equally large batches as one: ``*/max`` the largest, ``*/min`` the smallest,
    anything else the mean."""
    merged: dict[str, float] = {}
    for key in dict.fromkeys(k for row in rows for k in row):
        values = [row[key] for row in rows if key in row]
        merged[key] = max(values) if key.endswith("/max") else min(values) if key.endswith("/min") \
            else sum(values) / len(values)
    return merged


@dataclass
class GroupFilter:
    """Gathers informative groups over one step's generations (the first batch and its refills)."""

    groups_needed: int
    max_refills: int
    pad_id: int = 0
    kept: list[Batch] = field(default_factory=list)
    kept_groups: int = 0
    seen_groups: int = 0
    batches: int = 0

    def add(self, batch: Batch) -> None:
        """Keep ``batch``'s informative groups (renumbered after those kept so far) until the step is full."""
        self.batches += 1
        group_index = batch[GROUP_INDEX]
        self.seen_groups += len(set(group_index.tolist()))
        keep = informative_groups(batch[SCORES], group_index)[: self.groups_needed - self.kept_groups]
        if not keep:
            return
        rows = torch.cat([torch.nonzero(group_index == g).flatten() for g in keep])
        part = batch.index(rows)
        renumber = {g: self.kept_groups + i for i, g in enumerate(keep)}
        part.set(GROUP_INDEX, torch.tensor([renumber[g] for g in part[GROUP_INDEX].tolist()]))
        self.kept.append(part)
        self.kept_groups += len(keep)

    @property
    def full(self) -> bool:
        return self.kept_groups >= self.groups_needed

    def check_refill(self) -> None:
        """Raise when the step may not generate another batch."""
        if self.batches > self.max_refills:
            raise GroupsNeverDiffer(
                f"algorithm.filter_groups: {self.batches} prompt batches ({self.seen_groups} groups) gave "
                f"{self.kept_groups} of the {self.groups_needed} groups a step needs whose samples score "
                f"differently (algorithm.max_refills={self.max_refills}): the task is too easy or too hard for the "
                "policy, or its samples never differ (roles.rollout.temperature, the engine's seeding)")

    def batch(self) -> Batch:
        return concat_padded(self.kept, self.pad_id)

    def metrics(self) -> dict[str, float]:
        return {"filter/dropped_share": 1.0 - self.kept_groups / max(self.seen_groups, 1),
                "filter/refills": float(self.batches - 1)}
