"""HF <-> Megatron conversion (pure tensor logic: runs without megatron-core or torch.distributed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _mg_helpers import logits_input

from hybridrl_megatron import convert
from hybridrl_megatron.convert import ConversionError, ModelSpec


def gqa_spec(heads: int = 8, kv_heads: int = 2, head_dim: int = 3, hidden: int = 5, ffn: int = 6) -> ModelSpec:
    return ModelSpec(family="qwen2", num_layers=1, hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads,
                     head_dim=head_dim, ffn_hidden_size=ffn, vocab_size=7, qkv_bias=True, tie_embeddings=True,
                     rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=16)


def safetensors_state(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


# --- config ------------------------------------------------------------------------------------------------
def test_spec_reads_qwen2_and_llama_configs() -> None:
    from transformers import LlamaConfig, Qwen2Config

    qwen = ModelSpec.from_hf_config(Qwen2Config(hidden_size=896, num_attention_heads=14, num_key_value_heads=2,
                                                intermediate_size=4864, num_hidden_layers=24, vocab_size=151936,
                                                tie_word_embeddings=True, rope_theta=1e6).to_dict())
    assert (qwen.family, qwen.head_dim, qwen.num_kv_heads) == ("qwen2", 64, 2)
    assert qwen.qkv_bias and qwen.tie_embeddings
    assert qwen.rope_theta == 1e6 and qwen.qkv_rows == (14 + 4) * 64
    llama = ModelSpec.from_hf_config(LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                                                 head_dim=32, intermediate_size=96, num_hidden_layers=2).to_dict())
    assert (llama.family, llama.head_dim, llama.qkv_bias, llama.tie_embeddings) == ("llama", 32, False, False)


@pytest.mark.parametrize("config, reason", [
    ({"model_type": "gpt2"}, "not supported"),
    ({"model_type": "llama", "attention_bias": True}, "attention_bias"),
    ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window"),
    ({"model_type": "llama", "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "yarn"),
    ({"model_type": "llama", "num_attention_heads": 6, "num_key_value_heads": 4}, "divisible"),
])
def test_unsupported_configs_are_refused(config: dict, reason: str) -> None:
    base = {"hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 1, "intermediate_size": 8,
            "vocab_size": 5}
    with pytest.raises(ConversionError, match=reason):
        ModelSpec.from_hf_config({**base, **config})


# --- fused tensors -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("trailing", [(5,), ()], ids=["weight", "bias"])
def test_fused_qkv_is_megatrons_grouped_layout(trailing: tuple[int, ...]) -> None:
    spec = gqa_spec()
    d, per_group = spec.head_dim, spec.heads_per_group
    q = torch.randn(spec.num_heads * d, *trailing)
    k = torch.randn(spec.num_kv_heads * d, *trailing)
    v = torch.randn(spec.num_kv_heads * d, *trailing)
    # Built row by row: for each group, its query heads, then its key head, then its value head.
    expected = torch.cat([torch.cat([q[g * per_group * d:(g + 1) * per_group * d], k[g * d:(g + 1) * d],
                                     v[g * d:(g + 1) * d]]) for g in range(spec.num_kv_heads)])
    fused = convert.fuse_qkv(q, k, v, spec)
    assert torch.equal(fused, expected)
    for got, want in zip(convert.split_qkv(fused, spec), (q, k, v)):
        assert torch.equal(got, want)


def assert_same_product(got: torch.Tensor, want: torch.Tensor) -> None:
    """Products of different shapes may sum in another order (BLAS picks kernels by shape): equal to fp32
    rounding. A shard holding another rank's rows or heads is off by the values themselves."""
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_tensor_parallel_shards_compute_each_ranks_part() -> None:
    """Each rank's shard does that rank's share of the layer's work, checked by computing with it."""
    spec, tp = gqa_spec(), 2
    x = torch.randn(3, spec.hidden_size)
    q, k, v = (torch.randn(n * spec.head_dim, spec.hidden_size) for n in (spec.num_heads, spec.num_kv_heads,
                                                                          spec.num_kv_heads))
    qkv = convert.fuse_qkv(q, k, v, spec)
    half = ModelSpec(**{**spec.to_json(), "num_heads": spec.num_heads // tp, "num_kv_heads": spec.num_kv_heads // tp})
    for rank, shard in enumerate(convert.shard_tp("decoder.layers.0.self_attention.linear_qkv.weight", qkv, tp)):
        # rank r projects exactly its query heads and their key/value heads
        rq, rk, rv = convert.split_qkv(shard, half)
        assert_same_product(x @ rq.T, (x @ q.T).chunk(tp, dim=1)[rank])
        assert_same_product(x @ rk.T, (x @ k.T).chunk(tp, dim=1)[rank])
        assert_same_product(x @ rv.T, (x @ v.T).chunk(tp, dim=1)[rank])

    gate, up = torch.randn(spec.ffn_hidden_size, spec.hidden_size), torch.randn(spec.ffn_hidden_size, spec.hidden_size)
    fc1 = torch.cat([gate, up])
    for rank, shard in enumerate(convert.shard_tp("decoder.layers.0.mlp.linear_fc1.weight", fc1, tp)):
        gate_out, up_out = (x @ shard.T).chunk(2, dim=1)  # Megatron's GLU: first half gated, second half linear
        assert_same_product(gate_out, (x @ gate.T).chunk(tp, dim=1)[rank])
        assert_same_product(up_out, (x @ up.T).chunk(tp, dim=1)[rank])

    down = torch.randn(spec.hidden_size, spec.ffn_hidden_size)
    hidden = torch.randn(3, spec.ffn_hidden_size)
    shards = convert.shard_tp("decoder.layers.0.mlp.linear_fc2.weight", down, tp)
    partial = sum(h @ w.T for h, w in zip(hidden.chunk(tp, dim=1), shards))  # row-parallel: partial sums
    torch.testing.assert_close(partial, hidden @ down.T)

    for name, full in (("decoder.layers.0.self_attention.linear_qkv.weight", qkv),
                       ("decoder.layers.0.mlp.linear_fc1.weight", fc1),
                       ("decoder.layers.0.mlp.linear_fc2.weight", down),
                       ("decoder.layers.0.input_layernorm.weight", torch.randn(5))):
        assert torch.equal(convert.merge_tp(name, convert.shard_tp(name, full, tp)), full)


def test_tensor_parallel_must_divide_the_heads() -> None:
    convert.check_tp(gqa_spec(kv_heads=2), 2)
    with pytest.raises(ConversionError, match="num_key_value_heads 2"):
        convert.check_tp(gqa_spec(kv_heads=2), 4)


def test_vocabulary_padding() -> None:
    assert convert.padded_vocab_size(41, tp_size=2, multiple=1) == 42
    assert convert.padded_vocab_size(151936, tp_size=1) == 151936
    assert convert.padded_vocab_size(151936, tp_size=2) == 152064  # a multiple of 128 * 2
    table = torch.randn(41, 4)
    padded = convert.pad_vocab(table, 42)
    assert torch.equal(padded[:41], table) and torch.equal(padded[41], torch.zeros(4))
    with pytest.raises(ConversionError):
        convert.pad_vocab(table, 40)


# --- whole checkpoints -------------------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["qwen2_tied", "llama_untied"])
def test_hf_to_megatron_to_hf_is_exact(model: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    source: Path = request.getfixturevalue(model)
    spec, mcore = convert.load_hf_as_mcore(source)
    assert list(mcore) == convert.mcore_names(spec)
    assert ("output_layer.weight" in mcore) == (not spec.tie_embeddings)
    for name, tensor in mcore.items():  # the shapes the receive buffers of an export are sized from
        assert [s for _, s in convert.hf_shapes(spec, name)] == [tuple(t.shape) for _, t in
                                                                 convert.from_mcore(name, tensor, spec)]
    out = convert.save_mcore_as_hf(mcore, spec, tmp_path / "back", source_dir=source)
    original, back = safetensors_state(source), safetensors_state(out)
    assert set(back) == set(original) - ({"lm_head.weight"} if spec.tie_embeddings else set())
    for name, tensor in back.items():
        assert torch.equal(tensor, original[name]), name
    assert json.loads((out / "config.json").read_text()) == json.loads((source / "config.json").read_text())
    ids = logits_input()
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)(input_ids=ids).logits
        b = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(input_ids=ids).logits
    assert torch.equal(a, b)


def test_checkpoint_reader_handles_sharded_folders(qwen2_tied: Path, tmp_path: Path) -> None:
    state = safetensors_state(qwen2_tied)
    out = convert.write_hf_checkpoint(tmp_path / "sharded", state.items(), qwen2_tied, shard_bytes=4096)
    assert (out / "model.safetensors.index.json").is_file() and not (out / "model.safetensors").exists()
    reread = convert.HFCheckpoint(out).state_dict()
    assert reread.keys() == state.keys() and all(torch.equal(reread[n], state[n]) for n in state)


def test_missing_tensors_are_named(qwen2_tied: Path) -> None:
    spec, _ = convert.load_hf_as_mcore(qwen2_tied)
    state = safetensors_state(qwen2_tied)
    del state["model.layers.1.self_attn.k_proj.bias"]
    with pytest.raises(ConversionError, match="model.layers.1.self_attn.k_proj.bias"):
        convert.hf_to_mcore(state, spec)
