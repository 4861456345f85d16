"""MoE routing replay in the core: the HF rollout returns each response token's experts (``routed_experts``), and
pre-flight refuses replay (or returned routing) that the run cannot honour, naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridrl.config import TinyModelConfig, load_config
from hybridrl.engines import EngineContext, SamplingParams
from hybridrl.engines.batch import (
    PROMPT_IDS,
    PROMPT_MASK,
    PROMPT_ROUTED_EXPERTS,
    RESPONSE_MASK,
    ROUTED_EXPERTS,
    Batch,
    left_pad,
)
from hybridrl.model.tiny import build_tiny_model
from hybridrl.placement.plan import ClusterSpec
from hybridrl.plugins.discovery import get_registry
from hybridrl.run.preflight import check_config
from hybridrl.run.routing_replay import returns_routing

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"
QUICKSTART_MOE = ROOT / "examples" / "quickstart-moe.yaml"
CPU1 = ClusterSpec(1, 1, "cpu")
TINY = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64,
                       num_experts=8, experts_per_token=2, init_std=0.2)


def problems(example: Path, *overrides: str) -> dict[str, str]:
    cfg = load_config(example, ["trainer.out=/tmp/unused", *overrides])
    _, _, found = check_config(cfg, get_registry(tuple(cfg.plugins)), CPU1, check_engines=False)
    return dict(found)


def test_replay_is_refused_where_it_cannot_run():
    assert problems(QUICKSTART_MOE, "algorithm.routing_replay=true") == {}
    dense = problems(QUICKSTART, "algorithm.routing_replay=true")
    assert "dense" in dense["algorithm.routing_replay"]
    assert "dense" in problems(QUICKSTART, "roles.rollout.return_routing=true")["roles.rollout.return_routing"]
    no_trainer = problems(QUICKSTART_MOE, "algorithm.routing_replay=true", "plugins=[_preflight_helpers]",
                          "roles.actor.backend=nockpt")
    assert "'routing_replay'" in no_trainer["roles.actor.backend"]
    measured = problems(QUICKSTART_MOE, "roles.rollout.return_routing=true", "plugins=[_preflight_helpers]",
                        "roles.actor.backend=nockpt")
    assert measured["roles.actor.backend"].startswith("roles.rollout.return_routing:")
    no_rollout = problems(QUICKSTART_MOE, "algorithm.routing_replay=true", "plugins=[_preflight_helpers]",
                          "roles.rollout.backend=noroute")
    assert "'return_routing'" in no_rollout["roles.rollout.backend"]
    assert "not supported" in problems(QUICKSTART_MOE, "algorithm.routing_replay=true",
                                       "roles.rollout.oversample=2")["roles.rollout.oversample"]
    assert "roles.rollout.return_routing" in problems(QUICKSTART_MOE, "algorithm.routing_replay=true",
                                                      "roles.rollout.return_routing=false")


def test_return_routing_follows_replay():
    cfg = load_config(QUICKSTART_MOE, [])
    assert not returns_routing(cfg)
    assert returns_routing(load_config(QUICKSTART_MOE, ["algorithm.routing_replay=true"]))
    assert returns_routing(load_config(QUICKSTART_MOE, ["roles.rollout.return_routing=true"]))


def test_hf_rollout_returns_each_fed_tokens_experts(tmp_path):
    from hybridrl.rollout.hf import HFRollout

    engine = HFRollout(EngineContext("rollout", "hf", str(build_tiny_model(TINY, tmp_path / "m")), rank=0,
                                     world_size=1))
    ids, mask = left_pad([[5, 6, 7], [8, 9], [10, 11, 12, 13], [8, 9]], pad_id=0)
    batch = Batch.from_tensors({PROMPT_IDS: ids, PROMPT_MASK: mask})
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=2, return_routing=True)
    out = engine.generate(batch, params)
    routed, real = out[ROUTED_EXPERTS], out[RESPONSE_MASK].bool()
    assert routed.shape == (4, 6, TINY.num_layers, TINY.experts_per_token) and routed.dtype == torch.long
    prompt = out[PROMPT_ROUTED_EXPERTS]  # the prefill's, once per distinct prompt, copied to the rows sharing it
    assert prompt.shape == (4, 4, TINY.num_layers, TINY.experts_per_token)
    assert bool((prompt[mask.bool()] >= 0).all()) and bool((prompt[~mask.bool()] == -1).all())
    assert torch.equal(prompt[1], prompt[3]) and not torch.equal(prompt[0], prompt[2])
    last = real.long().cumsum(1) == real.long().sum(1, keepdim=True)  # a row's last token and what follows
    assert bool((routed[real & ~last] >= 0).all()) and bool((routed[~real | last] == -1).all())
    assert bool((routed < TINY.num_experts).all())
    ok = routed[real & ~last]
    assert bool((ok[..., 0] != ok[..., 1]).all())  # top-k: distinct experts
    plain = engine.generate(batch, SamplingParams(max_new_tokens=6, seed=2))
    assert ROUTED_EXPERTS not in plain and PROMPT_ROUTED_EXPERTS not in plain


def test_hf_rollout_refuses_routing_of_a_dense_model(tmp_path):
    from hybridrl.rollout.hf import HFRollout

    dense = TINY.model_copy(update={"num_experts": 0})
    engine = HFRollout(EngineContext("rollout", "hf", str(build_tiny_model(dense, tmp_path / "d")), rank=0,
                                     world_size=1))
    ids, mask = left_pad([[5, 6]], pad_id=0)
    with pytest.raises(ValueError, match="no MoE router"):
        engine.generate(Batch.from_tensors({PROMPT_IDS: ids, PROMPT_MASK: mask}),
                        SamplingParams(max_new_tokens=2, return_routing=True))
