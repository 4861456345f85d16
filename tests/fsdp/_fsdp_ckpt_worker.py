"""One rank of the two-rank checkpoint test (``python _fsdp_ckpt_worker.py RANK WORLD PORT MODEL OUT MODE``).

``MODE=save``: update, save to ``OUT/ckpt``, update again and write the weights after that second update
(``OUT/continued.pt``). ``MODE=load``: a fresh engine loads ``OUT/ckpt`` (possibly with another world size),
does the same second update and writes ``OUT/resumed_w<WORLD>.pt``."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from _fsdp_helpers import PolicyGradient, context, make_batch  # noqa: E402

GLOBAL_BATCH = 8
OPTIONS = {"micro_batch": 2, "lr": 2e-3, "grad_clip": 1.0, "warmup_steps": 3}


def main(rank: int, world_size: int, port: int, model_path: str, out: str, mode: str) -> None:
    torch.set_num_threads(1)
    from hybridrl.runtime.distributed import init_process_group
    from hybridrl_fsdp.engine import FSDPEngine

    init_process_group(rank, world_size, "127.0.0.1", port, "cpu", timeout_s=120)
    engine = FSDPEngine(context(Path(model_path), rank=rank, world_size=world_size, **OPTIONS))
    first = make_batch(GLOBAL_BATCH, seed=1).chunk(world_size)[rank]
    second = make_batch(GLOBAL_BATCH, seed=2).chunk(world_size)[rank]
    if mode == "save":
        engine.update(first, PolicyGradient())
        engine.save_checkpoint(f"{out}/ckpt")
        saved = engine.full_state_dict()
        metrics = engine.update(second, PolicyGradient())
        if rank == 0:
            torch.save({"saved": saved, "state": engine.full_state_dict(), "metrics": metrics}, f"{out}/continued.pt")
        else:
            engine.full_state_dict()
    else:
        engine.load_checkpoint(f"{out}/ckpt")
        loaded = engine.full_state_dict()
        metrics = engine.update(second, PolicyGradient())
        state = engine.full_state_dict()
        if rank == 0:
            torch.save({"loaded": loaded, "state": state, "metrics": metrics}, f"{out}/resumed_w{world_size}.pt")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6])
