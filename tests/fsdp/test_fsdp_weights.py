"""``export_weights``: every HF parameter once, the model's values, bucket sizes; ``full_state_dict`` copies."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _fsdp_helpers import PolicyGradient, context, local_tensor, make_batch

from hybridrl_fsdp.engine import FSDPEngine


def hf_parameters(model_path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("which", ["tiny_model", "tiny_model_untied"])
@pytest.mark.parametrize("bucket_bytes", [1, 4096, 6000, 1 << 30])
def test_export_names_values_buckets(process_group, request, which: str, bucket_bytes: int) -> None:
    model_path = request.getfixturevalue(which)
    engine = FSDPEngine(context(model_path))
    expected = hf_parameters(model_path)
    buckets = list(engine.export_weights(bucket_bytes))

    names = [name for bucket in buckets for name, _ in bucket]
    assert len(names) == len(set(names)), "a name was exported twice"
    assert set(names) == set(expected)
    assert ("lm_head.weight" in names) == (which == "tiny_model_untied")  # a tied head is not sent twice
    for bucket in buckets:
        for name, tensor in bucket:
            assert tensor.dtype == torch.float32 and not tensor.requires_grad
            torch.testing.assert_close(tensor, expected[name], atol=0, rtol=0)
    _check_bucket_sizes(buckets, bucket_bytes)


def _check_bucket_sizes(buckets, bucket_bytes: int) -> None:
    sizes = [[t.numel() * t.element_size() for _, t in bucket] for bucket in buckets]
    for i, bucket in enumerate(sizes):
        assert bucket, "empty bucket"
        if any(s >= bucket_bytes for s in bucket):
            assert len(bucket) == 1, "a tensor of at least bucket_bytes travels alone"
        assert sum(bucket[:-1]) < bucket_bytes, "a bucket closes once it reaches bucket_bytes"
        if i < len(sizes) - 1:  # a bucket closes early only to let a big tensor travel alone
            assert sum(bucket) >= bucket_bytes or sizes[i + 1][0] >= bucket_bytes
    if bucket_bytes == 1 << 30:
        assert len(buckets) == 1


def test_full_state_dict_is_a_copy(process_group, tiny_model: Path) -> None:
    engine = FSDPEngine(context(tiny_model, lr=1e-2))
    before = engine.full_state_dict()
    frozen = {n: t.clone() for n, t in before.items()}
    engine.update(make_batch(4, seed=2), PolicyGradient())
    after = engine.full_state_dict()
    for name in before:
        torch.testing.assert_close(before[name], frozen[name], atol=0, rtol=0)  # not a view of the live shards
    assert any(not torch.equal(after[n], before[n]) for n in before)


def test_bucket_bytes_must_be_positive(process_group, tiny_model: Path) -> None:
    engine = FSDPEngine(context(tiny_model, trainable=False))
    with pytest.raises(ValueError):
        next(engine.export_weights(0))


def test_transient_export_follows_updates_and_swapped_shards(process_group, tiny_model: Path) -> None:
    """The one-rank transient export hands the live shards: after an optimiser step it shows the new values,
    and after the shards are swapped for new tensors (what ``offload``/``onload`` do on a GPU) it hands the new
    tensors, never the old ones."""
    engine = FSDPEngine(context(tiny_model, lr=1e-2))

    def exported() -> dict[str, torch.Tensor]:
        return {n: t for bucket in engine.export_weights_transient(1 << 30) for n, t in bucket}

    first = {n: t.clone() for n, t in exported().items()}
    engine.update(make_batch(4, seed=2), PolicyGradient())
    second = exported()
    live = {n: t.clone() for bucket in engine.export_weights(1 << 30) for n, t in bucket}
    assert set(second) == set(live)
    for name in live:
        torch.testing.assert_close(second[name], live[name], atol=0, rtol=0)
    assert any(not torch.equal(first[n], second[n]) for n in first), "the step changed nothing"

    engine.model.to(torch.float64)  # every shard becomes a new tensor
    swapped = exported()
    assert all(t.dtype == torch.float64 for t in swapped.values())
    for name in live:
        torch.testing.assert_close(swapped[name], live[name].double(), atol=0, rtol=0)

    # views of the live shards, no copy of the model: the same memory as each parameter's local tensor
    locals_ = {n: local_tensor(p) for n, p in engine.model.named_parameters()}
    assert all(swapped[n].data_ptr() == t.data_ptr() for n, t in locals_.items())
    assert engine.transient_export_holds_views()  # one rank: the bridge may take them in one bucket
