"""LoRA on the FSDP engine (peft): the LoRA policy's log-probs are the merged model's, the reference is the base,
only the adapters train, checkpoints hold the adapters, the adapters load into peft and round trip."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from _fsdp_helpers import PolicyGradient, context, make_batch

from hybridrl.lora import LoraSpec, adapter_name, parse_adapter_name, write_adapter
from hybridrl_fsdp.engine import FSDPEngine

pytest.importorskip("peft")

SPEC = LoraSpec(rank=4, alpha=8.0)


def lora_engine(model_path: Path, spec: LoraSpec = SPEC, trainable: bool = True, **options) -> FSDPEngine:
    options.setdefault("lr", 5e-2)
    return FSDPEngine(dataclasses.replace(context(model_path, trainable=trainable, **options), lora=spec))


def reference_of(actor: FSDPEngine, model_path: Path, **options) -> FSDPEngine:
    ctx = dataclasses.replace(context(model_path, trainable=False, **options), role="ref")
    return actor.reference_view(ctx)


def trained(engine: FSDPEngine, steps: int = 2) -> FSDPEngine:
    """Moved off its initialisation (peft starts B at zero, so an untrained LoRA policy is the base)."""
    for step in range(steps):
        metrics = engine.update(make_batch(6, seed=10 + step), PolicyGradient())
        assert metrics["skipped_step"] == 0.0
    return engine


def save_weights(weights: dict[str, torch.Tensor], like: Path, out: Path) -> Path:
    """A model folder with ``like``'s architecture and ``weights``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(like, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.save_pretrained(out)
    return out


def full_weights(engine: FSDPEngine) -> dict[str, torch.Tensor]:
    return {n: t.clone() for bucket in engine.export_weights(1 << 30) for n, t in bucket}


def hf_parameters(model_path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("fused_lm_head", [True, False])
@pytest.mark.parametrize("packing", [True, False])
def test_lora_log_probs_equal_the_merged_models(process_group, tiny_model, tmp_path, fused_lm_head, packing):
    """The peft-wrapped model through packed (padding-free) and padded micro-batches: the merged model's numbers
    (the merged model read padded, so packed LoRA is checked against the other path too)."""
    actor = trained(lora_engine(tiny_model, fused_lm_head=fused_lm_head, packing=packing))
    batch = make_batch(5, seed=3)
    lora = actor.compute_log_probs(batch, with_entropy=True)
    merged = FSDPEngine(context(save_weights(full_weights(actor), tiny_model, tmp_path / "merged"), packing=False,
                                trainable=False, fused_lm_head=fused_lm_head)).compute_log_probs(batch, True)
    base = FSDPEngine(context(tiny_model, trainable=False)).compute_log_probs(batch)
    assert (lora["log_probs"] - base["log_probs"]).abs().max() > 1e-2, "the adapters never moved the policy"
    torch.testing.assert_close(lora["log_probs"], merged["log_probs"], atol=2e-5, rtol=0)
    torch.testing.assert_close(lora["entropy"], merged["entropy"], atol=2e-5, rtol=0)


def test_reference_is_the_base_and_only_the_adapters_train(process_group, tiny_model):
    actor = lora_engine(tiny_model)
    reference = reference_of(actor, tiny_model, micro_batch=2)
    plain = FSDPEngine(context(tiny_model, trainable=False, micro_batch=2))  # the reference's micro-batches
    batch = make_batch(5, seed=4)
    before = actor.compute_log_probs(batch)["log_probs"]  # untrained: B = 0, the base (in other micro-batches)
    torch.testing.assert_close(reference.compute_log_probs(batch)["log_probs"], before, atol=1e-6, rtol=0)
    trained(actor)

    # the reference is the frozen base, exactly, while the actor has moved
    expected = plain.compute_log_probs(batch)["log_probs"]
    torch.testing.assert_close(reference.compute_log_probs(batch)["log_probs"], expected, atol=0, rtol=0)
    assert (actor.compute_log_probs(batch)["log_probs"] - expected).abs().max() > 1e-2
    base = {n: t for bucket in reference.export_weights(1 << 30) for n, t in bucket}
    for name, tensor in hf_parameters(tiny_model).items():
        torch.testing.assert_close(base[name], tensor, atol=0, rtol=0)
    # one model: the view holds no weights of its own, plans its own micro-batches, has no optimizer
    assert reference.model is actor.model and reference.optimizer is None
    assert reference.training.micro_batch == 2 and actor.training.micro_batch != 2
    with pytest.raises(RuntimeError, match="frozen"):
        reference.update(batch, PolicyGradient())

    # the optimizer holds the adapters alone: rank x (in + out) per adapted layer
    optimized = [p for group in actor.optimizer.param_groups for p in group["params"]]
    assert {id(p) for p in optimized} == {id(p) for n, p in actor.model.named_parameters() if ".lora_" in n}
    layers = actor.lora.layers
    assert len(layers) == 2 * 7  # q, k, v, o, gate, up, down in both layers
    assert sum(p.numel() for p in optimized) == sum(
        SPEC.rank * (w.shape[0] + w.shape[1]) for n, w in hf_parameters(tiny_model).items()
        if n.removesuffix(".weight") in layers)


def test_target_modules_and_their_errors(process_group, tiny_model):
    engine = lora_engine(tiny_model, LoraSpec(rank=2, alpha=2.0, target_modules=("q_proj", "v_proj")))
    assert engine.lora.target_modules == ["q_proj", "v_proj"]
    names = [n for bucket in engine.export_adapter(1 << 30) for n, _ in bucket]
    assert len(names) == 2 * 2 * 2 and all(parse_adapter_name(n) for n in names)
    assert adapter_name("model.layers.1.self_attn.v_proj", "B") in names
    with pytest.raises(ValueError, match="roles.actor.lora.target_modules"):
        lora_engine(tiny_model, LoraSpec(rank=2, alpha=2.0, target_modules=("no_such_proj",)))


def test_checkpoint_holds_the_adapters_and_resumes_exactly(process_group, tiny_model, tmp_path):
    import torch.distributed.checkpoint as dcp

    actor = trained(lora_engine(tiny_model))
    actor.save_checkpoint(str(tmp_path / "ckpt"))
    saved = dcp.FileSystemReader(str(tmp_path / "ckpt" / "dcp")).read_metadata().state_dict_metadata
    model_keys = {k for k in saved if k.startswith("model.")}
    assert model_keys and all(".lora_" in k for k in model_keys), sorted(model_keys)[:4]  # no base weights
    assert any(k.startswith("optim.") for k in saved)

    resumed = lora_engine(tiny_model)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    batch, nxt = make_batch(5, seed=5), make_batch(6, seed=6)
    torch.testing.assert_close(resumed.compute_log_probs(batch)["log_probs"],
                               actor.compute_log_probs(batch)["log_probs"], atol=0, rtol=0)
    actor.update(nxt, PolicyGradient())
    resumed.update(nxt, PolicyGradient())  # AdamW's moments came back too: the next step is the same
    torch.testing.assert_close(resumed.compute_log_probs(batch)["log_probs"],
                               actor.compute_log_probs(batch)["log_probs"], atol=0, rtol=0)


def test_exported_adapter_loads_into_peft(process_group, tiny_model, tmp_path):
    """What the adapter sync sends and ``hybridrl export --adapter`` writes is a peft adapter of the policy."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    actor = trained(lora_engine(tiny_model))
    tensors = {n: t.clone() for bucket in actor.export_adapter(1 << 30) for n, t in bucket}
    assert all(t.dtype == torch.float32 for t in tensors.values())
    folder = write_adapter(tmp_path / "adapter", tensors, SPEC.peft_config(str(tiny_model), actor.lora.target_modules))
    assert json.loads((folder / "adapter_config.json").read_text())["r"] == SPEC.rank

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), folder)
    merged = full_weights(actor)
    for name, tensor in model.merge_and_unload().state_dict().items():
        if name in merged:
            torch.testing.assert_close(tensor, merged[name], atol=1e-6, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_lora_on_cuda(tmp_path):
    """bf16 base + fp32 adapters, packed flash micro-batches through peft, merged bf16 export, offload (in a
    process of its own: NCCL)."""
    import os
    import subprocess
    import sys

    from hybridrl.runtime.distributed import free_port

    worker = Path(__file__).with_name("_lora_cuda_worker.py")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")}
    proc = subprocess.run([sys.executable, str(worker), str(free_port()), str(tmp_path)], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_reference_forward_first_leaves_the_adapters_gradients_fp32_under_mixed_precision(process_group,
                                                                                             tiny_model):
    """The GPU layout on CPU: a bf16 frozen base with fp32 adapters under FSDP2's mixed precision, whose groups
    fix their gradient dtypes at the first forward; the step's first forward is the reference's (adapters
    disabled). The training backward after it must give fp32 gradients (it failed on the H200 at 7B:
    'attempting to assign a gradient with dtype BFloat16 to a tensor with grad_dtype Float')."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    from hybridrl_fsdp.lora import Adapters

    lora = Adapters(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), SPEC,
                    base_dtype=torch.bfloat16)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in lora.model.base_model.model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(lora.model, mp_policy=policy)
    ids = torch.randint(0, lora.model.config.vocab_size, (2, 8))
    with torch.no_grad(), lora.disabled():
        lora.model(input_ids=ids)
    lora.model(input_ids=ids).logits.float().sum().backward()
    grads = {n: p.grad for n, p in lora.model.named_parameters() if p.grad is not None}
    assert grads and set(grads) <= lora.adapter_params
    assert {g.dtype for g in grads.values()} == {torch.float32}
