"""The fixed input of the vocabulary-parallel log-prob tests (shared by the test and its two-rank worker)."""

from __future__ import annotations

import torch

PADDED = 12  # the padded vocabulary: ids VOCAB..PADDED-1 are padding whose logits must be ignored
VOCAB = 9


def case() -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor, torch.Tensor]:
    """(logits (2, 3, PADDED) with large junk in the padding columns, labels, vocab size, loss weights)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, PADDED, generator=gen) * 3
    logits[..., VOCAB:] = 50.0  # would dominate any softmax that let padding in
    labels = torch.randint(0, VOCAB, (2, 3), generator=gen)
    labels[0, 0], labels[1, 2] = 0, VOCAB - 1  # the first and the last real id (first and last rank)
    return logits, labels, VOCAB, torch.randn(2, 3, generator=gen), torch.randn(2, 3, generator=gen)


def reference(logits: torch.Tensor, labels: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-vocabulary log-softmax over the real ids only."""
    logp = torch.log_softmax(logits[..., :vocab].float(), dim=-1)
    return logp.gather(-1, labels[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)
