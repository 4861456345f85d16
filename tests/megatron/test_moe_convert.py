"""HF <-> Megatron conversion of a mixture-of-experts checkpoint (a tiny Qwen3-MoE): the router, Qwen3's query/key
norms and every expert both ways, exactly, and split over expert-parallel (and tensor-parallel) ranks and back.
Pure tensor logic: no megatron-core, no process group."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hybridrl.config import TinyModelConfig
from hybridrl.model.tiny import build_tiny_model
from hybridrl_megatron import convert
from hybridrl_megatron.convert import ConversionError, ModelSpec

TINY_MOE = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64,
                           num_experts=8, experts_per_token=2, init_std=0.2)


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(TINY_MOE, tmp_path_factory.mktemp("mg-moe") / "model")


def _saved(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_spec_reads_the_experts(moe_folder: Path) -> None:
    spec = convert.HFCheckpoint(moe_folder).spec
    assert (spec.family, spec.num_experts, spec.experts_per_token, spec.moe_ffn_hidden_size) == ("qwen3_moe", 8, 2, 32)
    assert spec.qk_norm and not spec.qkv_bias and spec.norm_topk_prob
    assert spec.router_aux_loss_coef == pytest.approx(0.001)
    names = convert.mcore_names(spec)
    assert "decoder.layers.1.mlp.router.weight" in names
    assert "decoder.layers.0.self_attention.q_layernorm.weight" in names
    assert "decoder.layers.0.mlp.experts.local_experts.7.linear_fc2.weight" in names
    assert "decoder.layers.0.mlp.linear_fc1.weight" not in names  # no dense MLP in an expert layer


def test_moe_hf_to_megatron_to_hf_is_exact(moe_folder: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    spec, mcore = convert.load_hf_as_mcore(moe_folder)
    assert list(mcore) == convert.mcore_names(spec)
    fc1 = mcore["decoder.layers.1.mlp.experts.local_experts.5.linear_fc1.weight"]
    original = _saved(moe_folder)
    assert torch.equal(fc1[:32], original["model.layers.1.mlp.experts.5.gate_proj.weight"])  # [gate; up]
    assert torch.equal(fc1[32:], original["model.layers.1.mlp.experts.5.up_proj.weight"])
    for name, tensor in mcore.items():
        assert [s for _, s in convert.hf_shapes(spec, name)] == [tuple(t.shape) for _, t in
                                                                 convert.from_mcore(name, tensor, spec)]
    out = convert.save_mcore_as_hf(mcore, spec, tmp_path / "back", source_dir=moe_folder)
    back = _saved(out)
    assert set(back) == set(original)  # the untied head too
    for name, tensor in back.items():
        assert torch.equal(tensor, original[name]), name
    assert json.loads((out / "config.json").read_text()) == json.loads((moe_folder / "config.json").read_text())
    ids = torch.tensor([[3, 5, 7, 9, 11]])
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(moe_folder, dtype=torch.float32)(input_ids=ids).logits
        b = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(input_ids=ids).logits
    assert torch.equal(a, b)


@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_expert_parallel_split_and_merge_are_exact(moe_folder: Path, ep: int) -> None:
    spec, mcore = convert.load_hf_as_mcore(moe_folder)
    shards = convert.shard_ep(mcore, spec, ep)
    per_rank = spec.num_experts // ep
    for rank, shard in enumerate(shards):
        experts = {convert.expert_of(n) for n in shard} - {None}
        assert experts == set(range(per_rank))  # local names count from 0 on every rank
        local = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"
        assert torch.equal(shard[local],
                           mcore[f"decoder.layers.0.mlp.experts.local_experts.{rank * per_rank}.linear_fc2.weight"])
        assert torch.equal(shard["decoder.layers.0.mlp.router.weight"], mcore["decoder.layers.0.mlp.router.weight"])
    merged = convert.merge_ep(shards, spec)
    assert merged.keys() == mcore.keys() and all(torch.equal(merged[n], mcore[n]) for n in mcore)


def test_expert_weights_split_over_tensor_parallel_ranks(moe_folder: Path) -> None:
    """Megatron splits each expert like a dense MLP (gate and up by rows, down by columns) when the experts are
    tensor-parallel; the router and the query/key norms are replicated."""
    spec, mcore = convert.load_hf_as_mcore(moe_folder)
    for name, tensor in mcore.items():
        shards = convert.shard_tp(name, tensor, 2)
        assert torch.equal(convert.merge_tp(name, shards), tensor), name
    assert convert.tp_partition_dim("decoder.layers.0.mlp.router.weight") is None
    assert convert.tp_partition_dim("decoder.layers.0.self_attention.k_layernorm.weight") is None
    assert convert.tp_partition_dim("decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight") == 1


def test_expert_parallel_must_divide_the_experts(moe_folder: Path, qwen2_tied: Path) -> None:
    spec = convert.HFCheckpoint(moe_folder).spec
    with pytest.raises(ConversionError, match="expert_parallel=3 does not divide num_experts=8"):
        convert.check_ep(spec, 3)
    with pytest.raises(ConversionError, match="no experts"):
        convert.check_ep(convert.HFCheckpoint(qwen2_tied).spec, 2)


def test_moe_layouts_it_cannot_convert_are_refused() -> None:
    base = {"model_type": "qwen3_moe", "hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 2,
            "intermediate_size": 8, "vocab_size": 5, "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 4}
    assert ModelSpec.from_hf_config(base).is_moe
    with pytest.raises(ConversionError, match="mlp_only_layers"):
        ModelSpec.from_hf_config({**base, "mlp_only_layers": [1]})
    with pytest.raises(ConversionError, match="not supported"):
        ModelSpec.from_hf_config({**base, "model_type": "mixtral"})
