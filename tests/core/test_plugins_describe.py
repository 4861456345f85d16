"""``hybridrl plugins NAME``: one backend's kind, distribution, capabilities with their promises, rank limit and
declared option keys; an unknown name is one sentence listing the known ones, exit status 2."""

from __future__ import annotations

import dataclasses

import pytest

from hybridrl.cli import main
from hybridrl.engines.capabilities import ROLLOUT_CAPABILITIES, TRAIN_CAPABILITIES
from hybridrl.plugins.describe import UnknownBackend, describe_backend, find_backends
from hybridrl.plugins.options import OptionDoc, dataclass_options
from hybridrl.plugins.registry import Registry


def test_a_train_backend_shows_its_capabilities_and_declared_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins", "fsdp"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("fsdp: train backend")
    assert "distribution hybridrl-fsdp" in out and "max ranks:     any" in out
    assert f"    lora                 {TRAIN_CAPABILITIES['lora']}" in out
    assert "options: (validated by hybridrl_fsdp.settings:FSDPSettings)" in out
    assert "    packing                   bool = True: padding-free micro-batches" in out
    assert "moe_aux_loss_coef         float | None = unset: " in out


def test_the_built_in_rollouts_show_their_declared_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins", "hf"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("hf: rollout backend") and "distribution hybridrl " in out
    assert f"    lora_adapters        {ROLLOUT_CAPABILITIES['lora_adapters']}" in out
    assert "    attn_implementation  str | None = unset: the attention kernels" in out
    assert main(["plugins", "sglang"]) == 0
    out = capsys.readouterr().out
    assert "checked by hybridrl_sglang.options:option_problems" in out
    assert "    weight_sync             str = 'channel': split pools: " in out


def test_a_rollout_backend_without_declared_options_says_so() -> None:
    registry = Registry()
    registry.add_rollout("bare", "m:R")
    text = "\n".join(describe_backend(find_backends(registry, "bare")[0], "bare-dist", "1.0"))
    assert "options:       not declared" in text


def test_an_unknown_name_lists_the_known_ones(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins", "fsdb"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hybridrl: no plugin registers a backend named 'fsdb' (known: ")
    assert "fsdp" in err and "hf" in err and err.count("\n") == 0


def test_a_name_of_both_kinds_shows_both_and_a_rank_limit() -> None:
    registry = Registry()
    registry.add_train_engine("twin", "m:T", supports={"offload"}, max_ranks=1,
                              options=[OptionDoc("depth", "int", 2, "how deep")])
    registry.add_rollout("twin", "m:R")
    specs = find_backends(registry, "twin")
    assert [s.kind for s in specs] == ["rollout", "train"]
    text = "\n".join(describe_backend(specs[1], "twin-dist", "1.0"))
    assert "max ranks:     1" in text and "depth  int = 2: how deep" in text
    assert "capabilities: none declared" in "\n".join(describe_backend(specs[0], "twin-dist", "1.0"))
    with pytest.raises(UnknownBackend, match=r"known: twin\)"):
        find_backends(registry, "nope")


def test_every_field_of_a_settings_class_needs_a_description() -> None:
    @dataclasses.dataclass
    class Settings:
        depth: int = 2
        width: str | None = None

    with pytest.raises(ValueError, match=r"without a description: \['width'\]"):
        dataclass_options(Settings, {"depth": "how deep"})
    docs = dataclass_options(Settings, {"depth": "how deep", "width": "how wide"}, {"width": "str"})
    assert docs == (OptionDoc("depth", "int", 2, "how deep"), OptionDoc("width", "str", None, "how wide"))
