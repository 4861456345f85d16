"""An MoE model on two gloo ranks: FSDP2 shards the fused experts (dim 0: experts) and the router losses, and two
ranks reach the weights one rank reaches, with the same ``moe/aux_loss``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _fsdp_worker import STEPS
from test_fsdp_data_parallel import ATOL, launch, wait

from hybridrl.config import TinyModelConfig
from hybridrl.model.tiny import build_tiny_model

TINY_MOE = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64,
                           num_experts=8, experts_per_token=2, init_std=0.2)


def test_two_ranks_match_one_on_an_moe_model(tmp_path: Path) -> None:
    model = build_tiny_model(TINY_MOE, tmp_path / "moe")
    one, two = tmp_path / "world1.pt", tmp_path / "world2.pt"
    procs = launch(1, model, one) + launch(2, model, two)
    wait(procs)
    single = torch.load(f"{one}.rank0")
    dual, dual_1 = torch.load(f"{two}.rank0"), torch.load(f"{two}.rank1")
    from safetensors.torch import load_file

    initial = load_file(str(model / "model.safetensors"))
    assert set(single["exported"]) == set(initial)  # the experts travel per expert, as the checkpoint holds them
    routers = [n for n in initial if n.endswith("mlp.gate.weight")]
    assert routers and all(float((single["exported"][n] - initial[n]).abs().max()) > 100 * ATOL for n in routers)
    for name, tensor in single["exported"].items():
        torch.testing.assert_close(dual["exported"][name], tensor, atol=ATOL, rtol=0, msg=name)
        torch.testing.assert_close(dual_1["exported"][name], dual["exported"][name], atol=0, rtol=0, msg=name)
    assert len(single["metrics"]) == STEPS
    for m1, m2, m2b in zip(single["metrics"], dual["metrics"], dual_1["metrics"]):
        assert m1["moe/aux_loss"] > 1.0
        assert m2["moe/aux_loss"] == pytest.approx(m1["moe/aux_loss"], rel=1e-5)
        assert m2b["moe/aux_loss"] == m2["moe/aux_loss"]  # every rank reports the global mean
    torch.testing.assert_close(torch.cat([dual["log_probs"], dual_1["log_probs"]]), single["log_probs"],
                               atol=ATOL, rtol=0)
