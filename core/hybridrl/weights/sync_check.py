"""After a weight sync, does the rollout engine generate with the actor's weights? (``trainer.sync_check_every``)

A reshard can go wrong silently: a tensor left behind, a stale prefix cache, a wrong slice of a packed
parameter. The training still runs, only off-policy. The check: the rollout generates greedily for a few of
the step's prompts, the actor scores the same tokens teacher-forced, and each generated token must be the
actor's argmax at its position, or within ``tie_tolerance`` of it (a near-tie: bf16 engines differ in the
last bits). Teacher forcing makes every position a check of its own, even after a near-tie sent the rollout
down another path than the actor would have taken.

The driver runs it right after the rollout wakes (colocated) or before generating (split), that is after the
sync of the previous step; engines that cannot score margins (``TrainEngine.compute_greedy_margins``) turn it
off with a note.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridrl.engines import SamplingParams
from hybridrl.engines.batch import GROUP_INDEX, PROMPT_IDS, PROMPT_MASK, RESPONSE_MASK, Batch, first_row_of_each_group

GREEDY_MARGIN = "greedy_margin"


@dataclass
class SyncCheck:
    every: int = 0  # steps between checks; 0: never
    rows: int = 8  # prompts checked (the first row of each of the first groups)
    tokens: int = 32  # greedy tokens per prompt (at most the rollout's max_new_tokens)
    tie_tolerance: float = 0.05  # logit gap under which another token is an acceptable argmax (``for_dtype``)

    @classmethod
    def for_dtype(cls, every: int, dtype: str) -> SyncCheck:
        """16-bit models get a wider near-tie: bfloat16 logits of magnitude 16-32 are 0.125 apart, and on the
        H200 gaps of one such step (0.0625 at magnitude 8-16) were seen between vLLM/SGLang and the FSDP actor
        holding the same weights; wrong weights put the rollout's tokens whole units below the argmax."""
        return cls(every=every, tie_tolerance=0.05 if dtype in ("float32", "float64") else 0.25)

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def prompts(self, batch: Batch) -> Batch:
        """One row per prompt group (the step's rows repeat each prompt ``n_samples`` times), at most ``rows``."""
        if GROUP_INDEX in batch:
            index = list(first_row_of_each_group(batch[GROUP_INDEX].tolist()).values())[: self.rows]
        else:
            index = list(range(min(self.rows, len(batch))))
        return batch.index(index).select(PROMPT_IDS, PROMPT_MASK)

    def params(self, sampling: SamplingParams) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_new_tokens=min(self.tokens, sampling.max_new_tokens),
                              ignore_eos=sampling.ignore_eos, logprobs=False)

    def metrics(self, generated: Batch, margins: torch.Tensor) -> dict[str, float]:
        """``sync_check/*``: tokens checked, the share that is the actor's exact argmax, rows whose every token
        is, tokens off the argmax by more than the tolerance (0 after a good sync), and the largest gap."""
        mask = generated[RESPONSE_MASK].bool()
        gaps = margins.float().masked_fill(~mask, 0.0)
        checked = gaps[mask]
        n = int(mask.sum())
        return {"sync_check/tokens": float(n),
                "sync_check/argmax_fraction": float((checked == 0).float().mean()) if n else 1.0,
                "sync_check/rows_equal": float((gaps == 0).all(dim=1).float().mean()) if len(gaps) else 1.0,
                "sync_check/off_argmax": float((checked > self.tie_tolerance).sum()),
                "sync_check/max_gap": float(checked.max()) if n else 0.0}


def greedy_margins(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``max(logits) - logits[label]`` at each position, fp32, >= 0 (0: the label is an argmax). For train
    engines implementing ``compute_greedy_margins``; ``logits`` (..., V), ``labels`` (...)."""
    picked = logits.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    return (logits.max(dim=-1).values.float() - picked.float()).clamp_min(0.0)
