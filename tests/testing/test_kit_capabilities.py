"""The kit's checks of the LoRA, fused-kernel and returned-routing capabilities, run as a user runs the kit
(``pytest --hybridrl-backend=NAME`` in a fresh process): each deliberately broken backend fails the check of the
promise it breaks, naming it, while the built-in backends that declare the capability pass."""

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
from hybridrl.engines.batch import PROMPT_ROUTED_EXPERTS, RESPONSE_MASK, ROUTED_EXPERTS
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


class RoutesOneTokenLate(HFRollout):
    """Returns each response token's routing one token late: the experts of the token fed before it (the -1s stay
    where they belong)."""

    def generate(self, batch, params):
        out = super().generate(batch, params)
        if params.return_routing:
            routed, prompt = out[ROUTED_EXPERTS], out[PROMPT_ROUTED_EXPERTS]
            before = torch.cat([prompt[:, -1:], routed[:, :-1]], dim=1)  # left-padded: the last prompt token last
            out.set(ROUTED_EXPERTS, torch.where(routed >= 0, before, -1))
        return out


class RoutesTheLastToken(HFRollout):
    """Gives a response's last token (never fed) the experts of the token before it instead of -1."""

    def generate(self, batch, params):
        out = super().generate(batch, params)
        if params.return_routing:
            routed = out[ROUTED_EXPERTS].clone()
            for row, length in enumerate(out[RESPONSE_MASK].sum(dim=1).tolist()):
                if length >= 2:
                    routed[row, length - 1] = routed[row, length - 2]
            out.set(ROUTED_EXPERTS, routed)
        return out


@hookimpl
def hybridrl_register_backends(registry):
    for name, cls in [("broken_lora_base", TrainsTheBase), ("broken_lora_merge", ExportsTheBase),
                      ("broken_lora_names", UnprefixedAdapters), ("broken_lora_ref", ReferenceWithAdapters)]:
        registry.add_train_engine(name, cls, supports={"checkpoint", "offload", "lora"})
    registry.add_train_engine("broken_fused", FusesWrongly, supports={"offload", "fused_layer_kernels"})
    for name, cls in [("broken_adapters", IgnoresAdapters), ("broken_adapter_syncs", StacksAdapters)]:
        registry.add_rollout(name, cls, supports={"sleep", "named_weights", "lora_adapters"})
    for name, cls in [("broken_routing_late", RoutesOneTokenLate), ("broken_routing_last", RoutesTheLastToken)]:
        registry.add_rollout(name, cls, supports={"return_routing"})
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
    ("broken_routing_late", "test_returned_routing_is_the_models_own", rollout.RETURN_ROUTING),
    ("broken_routing_last", "test_returned_routing_is_the_models_own", rollout.RETURN_ROUTING),
]
#: the built-in backends that declare the capabilities pass the same checks in the same run.
PASSING = [("fsdp", "test_lora_update_trains_only_the_adapters"), ("fsdp", "test_lora_export_is_the_merged_policy"),
           ("fsdp", "test_lora_export_adapter_has_peft_names"), ("fsdp", "test_lora_reference_view_is_the_base"),
           ("hf", "test_lora_adapters_serve_the_merged_weights"), ("hf", "test_returned_routing_is_the_models_own")]


def failure(out: str, backend: str, contract: str) -> str:
    """The problems listed in ``backend``'s failure naming ``contract`` (up to the next report section)."""
    return out.split(f"backend '{backend}': {contract}")[1].split("\n_")[0]


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
    assert "sync 2: " in failure(out, "broken_adapter_syncs", rollout.LORA_ADAPTERS)
    assert "fused_kernels=True on cpu" in out
    late = failure(out, "broken_routing_late", rollout.RETURN_ROUTING)
    assert "routed_experts: " in late and "differ from the transformers forward's top-k" in late
    assert "not -1 where nothing was fed" not in late  # the late routing keeps the -1s: the experts give it away
    last = failure(out, "broken_routing_last", rollout.RETURN_ROUTING)
    assert "routed_experts: not -1 where nothing was fed" in last and "differ from" not in last
    result.assert_outcomes(failed=len(CASES), passed=len(PASSING))
