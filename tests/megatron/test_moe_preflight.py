"""Bad mixture-of-experts input is found before any process starts, with its key path: an expert-parallel degree
that does not divide the pool's data-parallel ranks or the model's experts, expert parallelism on a dense model,
and an MoE checkpoint whose expert layout hybridrl does not know."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridrl.config import ConfigError, load_config
from hybridrl.placement.plan import ClusterSpec
from hybridrl.plugins.discovery import get_registry
from hybridrl.run.preflight import prepare_run

ROOT = Path(__file__).resolve().parents[2]
MOE = ROOT / "examples" / "quickstart-moe.yaml"
DENSE = ROOT / "examples" / "quickstart.yaml"
MEGATRON = ["roles.actor.backend=megatron", "roles.ref.backend=megatron", "roles.actor.options={}",
            "pools.main.devices_per_node=4"]


def problems(example: Path, tmp_path: Path, overrides: list[str]) -> dict[str, str]:
    cfg = load_config(example, [f"trainer.out={tmp_path / 'run'}", *overrides])
    with pytest.raises(ConfigError) as err:
        prepare_run(cfg, get_registry(tuple(cfg.plugins)), ClusterSpec(1, 4, "cpu"))
    found: dict[str, str] = {}
    for key, reason in err.value.problems:
        found[key] = f"{found[key]} | {reason}" if key in found else reason
    return found


@pytest.mark.parametrize("overrides, reason", [
    (["roles.actor.options.expert_parallel=3"], "expert_parallel=3 does not divide the data-parallel size 4"),
    (["roles.actor.options.expert_parallel=4", "roles.actor.options.tensor_parallel=2"],
     "expert_parallel=4 does not divide the data-parallel size 2"),
    (["roles.actor.options.expert_parallel=4", "model.tiny.num_experts=6"],
     "expert_parallel=4 does not divide the model's 6 experts"),
])
def test_expert_parallel_that_does_not_divide_is_refused(tmp_path: Path, overrides: list[str], reason: str) -> None:
    found = problems(MOE, tmp_path, MEGATRON + overrides)
    assert reason in found.get("roles.actor.options.expert_parallel", ""), found


def test_expert_parallel_on_a_dense_model_is_refused(tmp_path: Path) -> None:
    found = problems(DENSE, tmp_path, MEGATRON + ["roles.actor.options.expert_parallel=2"])
    assert "no experts" in found.get("roles.actor.options.expert_parallel", ""), found


def test_unknown_moe_checkpoint_layout_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "mixtral"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2, "hidden_size": 32,
        "num_attention_heads": 2, "num_hidden_layers": 2, "vocab_size": 64, "intermediate_size": 64}))
    (folder / "model.safetensors").write_bytes(b"")
    (folder / "tokenizer.json").write_text("{}")
    found = problems(DENSE, tmp_path, [f"model.path={folder}", "model.tiny=null"])
    assert "expert layout hybridrl does not know" in found.get("model.path", ""), found


def test_a_checkpoint_megatron_cannot_build_is_refused_before_start(tmp_path: Path) -> None:
    folder = tmp_path / "qwen2moe"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2, "hidden_size": 32,
        "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 2, "vocab_size": 64,
        "intermediate_size": 64, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32}))
    (folder / "model.safetensors").write_bytes(b"")
    from hybridrl.model.tokenizer import build_char_tokenizer

    build_char_tokenizer().save_pretrained(str(folder))
    found = problems(DENSE, tmp_path, [f"model.path={folder}", "model.tiny=null", *MEGATRON])
    assert "roles.actor.backend=megatron cannot build this checkpoint" in found.get("model.path", ""), found
    assert "qwen2_moe" in found["model.path"] and found["model.path"].count("cannot build") == 1
