"""The kit's checks of the LoRA and fused-kernel capabilities, run as a user runs the kit (``pytest
--hybridrl-backend=NAME`` in a fresh process): each deliberately broken backend fails the check of the promise
it breaks, naming it, while the built-in backends that declare the capability pass."""

from __future__ import annotations

import os
import re

import pytest

from hybridrl.testing import rollout_contract as rollout
from hybridrl.testing import train_contract as train

pytest_plugins = ["pytester"]

BROKEN_BACKENDS = '''
"""Backends that each break one capability's promise (registered through HYBRIDRL_PLUGINS)."""
import dataclasses

import torch

from hybridrl import hookimpl
from hybridrl.rollout.hf import HFRollout
from hybridrl.weights.buckets import group_into_buckets
from hybridrl_fsdp.engine import FSDPEngine, _full_copy


class TrainsTheBase(FSDPEngine):
    """Moves a frozen base weight at every update (as an engine that left the base trainable would)."""

    def update(self, batch, objective):
        metrics = super().update(batch, objective)
        with torch.no_grad():
            next(p for n, p in self.model.named_parameters() if "base_layer" in n).add_(1e-2)
        return metrics


class ExportsTheBase(FSDPEngine):
    """export_weights gives the base without the adapters merged in."""

    def export_weights(self, bucket_bytes):
        if self.lora is None:
            return super().export_weights(bucket_bytes)
        return group_into_buckets(self.lora.named_tensors(lambda p: _full_copy(p, torch.float32), merged=False),
                                  bucket_bytes)


class UnprefixedAdapters(FSDPEngine):
    """export_adapter drops peft's base_model.model. prefix."""

    def export_adapter(self, bucket_bytes):
        for bucket in super().export_adapter(bucket_bytes):
            yield [(name.removeprefix("base_model.model."), tensor) for name, tensor in bucket]


class ReferenceWithAdapters(FSDPEngine):
    """reference_view is the actor itself: its log-probs carry the trained adapters."""

    def reference_view(self, ctx):
        return self


class FusesWrongly(FSDPEngine):
    """Takes options.fused_kernels on any device and computes something else with it (norm weights off by 5%)."""

    def __init__(self, ctx):
        fused = ctx.options.get("fused_kernels") is True
        super().__init__(dataclasses.replace(ctx, options={**ctx.options, "fused_kernels": False}))
        if fused:
            with torch.no_grad():
                for name, p in self.model.named_parameters():
                    if name.endswith("norm.weight"):
                        p.mul_(1.05)


class IgnoresAdapters(HFRollout):
    """Declares lora_adapters but drops the adapters it is sent."""

    def import_weights(self, bucket):
        super().import_weights([(n, t) for n, t in bucket if ".lora_" not in n])


class StacksAdapters(HFRollout):
    """Merges each sync's adapters onto the previous merge instead of onto the base."""

    def finish_weight_import(self):
        super().finish_weight_import()
        if self.adapters is not None:
            self.adapters.base.clear()


@hookimpl
def hybridrl_register_backends(registry):
    for name, cls in [("broken_lora_base", TrainsTheBase), ("broken_lora_merge", ExportsTheBase),
                      ("broken_lora_names", UnprefixedAdapters), ("broken_lora_ref", ReferenceWithAdapters)]:
        registry.add_train_engine(name, cls, supports={"checkpoint", "offload", "lora"})
    registry.add_train_engine("broken_fused", FusesWrongly, supports={"offload", "fused_layer_kernels"})
    for name, cls in [("broken_adapters", IgnoresAdapters), ("broken_adapter_syncs", StacksAdapters)]:
        registry.add_rollout(name, cls, supports={"sleep", "named_weights", "lora_adapters"})
'''

# (backend, test that must fail, the contract its failure must name)
CASES = [
    ("broken_lora_base", "test_lora_update_trains_only_the_adapters", train.LORA_ONLY_ADAPTERS),
    ("broken_lora_merge", "test_lora_export_is_the_merged_policy", train.LORA_MERGED),
    ("broken_lora_names", "test_lora_export_adapter_has_peft_names", train.LORA_NAMES),
    ("broken_lora_ref", "test_lora_reference_view_is_the_base", train.LORA_REFERENCE),
    ("broken_fused", "test_fused_kernels_off_cuda_refuse_or_fall_back", train.FUSED_CPU),
    ("broken_adapters", "test_lora_adapters_serve_the_merged_weights", rollout.LORA_ADAPTERS),
    ("broken_adapter_syncs", "test_lora_adapters_serve_the_merged_weights", rollout.LORA_ADAPTERS),
]
#: the built-in backends that declare the capabilities pass the same checks in the same run.
PASSING = [("fsdp", "test_lora_update_trains_only_the_adapters"), ("fsdp", "test_lora_export_is_the_merged_policy"),
           ("fsdp", "test_lora_export_adapter_has_peft_names"), ("fsdp", "test_lora_reference_view_is_the_base"),
           ("hf", "test_lora_adapters_serve_the_merged_weights")]


@pytest.fixture
def kit_env(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    pytester.makepyfile(capability_backends=BROKEN_BACKENDS)
    monkeypatch.setenv("HYBRIDRL_PLUGINS", "capability_backends")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(pytester.path), os.environ.get("PYTHONPATH")])))
    return pytester


def test_broken_capabilities_fail_naming_the_broken_promise(kit_env: pytest.Pytester) -> None:
    names = sorted({backend for backend, *_ in CASES + PASSING})
    select = " or ".join(f"({backend} and {test})" for backend, test, *_ in CASES + PASSING)
    result = kit_env.runpytest_subprocess(*[f"--hybridrl-backend={n}" for n in names], "-k", select,
                                          "-p", "no:cacheprovider", timeout=540)
    out = result.stdout.str()
    for backend, test, contract in CASES:
        assert re.search(rf"FAILED \S*::{test}\[{backend}\]", out), f"{backend} {test} did not fail\n{out[-3000:]}"
        assert f"backend '{backend}': {contract}" in out, f"{backend}: the failure does not name '{contract}'"
    assert "sync 2: " in out.split(f"backend 'broken_adapter_syncs': {rollout.LORA_ADAPTERS}")[1].split("\n_")[0]
    assert "fused_kernels=True on cpu" in out
    result.assert_outcomes(failed=len(CASES), passed=len(PASSING))
