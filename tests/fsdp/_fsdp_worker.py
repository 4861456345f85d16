"""One rank of the data-parallel equivalence test (run as a script: ``python _fsdp_worker.py RANK WORLD PORT
MODEL OUT``). Trains on its share of a fixed global batch, then saves the full weights (``full_state_dict`` and
``export_weights``), its metrics and the log-probs of its share to ``OUT.rankR``."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from _fsdp_helpers import PolicyGradient, context, grouped  # noqa: E402

from hybridrl.engines.batch import LOG_PROBS  # noqa: E402

GLOBAL_BATCH = 8
STEPS = 3
OPTIONS = {"micro_batch": 2, "lr": 2e-3, "grad_clip": 1.0}


def global_batch():
    """Rows in groups that share a prompt, so that packed micro-batches hold some prompts once."""
    return grouped((3, 2, 3), seed=1)


def main(rank: int, world_size: int, port: int, model_path: str, out: str) -> None:
    torch.set_num_threads(1)  # two ranks share two cores
    from hybridrl.runtime.distributed import init_process_group
    from hybridrl_fsdp.engine import FSDPEngine

    init_process_group(rank, world_size, "127.0.0.1", port, "cpu", timeout_s=120)
    engine = FSDPEngine(context(Path(model_path), rank=rank, world_size=world_size, **OPTIONS))
    local = global_batch().chunk(world_size)[rank]
    metrics = [engine.update(local, PolicyGradient()) for _ in range(STEPS)]
    log_probs = engine.compute_log_probs(local)[LOG_PROBS]
    state = engine.full_state_dict()
    exported = {name: t.clone() for bucket in engine.export_weights(4096) for name, t in bucket}
    torch.save({"state": state, "exported": exported, "metrics": metrics, "log_probs": log_probs},
               f"{out}.rank{rank}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
