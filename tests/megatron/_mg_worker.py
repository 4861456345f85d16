"""One rank of the multi-process Megatron tests (``python _mg_worker.py RANK WORLD PORT SCENARIOS_JSON``).

For each scenario (``{"model": path, "options": {...}, "out": path}``) it builds the engine with the given
options (tensor/pipeline parallel sizes ...) and records, for the test process to compare with independent
computations: the full logits of a fixed input, the log-probs of this data-parallel rank's share of a fixed
batch before and after ``STEPS`` updates, the update metrics, the exported weights, and a checkpoint round
trip (save, train on, load: the weights must come back). Between scenarios Megatron's parallel state is torn
down, as a fresh process would have it, so one launch (one import of megatron-core) serves several layouts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from _mg_helpers import PolicyGradient, ValueRegression, context, logits_input, make_batch  # noqa: E402

from hybridrl.engines.batch import (  # noqa: E402
    ENTROPY,
    LOG_PROBS,
    VALUES,  # noqa: E402
)

GLOBAL_BATCH = 8
STEPS = 2
BASE_OPTIONS = {"micro_batch": 2, "lr": 1e-2, "grad_clip": 1.0, "vocab_multiple": 1}


def exported(engine) -> dict[str, torch.Tensor]:
    return {name: t.clone() for bucket in engine.export_weights(4096) for name, t in bucket}


def main(rank: int, world_size: int, port: int, scenarios: list[dict]) -> None:
    torch.set_num_threads(1)  # the ranks share two cores
    from megatron.core import parallel_state

    from hybridrl.runtime.distributed import init_process_group

    init_process_group(rank, world_size, "127.0.0.1", port, "cpu", timeout_s=300)
    for scenario in scenarios:
        runner = run_critic if scenario.get("critic") else run
        runner(rank, world_size, scenario["model"], scenario["out"], scenario["options"])
        parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def run(rank: int, world_size: int, model_path: str, out: str, options: dict) -> None:
    from hybridrl_megatron.engine import MegatronEngine

    engine = MegatronEngine(context(Path(model_path), rank=rank, world_size=world_size, **{**BASE_OPTIONS, **options}))
    info = engine.data_parallel()
    result: dict = {"info": info, "layout": (engine.layout.tp, engine.layout.pp, engine.layout.dp),
                    "expert_parallel": engine.layout.ep,
                    "experts_held": sorted({e.name for e in engine.table if ".local_experts." in e.name})}
    result["logits"] = engine.compute_logits(logits_input())

    local = make_batch(GLOBAL_BATCH, seed=1).chunk(info.dp_size)[info.dp_rank]
    first = engine.compute_log_probs(local, with_entropy=True)
    result["log_probs_before"], result["entropy_before"] = first[LOG_PROBS], first[ENTROPY]
    result["metrics"] = [engine.update(local, PolicyGradient()) for _ in range(STEPS)]
    result["log_probs_after"] = engine.compute_log_probs(local)[LOG_PROBS]
    result["exported"] = exported(engine)

    ckpt = Path(f"{out}.checkpoint")
    engine.save_checkpoint(str(ckpt))
    engine.update(local, PolicyGradient())
    result["moved_after_save"] = exported(engine)
    engine.load_checkpoint(str(ckpt))
    result["restored"] = exported(engine)
    torch.save(result, f"{out}.rank{rank}")


def run_critic(rank: int, world_size: int, model_path: str, out: str, options: dict) -> None:
    """The critic: values of this rank's share before and after ``STEPS`` updates, metrics, exports."""
    from hybridrl_megatron.engine import MegatronEngine

    engine = MegatronEngine(context(Path(model_path), rank=rank, world_size=world_size, role="critic",
                                    **{**BASE_OPTIONS, **options}))
    info = engine.data_parallel()
    result: dict = {"info": info, "layout": (engine.layout.tp, engine.layout.pp, engine.layout.dp),
                    "initial": exported(engine)}
    local = make_batch(GLOBAL_BATCH, seed=1).chunk(info.dp_size)[info.dp_rank]
    result["values_before"] = engine.compute_values(local)[VALUES]
    result["metrics"] = [engine.update(local, ValueRegression()) for _ in range(STEPS)]
    result["values_after"] = engine.compute_values(local)[VALUES]
    result["exported"] = exported(engine)
    torch.save(result, f"{out}.rank{rank}")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]))
