"""``MegatronEngine`` on one CPU rank (in the pytest process): logits and log-probs against transformers, updates
against plain PyTorch training, frozen/NaN/warmup behaviour, checkpoints, HF export, CPU stand-ins."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _mg_helpers import (
    NaNObjective,
    PlainCritic,
    PolicyGradient,
    ValueRegression,
    assert_close,
    context,
    hf_model,
    hf_response_log_probs,
    logits_input,
    make_batch,
    plain_critic_training,
    plain_training,
)
from _mg_markers import needs_megatron

from hybridrl.engines.batch import ENTROPY, LOG_PROBS, RESPONSE_MASK, VALUES

pytestmark = needs_megatron

ATOL = 1e-4  # fp32 on CPU


@pytest.fixture(scope="module")
def engine_cls(process_group):
    from hybridrl_megatron.engine import MegatronEngine

    return MegatronEngine


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("model", ["qwen2_tied", "llama_untied", "llama3_rope"])
def test_logits_equal_transformers(engine_cls, model: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(model)
    engine = engine_cls(context(path, trainable=False))  # default vocab padding: 41 ids padded to 128
    assert engine.padded_vocab == 128
    ids = logits_input()
    got = engine.compute_logits(ids)
    with torch.no_grad():
        want = hf_model(path)(input_ids=ids).logits
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_log_probs_and_entropy_equal_transformers(engine_cls, qwen2_tied: Path) -> None:
    """Left-padded prompts, right-padded responses, a sampling temperature, micro-batches of 2 with a
    filled-up last one (5 rows)."""
    engine = engine_cls(context(qwen2_tied, micro_batch=2))
    batch = make_batch(5, seed=4)
    batch.info["temperature"] = 0.7
    out = engine.compute_log_probs(batch, with_entropy=True)
    model = hf_model(qwen2_tied)
    with torch.no_grad():
        scaled = _scaled_copy(model, 0.7)
        want = hf_response_log_probs(scaled, batch)
    assert out[LOG_PROBS].shape == batch[RESPONSE_MASK].shape and out[LOG_PROBS].dtype == torch.float32
    torch.testing.assert_close(out[LOG_PROBS], want, atol=ATOL, rtol=0)
    assert torch.equal(out[ENTROPY][~batch[RESPONSE_MASK].bool()], torch.zeros(int((batch[RESPONSE_MASK] == 0).sum())))
    assert (out[ENTROPY][batch[RESPONSE_MASK].bool()] > 0).all()


def test_greedy_margins_equal_transformers(engine_cls, qwen2_tied: Path) -> None:
    """``compute_greedy_margins`` (the trainer's sync check): max logit minus the response token's, over the real
    vocabulary (the padded ids left out), 0 at padding; micro-batches of 2 over 5 rows."""
    from hybridrl.engines.batch import RESPONSE_IDS, sequence_tensors
    from hybridrl.weights.sync_check import GREEDY_MARGIN

    engine = engine_cls(context(qwen2_tied, micro_batch=2))
    batch = make_batch(5, seed=6)
    got = engine.compute_greedy_margins(batch)[GREEDY_MARGIN]
    ids, mask, pos = sequence_tensors(batch)
    r = batch[RESPONSE_IDS].shape[1]
    p = ids.shape[1] - r
    with torch.no_grad():
        logits = hf_model(qwen2_tied)(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, p - 1: p + r - 1]
    want = (logits.max(-1).values - logits.gather(-1, batch[RESPONSE_IDS][..., None]).squeeze(-1))
    resp = batch[RESPONSE_MASK].bool()
    torch.testing.assert_close(got[resp], want[resp], atol=ATOL, rtol=0)
    assert (got[~resp] == 0).all() and (got[resp] > 0).any()


def _scaled_copy(model, temperature: float):
    """The same transformers model with its LM head divided by the temperature (logits / T)."""
    import copy

    scaled = copy.deepcopy(model)
    scaled.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach() / temperature)
    return scaled


def test_updates_equal_plain_pytorch_training(engine_cls, llama_untied: Path) -> None:
    batch = make_batch(6, seed=2)
    engine = engine_cls(context(llama_untied, micro_batch=2, lr=1e-2, grad_clip=1.0))
    metrics = [engine.update(batch, PolicyGradient()) for _ in range(3)]
    weights, losses, norms = plain_training(llama_untied, batch, steps=3, micro_batch=2, lr=1e-2, grad_clip=1.0)
    initial = hf_model(llama_untied).state_dict()
    # Adam normalises each element's gradient, so near-zero gradients turn rounding into part of a step.
    atol = 1e-4
    assert max(float((weights[n] - initial[n]).abs().max()) for n in weights) > 100 * atol
    exported = engine.full_state_dict()
    assert exported.keys() == weights.keys()
    for name in weights:
        assert_close(exported[name], weights[name], atol, name)
    for got, loss, norm in zip(metrics, losses, norms):
        assert got["loss"] == pytest.approx(loss, abs=1e-5)
        assert got["grad_norm"] == pytest.approx(norm, rel=1e-4)
        assert got["skipped_step"] == 0.0 and got["tokens"] > 0


def test_cuda_optimiser_path_runs_under_the_cpu_stand_ins(engine_cls, llama_untied: Path) -> None:
    """``MegatronStepper`` (the CUDA path: Megatron's DDP, ``finalize_model_grads``, ``get_megatron_optimizer``)
    driven on CPU. Its gradient clipping asserts CUDA tensors, so clipping is off here; everything else must
    train exactly like plain PyTorch, which checks the glue to megatron-core's API without a GPU."""
    from hybridrl_megatron.cpu_compat import cpu_megatron
    from hybridrl_megatron.optim import MegatronStepper

    engine = engine_cls(context(llama_untied, micro_batch=2, lr=1e-2, grad_clip=0))
    with cpu_megatron():
        engine.stepper = MegatronStepper(engine.model, engine.config, engine.layout, engine.training)
        engine.stepper.configure(engine.config)
    batch = make_batch(6, seed=2)
    metrics = [engine.update(batch, PolicyGradient()) for _ in range(3)]
    weights, losses, norms = plain_training(llama_untied, batch, steps=3, micro_batch=2, lr=1e-2, grad_clip=1e9)
    for got, loss, norm in zip(metrics, losses, norms):
        assert got["loss"] == pytest.approx(loss, abs=1e-5) and got["grad_norm"] == pytest.approx(norm, rel=1e-4)
    exported = engine.full_state_dict()
    for name in weights:
        assert_close(exported[name], weights[name], 1e-4, name)


def test_zero_lr_and_warmup(engine_cls, qwen2_tied: Path) -> None:
    batch = make_batch(4, seed=6)
    frozen_lr = engine_cls(context(qwen2_tied, lr=0.0))
    before = frozen_lr.full_state_dict()
    assert frozen_lr.update(batch, PolicyGradient())["grad_norm"] > 0
    assert same_weights(frozen_lr.full_state_dict(), before)
    warm = engine_cls(context(qwen2_tied, lr=1e-3, warmup_steps=4))
    lrs = [warm.update(batch, PolicyGradient())["lr"] for _ in range(5)]
    assert lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])


def test_frozen_engine_refuses_update(engine_cls, qwen2_tied: Path) -> None:
    engine = engine_cls(context(qwen2_tied, trainable=False))
    assert engine.stepper is None and not any(p.requires_grad for p in engine.model.parameters())
    with pytest.raises(RuntimeError, match="frozen"):
        engine.update(make_batch(2, seed=1), PolicyGradient())


def test_nan_loss_skips_the_step(engine_cls, qwen2_tied: Path) -> None:
    engine = engine_cls(context(qwen2_tied, lr=1e-2, micro_batch=2))
    batch = make_batch(4, seed=9)
    before = engine.full_state_dict()
    metrics = engine.update(batch, NaNObjective())
    assert metrics["skipped_step"] == 1.0
    assert same_weights(engine.full_state_dict(), before)
    assert not engine.stepper.optimizer.state, "a skipped step must not touch the AdamW moments"
    recovered = engine.update(batch, PolicyGradient())
    assert recovered["skipped_step"] == 0.0 and recovered["lr"] == pytest.approx(1e-2)
    assert not same_weights(engine.full_state_dict(), before)


def test_checkpoint_resume_continues_the_run(engine_cls, qwen2_tied: Path, tmp_path: Path) -> None:
    first, second = make_batch(4, seed=1), make_batch(4, seed=2)
    engine = engine_cls(context(qwen2_tied, lr=1e-2))
    engine.update(first, PolicyGradient())
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    from hybridrl.run.trusted_files import unsafe_files

    assert unsafe_files(tmp_path / "ckpt") == []  # plain data: it loads with weights_only=True
    saved = engine.full_state_dict()
    engine.update(second, PolicyGradient())
    continued = engine.full_state_dict()
    assert not same_weights(saved, continued)

    resumed = engine_cls(context(qwen2_tied, lr=1e-2))
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert same_weights(resumed.full_state_dict(), saved)
    resumed.update(second, PolicyGradient())  # the AdamW moments and step count came back too
    for name, tensor in resumed.full_state_dict().items():
        torch.testing.assert_close(tensor, continued[name], atol=1e-6, rtol=0)

    other_layout = engine_cls(context(qwen2_tied, lr=1e-2, vocab_multiple=1))
    with pytest.raises(ValueError, match="saved with"):
        other_layout.load_checkpoint(str(tmp_path / "ckpt"))


def test_hf_checkpoint_out(engine_cls, qwen2_tied: Path, tmp_path: Path) -> None:
    engine = engine_cls(context(qwen2_tied, lr=1e-2))
    engine.update(make_batch(4, seed=3), PolicyGradient())
    engine.save_hf_checkpoint(str(tmp_path / "hf"))
    ids = logits_input()
    with torch.no_grad():
        reloaded = hf_model(tmp_path / "hf")(input_ids=ids).logits
    torch.testing.assert_close(engine.compute_logits(ids), reloaded, atol=ATOL, rtol=0)


def test_export_buckets(engine_cls, llama_untied: Path) -> None:
    engine = engine_cls(context(llama_untied))
    from safetensors.torch import load_file

    saved = load_file(str(llama_untied / "model.safetensors"))
    for bucket_bytes in (1 << 30, 4096):
        buckets = list(engine.export_weights(bucket_bytes))
        names = [n for b in buckets for n, _ in b]
        assert sorted(names) == sorted(saved) and len(names) == len(set(names))
        assert all(torch.equal(t, saved[n]) for b in buckets for n, t in b)
    small = list(engine.export_weights(4096))
    assert len(small) > 1 and all(sum(t.numel() * 4 for _, t in b[:-1]) < 4096 for b in small)


def test_megatron_roles_in_one_process_share_the_layout(engine_cls, qwen2_tied: Path) -> None:
    engine_cls(context(qwen2_tied, trainable=False))  # takes (or keeps) the process's 1 x 1 layout
    with pytest.raises(ValueError, match="does not divide"):
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()  # a fresh process asking for more ranks than it has
        engine_cls(context(qwen2_tied, tensor_parallel=2))
    engine_cls(context(qwen2_tied, tensor_parallel=1))
    with pytest.raises(RuntimeError, match="share the layout"):
        engine_cls(context(qwen2_tied, pipeline_parallel=2))


def test_unsupported_options_are_refused(engine_cls, qwen2_tied: Path) -> None:
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        engine_cls(context(qwen2_tied, max_tokens_per_micro_batch=64))
    with pytest.raises(ValueError, match="micro_batch"):
        engine_cls(context(qwen2_tied, micro_batch=0))
    with pytest.raises(ValueError, match="reward model"):
        engine_cls(context(qwen2_tied, trainable=False, role="reward"))


# --- critic ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["qwen2_tied", "llama_untied"])
def test_critic_trains_like_a_plain_backbone_with_a_value_head(engine_cls, model: str,
                                                                request: pytest.FixtureRequest) -> None:
    """Values and updates of the critic equal a transformers backbone + ``nn.Linear(hidden, 1)`` given the
    same head, trained directly."""
    path: Path = request.getfixturevalue(model)
    critic = engine_cls(context(path, role="critic", micro_batch=2, lr=1e-2))
    start = critic.full_state_dict()
    assert not any(n.startswith("lm_head") for n in start)
    plain = PlainCritic(path, start["value_head.weight"], start["value_head.bias"])
    assert start.keys() == plain.hf_state().keys()
    batch = make_batch(5, seed=3)
    with torch.no_grad():
        want = plain.response_values(batch)
    torch.testing.assert_close(critic.compute_values(batch)[VALUES], want, atol=ATOL, rtol=0)

    metrics = [critic.update(batch, ValueRegression()) for _ in range(2)]
    losses, norms = plain_critic_training(plain, batch, 2, micro_batch=2, lr=1e-2, grad_clip=1.0)
    for got, loss, norm in zip(metrics, losses, norms):
        assert got["loss"] == pytest.approx(loss, abs=1e-5) and got["grad_norm"] == pytest.approx(norm, rel=1e-4)
    trained, want = critic.full_state_dict(), plain.hf_state()
    assert any(not torch.equal(trained[n], start[n]) for n in start)
    for name in want:
        assert_close(trained[name], want[name], 1e-4, name)


def test_critic_checkpoint_folder_keeps_the_head(engine_cls, qwen2_tied: Path, tmp_path: Path) -> None:
    critic = engine_cls(context(qwen2_tied, role="critic", lr=1e-2))
    batch = make_batch(4, seed=5)
    critic.update(batch, ValueRegression())
    critic.save_hf_checkpoint(str(tmp_path / "critic"))
    assert (tmp_path / "critic" / "value_head.safetensors").is_file()
    reloaded = engine_cls(context(tmp_path / "critic", role="critic"))
    assert torch.equal(reloaded.compute_values(batch)[VALUES], critic.compute_values(batch)[VALUES])
    with pytest.raises(RuntimeError, match="'lm' head"):
        critic.compute_log_probs(batch)
    with pytest.raises(RuntimeError, match="'value' head"):
        engine_cls(context(qwen2_tied, trainable=False)).compute_values(batch)
    with pytest.raises(ValueError, match="cannot compute"):
        critic.update(batch, PolicyGradient())


def test_cpu_stand_ins_are_scoped() -> None:
    """Inside the engine's block megatron-core's CUDA calls land on the CPU; outside, torch.cuda is untouched."""
    from hybridrl_megatron.cpu_compat import cpu_megatron

    real = torch.cuda.current_device
    with cpu_megatron():
        with cpu_megatron():  # re-entrant
            assert torch.cuda.current_device() == torch.device("cpu")
            assert torch.zeros(2, device="cuda").device.type == "cpu"
            assert torch.ones(1).cuda().device.type == "cpu"
        assert torch.cuda.current_device() == torch.device("cpu")
    assert torch.cuda.current_device is real
    if not torch.cuda.is_available():
        with pytest.raises((AssertionError, RuntimeError)):
            torch.zeros(1, device="cuda")
