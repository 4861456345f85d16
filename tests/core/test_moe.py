"""Mixture-of-experts models in the core: the tiny Qwen3-MoE, the expert layout between trainer and engine, the
HF rollout importing experts per expert, the shape (every expert held, the top-k active) and FLOPs, and the
pre-flight refusal of an MoE layout the trainer does not know."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hybridrl.config import TinyModelConfig
from hybridrl.engines import EngineContext
from hybridrl.model.tiny import build_tiny_model
from hybridrl.observe.flops import forward_flops, matmul_params
from hybridrl.placement.memory import MemoryEstimateError, read_hf_config, shape_from_hf_config, tiny_shape
from hybridrl.run.checks import model_folder_problems
from hybridrl.weights.experts import expert_count, expert_views, fuse_experts, moe_layout_problem, to_checkpoint_layout

ROOT = Path(__file__).resolve().parents[2]
QWEN3_30B_A3B = ROOT / "examples" / "configs" / "qwen3-30b-a3b"
TINY = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64,
                       num_experts=8, experts_per_token=2, init_std=0.2)


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory):
    """Two tiny MoE models of one architecture and different weights."""
    root = tmp_path_factory.mktemp("moe")
    return (build_tiny_model(TINY, root / "a"),
            build_tiny_model(TINY.model_copy(update={"seed": 1}), root / "b"))


def _saved(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_tiny_moe_is_a_qwen3_moe_with_its_experts(moe_pair):
    folder, _ = moe_pair
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe"
    assert (expert_count(config), config["num_experts_per_tok"], config["num_hidden_layers"]) == (8, 2, 2)
    assert (folder / "tokenizer_config.json").is_file()
    names = set(_saved(folder))
    assert {f"model.layers.1.mlp.experts.{e}.{p}.weight" for e in range(8)
            for p in ("gate_proj", "up_proj", "down_proj")} <= names
    assert build_tiny_model(TINY, folder) == folder  # the same config reuses the folder


def test_dense_tiny_spec_is_unchanged_by_the_moe_keys(tmp_path):
    """A dense tiny model's marker does not mention experts: folders built before the keys existed are reused."""
    folder = build_tiny_model(TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                              intermediate_size=32), tmp_path / "dense")
    marker = json.loads((folder / "hybridrl_tiny.json").read_text())
    assert "num_experts" not in marker["config"]
    assert json.loads((folder / "config.json").read_text())["model_type"] == "qwen2"


def test_layout_round_trip(moe_pair):
    from transformers import AutoModelForCausalLM

    folder, _ = moe_pair
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    fused = dict(model.named_parameters())
    assert fused["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 2 * TINY.expert_size, 32)
    split = dict(to_checkpoint_layout(fused.items()))
    saved = _saved(folder)
    assert set(split) == set(saved)
    for name, tensor in saved.items():
        torch.testing.assert_close(split[name], tensor, atol=0, rtol=0, msg=name)
    back = fuse_experts(split, fused)
    assert set(back) == set(fused)
    for name, tensor in fused.items():
        torch.testing.assert_close(back[name], tensor, atol=0, rtol=0, msg=name)
    views = expert_views(fused)
    assert views["model.layers.0.mlp.experts.3.up_proj.weight"].data_ptr() == \
        fused["model.layers.0.mlp.experts.gate_up_proj"][3, TINY.expert_size:].data_ptr()


def test_hf_rollout_imports_experts_per_expert(moe_pair):
    """The rollout sent the other model's weights in the checkpoint layout generates what that model does."""
    from hybridrl.engines import SamplingParams
    from hybridrl.engines.batch import PROMPT_IDS, PROMPT_MASK, RESPONSE_IDS, Batch, left_pad
    from hybridrl.rollout.hf import HFRollout

    a, b = moe_pair
    engine = HFRollout(EngineContext("rollout", "hf", str(a), rank=0, world_size=1))
    other = HFRollout(EngineContext("rollout", "hf", str(b), rank=0, world_size=1))
    sent = _saved(b)
    names = list(sent)
    engine.import_weights([(n, sent[n]) for n in names[: len(names) // 2]])
    engine.import_weights([(n, sent[n]) for n in names[len(names) // 2:]])
    engine.finish_weight_import()
    held = dict(engine.named_weights())
    assert set(held) == set(sent)  # the head too: a Qwen3-MoE holds its own
    for name, tensor in sent.items():
        torch.testing.assert_close(held[name], tensor, atol=0, rtol=0, msg=name)
    ids, mask = left_pad([[5, 6, 7], [8, 9]], pad_id=0)
    batch = Batch.from_tensors({PROMPT_IDS: ids, PROMPT_MASK: mask})
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    assert torch.equal(engine.generate(batch, greedy)[RESPONSE_IDS], other.generate(batch, greedy)[RESPONSE_IDS])


def test_tiny_shape_counts_every_expert_and_the_active_ones(moe_pair):
    from transformers import AutoModelForCausalLM

    folder, _ = moe_pair
    model = AutoModelForCausalLM.from_pretrained(folder)
    total = sum(p.numel() for p in model.parameters())
    shape = tiny_shape(TINY)
    assert shape.param_count() == total
    assert shape_from_hf_config(read_hf_config(folder)).param_count() == total
    per_expert = 3 * TINY.hidden_size * TINY.expert_size
    assert total - shape.active_param_count() == TINY.num_layers * (TINY.num_experts - 2) * per_expert


def test_moe_flops_are_the_routed_work():
    """transformers' MoE runs each token through its top-k experts only: torch's FLOP counter agrees with
    ``forward_flops`` on the active parameters."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=97, hidden_size=64, intermediate_size=128, moe_intermediate_size=48,
                            num_experts=6, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    torch.manual_seed(0)
    # eager attention and experts: plain matmuls FlopCounterMode counts (grouped GEMMs it does not)
    model = Qwen3MoeForCausalLM._from_config(config, attn_implementation="eager",
                                             experts_implementation="eager").eval()
    shape = shape_from_hf_config(config.to_dict())
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.randint(0, 97, (1, 13)))
    assert forward_flops(shape, [13]) == counter.get_total_flops()


def test_qwen3_30b_a3b_shape():
    shape = shape_from_hf_config(read_hf_config(QWEN3_30B_A3B))
    assert abs(shape.param_count() - 30.5e9) / 30.5e9 < 0.01  # the model card: 30.5B in total
    assert abs(shape.active_param_count() - 3.3e9) / 3.3e9 < 0.03  # and 3.3B activated
    assert matmul_params(shape) < shape.active_param_count()  # the embedding lookup is no matmul
    assert "3.35B active" in shape.describe()


def test_qwen3_30b_a3b_plan_on_8_gpus():
    """FSDP holds every expert, sharded over the 8 devices; the activations are those of the routed experts."""
    from hybridrl.config import load_config
    from hybridrl.placement.memory import GIB, estimate_memory, model_shape
    from hybridrl.placement.plan import ClusterSpec, plan_placement, resolve_backends
    from hybridrl.plugins.discovery import get_registry

    cfg = load_config(ROOT / "examples" / "qwen3moe-colocated.yaml",
                      ["roles.actor.max_tokens_per_micro_batch=4096", "roles.actor.options.offload=none",
                       "roles.actor.options.gradient_checkpointing=true"])
    backends, problems = resolve_backends(cfg, get_registry(), check_engines=False)
    assert not problems
    plan = plan_placement(cfg, ClusterSpec(1, 8, "cuda", declared=True), backends)
    shape, _ = model_shape(cfg, base_dirs=(ROOT,))
    est = estimate_memory(cfg, plan, shape, 80 * GIB)
    actor = next(m for m in est.roles if m.role == "actor")
    n = shape.param_count()
    assert actor.weights == pytest.approx(4 * n / 8)  # ~14.2 GiB of fp32 masters per GPU
    assert actor.optimizer == pytest.approx(8 * n / 8)
    assert 13 * GIB < actor.weights < 15 * GIB
    assert actor.activations < 16 * GIB  # 4096 tokens through 8 of 128 experts, checkpointed
    assert any("3.35B active" in note for note in actor.notes)


def test_unknown_moe_layout_is_refused_before_start(tmp_path):
    mixtral = {"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2, "hidden_size": 8,
               "num_attention_heads": 2, "num_hidden_layers": 1, "vocab_size": 10, "intermediate_size": 8}
    assert "expert layout" in (moe_layout_problem(mixtral) or "")
    with pytest.raises(MemoryEstimateError, match="expert layout"):
        shape_from_hf_config(mixtral)
    (tmp_path / "config.json").write_text(json.dumps(mixtral))
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "tokenizer.json").write_text("{}")
    problems = model_folder_problems("model.path", tmp_path, tokenizer=True)
    assert [key for key, _ in problems] == ["model.path"]
    assert "mixtral" in problems[0][1] and "qwen3_moe" in problems[0][1]
    dense_between = {"model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2, "mlp_only_layers": [0]}
    assert "mlp_only_layers" in (moe_layout_problem(dense_between) or "")
    assert moe_layout_problem({"model_type": "qwen2", "hidden_size": 8}) is None


def test_export_writes_an_moe_checkpoint_from_per_expert_weights(moe_pair, tmp_path):
    """``hybridrl export`` gets the trainer's per-expert tensors; the HF folder it writes loads as the model."""
    from transformers import AutoModelForCausalLM

    from hybridrl.run.export import write_hf_model

    a, b = moe_pair
    out = write_hf_model(_saved(b), a, tmp_path / "out", torch.float32, {"step": 1})
    saved = _saved(out)
    assert set(saved) == set(_saved(b))
    assert all(torch.equal(saved[n], t) for n, t in _saved(b).items())
    ids = torch.tensor([[4, 8, 15, 16, 23]])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(b, dtype=torch.float32)(input_ids=ids).logits
        got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(input_ids=ids).logits
    assert torch.equal(got, want)
