"""The fused layer kernels' selection and switches (``hybridrl_fsdp.layer_kernels``). The kernels themselves are
Triton (CUDA): their values and gradients against the eager layers are checked by the gpu-marked test below."""

from __future__ import annotations

import pytest
import torch

from hybridrl_fsdp import layer_kernels
from hybridrl_fsdp.settings import FSDPSettings, option_problems

transformers = pytest.importorskip("transformers")


def tiny_qwen2(hidden_act: str = "silu", layers: int = 2) -> torch.nn.Module:
    config = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, hidden_act=hidden_act,
                                      max_position_embeddings=128)
    return transformers.Qwen2ForCausalLM(config)


def test_auto_is_off_on_cpu_and_true_there_is_refused_with_its_key():
    cpu = torch.device("cpu")
    assert layer_kernels.resolve("auto", cpu) is False
    assert layer_kernels.resolve(False, torch.device("cuda")) is False
    with pytest.raises(ValueError, match="fused_kernels: true needs CUDA"):
        layer_kernels.resolve(True, cpu)
    with pytest.raises(ValueError, match="fused_kernels must be"):
        layer_kernels.resolve("yes", cpu)


def test_auto_on_cuda_follows_whether_liger_is_installed(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(layer_kernels, "liger_installed", lambda: False)
    assert layer_kernels.resolve("auto", cuda) is False
    with pytest.raises(ValueError, match="liger-kernel"):
        layer_kernels.resolve(True, cuda)
    monkeypatch.setattr(layer_kernels, "liger_installed", lambda: True)
    assert layer_kernels.resolve("auto", cuda) is True


def test_the_plan_finds_every_norm_gated_mlp_and_the_rotary_function():
    model = tiny_qwen2(layers=3)
    fused = layer_kernels.plan(model)
    # two norms per layer and the final one; one MLP per layer; the rotary function of qwen2's modeling module
    assert len(fused.rms_norms) == 2 * 3 + 1 and "model.norm" in fused.rms_norms
    assert fused.mlps == [f"model.layers.{i}.mlp" for i in range(3)]
    assert fused.rotary == ["transformers.models.qwen2.modeling_qwen2"]


def test_an_mlp_that_is_not_silu_gated_is_left_alone():
    fused = layer_kernels.plan(tiny_qwen2(hidden_act="gelu"))
    assert fused.mlps == [] and len(fused.rms_norms) == 5


def test_the_rotary_wrapper_keeps_the_original_for_cpu_tensors_and_other_layouts():
    calls = []

    def original(q, k, cos, sin, *args, **kwargs):
        calls.append("original")
        return q + 1, k + 1

    def fused(*args):  # pragma: no cover - must not be reached for CPU tensors
        raise AssertionError("the fused kernel ran on CPU tensors")

    rotary = layer_kernels._fused_rotary(original, fused)
    q, k, cos = torch.zeros(1, 4, 3, 8), torch.zeros(1, 2, 3, 8), torch.ones(1, 3, 8)
    out_q, _ = rotary(q, k, cos, cos)
    assert calls == ["original"] and torch.equal(out_q, q + 1)
    rotary(q, k, cos, cos, unsqueeze_dim=2)
    assert calls == ["original", "original"]


def test_the_option_is_checked_before_any_process_starts():
    assert option_problems("actor", {"fused_kernels": "auto"}) == []
    assert option_problems("actor", {"fused_kernels": False}) == []
    for bad in ("yes", 1):
        (problem,) = option_problems("actor", {"fused_kernels": bad})
        assert problem[0] == "fused_kernels" and "auto, true, false" in problem[1]
    assert FSDPSettings.from_options({}, "actor").fused_kernels == "auto"


def _eager_and_fused_grads(model, ids):
    logits = model(input_ids=ids).logits.float()
    logits.logsumexp(-1).mean().backward()
    return logits.detach(), {n: p.grad.float() for n, p in model.named_parameters()}


def _saved_bytes(model, ids) -> int:
    """Bytes autograd keeps for backward in one forward (each storage once)."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids).logits.sum().backward()
    return sum(seen.values())


gpu = [pytest.mark.gpu,
       pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (liger-kernel's Triton kernels)")]


@gpu[0]
@gpu[1]
def test_fused_layers_equal_the_eager_ones_on_cuda():
    pytest.importorskip("liger_kernel")
    torch.manual_seed(0)
    eager = tiny_qwen2(layers=2).cuda().to(torch.bfloat16)
    fused_model = tiny_qwen2(layers=2).cuda().to(torch.bfloat16)
    fused_model.load_state_dict(eager.state_dict())
    ids = torch.randint(0, 64, (2, 24), device="cuda")
    expected_logits, expected_grads = _eager_and_fused_grads(eager, ids)  # before the rotary function is wrapped
    report = layer_kernels.install(fused_model)
    assert len(report.mlps) == 2 and len(report.rms_norms) == 5 and report.rotary
    logits, grads = _eager_and_fused_grads(fused_model, ids)
    torch.testing.assert_close(logits, expected_logits, atol=3e-2, rtol=3e-2)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=3e-2, rtol=5e-2, msg=name)


@gpu[0]
@gpu[1]
def test_the_memory_plan_counts_what_fused_layers_keep_for_backward():
    """Per token and layer, what autograd keeps is the plan's ``saved_bytes_per_token_layer(fused=True)``."""
    pytest.importorskip("liger_kernel")
    from hybridrl.placement.memory import shape_from_hf_config

    tokens = 2 * 512
    ids = torch.randint(0, 64, (2, 512), device="cuda")
    per_layer = []
    for layers in (2, 4):
        model = tiny_qwen2(layers=layers).cuda().to(torch.bfloat16)
        layer_kernels.install(model)
        per_layer.append(_saved_bytes(model, ids))
    measured = (per_layer[1] - per_layer[0]) / 2 / tokens
    shape = shape_from_hf_config(tiny_qwen2(layers=1).config.to_dict())
    planned = shape.saved_bytes_per_token_layer(2, fused=True)
    assert measured == pytest.approx(planned, rel=0.1), (measured, planned,
                                                         shape.saved_bytes_per_token_layer(2, fused=False))
