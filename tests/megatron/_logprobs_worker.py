"""One rank of the two-rank vocabulary-parallel log-prob test (``python _logprobs_worker.py RANK WORLD PORT OUT``):
this rank's slice of a fixed padded-vocabulary logit tensor goes through ``vocab_parallel_log_probs``; the
results, the gradient of a fixed loss with respect to the slice and the greedy margins are saved to
``OUT.rankR``."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from _lp_cases import case  # noqa: E402


def main(rank: int, world: int, port: int, out: str) -> None:
    from hybridrl.runtime.distributed import init_process_group
    from hybridrl_megatron.logprobs import vocab_parallel_greedy_margins, vocab_parallel_log_probs

    init_process_group(rank, world, "127.0.0.1", port, "cpu", timeout_s=120)
    logits, labels, vocab, w_lp, w_ent = case()
    width = logits.shape[-1] // world
    local = logits[..., rank * width:(rank + 1) * width].clone().requires_grad_(True)
    lp, ent = vocab_parallel_log_probs(local, labels, rank * width, vocab, torch.distributed.group.WORLD,
                                       with_entropy=True)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    margins = vocab_parallel_greedy_margins(local.detach(), labels, rank * width, vocab, torch.distributed.group.WORLD)
    torch.save({"log_probs": lp.detach(), "entropy": ent.detach(), "grad": local.grad, "margins": margins},
               f"{out}.rank{rank}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
