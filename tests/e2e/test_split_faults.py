"""A rollout worker killed in the split layout (the actor on one pool, the rollout on another, weights
broadcast over a gloo group between them): the actor's side sees only gloo's 'Connection closed by peer';
the run names the worker that died, and the checkpoint to resume from."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from hybridrl.config import load_config
from hybridrl.plugins.discovery import get_registry
from hybridrl.run.faults import WorkerDiedError
from hybridrl.run.preflight import prepare_run
from hybridrl.run.trainer import Trainer
from hybridrl.runtime.cluster import detect_cluster

SPLIT = Path(__file__).resolve().parents[2] / "examples" / "quickstart-split.yaml"
SMALL = ["trainer.steps=3", "data.prompts_per_step=4", "algorithm.n_samples=4", "trainer.progress=false",
         "trainer.trackers=[jsonl]", "trainer.log_samples=0"]


def test_a_rollout_worker_killed_before_the_broadcast_is_named_not_a_gloo_error(tmp_path, ray_local) -> None:
    import ray

    cfg = load_config(SPLIT, [*SMALL, f"trainer.out={tmp_path / 'run'}"])
    trainer = Trainer(prepare_run(cfg, get_registry(), detect_cluster(cfg.cluster)))
    try:
        trainer.start()
        assert type(trainer.bridge).__name__ == "BroadcastBridge"
        rollout = trainer.groups["rollout"].workers[0]
        pid = ray.get(rollout.__ray_call__.remote(lambda worker: os.getpid()))
        sync = trainer.sync_weights

        def killed_then_sync():
            os.kill(pid, signal.SIGKILL)  # kill -9, as the repro: the peer is gone when the actor sends
            return sync()

        trainer.sync_weights = killed_then_sync  # type: ignore[method-assign]
        with pytest.raises(WorkerDiedError) as err:
            trainer.fit()
    finally:
        trainer.shutdown()
    message = str(err.value)
    assert "the worker process of role rollout (pool 'gen'), rank 0 of 1" in message, message
    assert "during step 1; its peers saw it as a collective error" in message, message  # not gloo's words alone
    assert "No checkpoint was saved" in message
