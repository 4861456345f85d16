"""``MegatronEngine`` on a mixture-of-experts model (a tiny Qwen3-MoE) on one CPU rank: logits and log-probs equal
transformers', an update moves the router and the experts, and the export gives the checkpoint's per-expert names."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _mg_helpers import PolicyGradient, context, hf_model, hf_response_log_probs, make_batch
from _mg_markers import needs_megatron

from hybridrl.config import TinyModelConfig
from hybridrl.engines.batch import LOG_PROBS
from hybridrl.model.tiny import build_tiny_model

pytestmark = needs_megatron

ATOL = 1e-4  # fp32 on CPU
TINY_MOE = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64,
                           num_experts=8, experts_per_token=2, init_std=0.2)


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(TINY_MOE, tmp_path_factory.mktemp("mg-moe-engine") / "model")


@pytest.fixture(scope="module")
def engine_cls(process_group):
    from hybridrl_megatron.engine import MegatronEngine

    return MegatronEngine


def test_moe_logits_equal_transformers(engine_cls, moe_folder: Path) -> None:
    engine = engine_cls(context(moe_folder, trainable=False))
    ids = torch.randint(1, 40, (2, 9), generator=torch.Generator().manual_seed(3))
    got = engine.compute_logits(ids)
    with torch.no_grad():
        want = hf_model(moe_folder)(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_moe_log_probs_equal_transformers(engine_cls, moe_folder: Path) -> None:
    engine = engine_cls(context(moe_folder, micro_batch=2, trainable=False))
    batch = make_batch(5, seed=4)
    with torch.no_grad():
        want = hf_response_log_probs(hf_model(moe_folder), batch)
    torch.testing.assert_close(engine.compute_log_probs(batch)[LOG_PROBS], want, atol=ATOL, rtol=0)


def test_moe_update_moves_router_and_experts(engine_cls, moe_folder: Path) -> None:
    engine = engine_cls(context(moe_folder, micro_batch=2, lr=1e-2))
    before = engine.full_state_dict()
    from safetensors.torch import load_file

    assert set(before) == set(load_file(str(moe_folder / "model.safetensors")))  # the untied head too
    batch = make_batch(4, seed=5)
    first = engine.update(batch, PolicyGradient())
    for _ in range(2):
        last = engine.update(batch, PolicyGradient())
    after = engine.full_state_dict()
    assert last["loss"] < first["loss"]
    assert 1.5 < first["moe/aux_loss"] < 8.0  # top_k = 2 when balanced, E = 8 when collapsed
    for name in ("model.layers.0.mlp.gate.weight", "model.layers.1.mlp.experts.3.up_proj.weight"):
        assert not torch.equal(before[name], after[name]), name
