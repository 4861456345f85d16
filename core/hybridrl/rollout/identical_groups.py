"""Groups whose samples all came back the same: a rollout that does not sample.

With a group-relative advantage (GRPO's, RLOO's) a group of identical responses has identical scores and an
advantage of 0: when every group is like that, nothing is learnt, and nothing else says so. Greedy settings are
refused before the run (``hybridrl.run.preflight``); this catches the rest (a backend whose seeds repeat per
sample, a temperature too low for the model's confidence): ``rollout/identical_groups`` is logged every step,
and ``IdenticalGroupsWarning.observe`` warns once when every group was identical ``STEPS`` steps in a row.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

#: steps in a row with every group identical before the warning.
STEPS = 3


def identical_group_share(response_ids: torch.Tensor, real: torch.Tensor, group_index: torch.Tensor) -> float | None:
    """The share of groups (of two samples or more) whose responses are token-identical; ``real``: (B, R) 1 on
    each row's real response tokens. None when no group has two samples."""
    groups, inverse, counts = torch.unique(group_index, return_inverse=True, return_counts=True)
    several = counts > 1
    if not bool(several.any()):
        return None
    tokens = response_ids.masked_fill(real == 0, -1)  # padding and whatever lies past a row's end compare equal
    rows = torch.arange(len(group_index))
    first = torch.full((len(groups),), len(group_index), dtype=torch.long).scatter_reduce(0, inverse, rows, "amin")
    same = (tokens == tokens[first[inverse]]).all(-1)  # each row against its group's first
    differs = torch.zeros(len(groups), dtype=torch.bool).index_put((inverse,), ~same, accumulate=True)
    return int((~differs[several]).sum()) / int(several.sum())


class IdenticalGroupsWarning:
    """Counts steps in a row whose every group was identical; warns once, at ``STEPS``."""

    def __init__(self, steps: int = STEPS) -> None:
        self.steps = steps
        self.in_row = 0
        self.warned = False

    def observe(self, share: float | None, temperature: float, n_samples: int) -> None:
        self.in_row = self.in_row + 1 if share == 1.0 else 0
        if self.in_row >= self.steps and not self.warned:
            self.warned = True
            log.warning("roles.rollout: the %d samples of every prompt came back token-identical for %d steps in a "
                        "row (rollout/identical_groups=1.0): the rollout is not sampling, so a group-relative "
                        "advantage is 0 for every response and nothing is learnt. Likely causes: a temperature too "
                        "low (roles.rollout.temperature=%g) or a backend that reuses one seed for every sample of a "
                        "prompt", n_samples, self.in_row, temperature)


def identical_groups_metrics(batch: object, warning: IdenticalGroupsWarning, temperature: float,
                             n_samples: int) -> dict[str, float]:
    """``rollout/identical_groups`` for a generated batch (none with one sample per prompt), fed to ``warning``."""
    from hybridrl.engines.batch import GROUP_INDEX, RESPONSE_IDS, response_attention_mask

    share = identical_group_share(batch[RESPONSE_IDS], response_attention_mask(batch), batch[GROUP_INDEX])
    warning.observe(share, temperature, n_samples)
    return {} if share is None else {"rollout/identical_groups": share}
