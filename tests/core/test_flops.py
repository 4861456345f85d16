"""FLOP counts against PyTorch's own FLOP counter on a real model, the peak table, and the MFU arithmetic."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from hybridrl.observe.flops import PEAK_ENV, forward_flops, peak_flops, phase_perf, shared_prompt_savings, train_flops
from hybridrl.placement.memory import shape_from_hf_config


def tiny_model(tied: bool):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    torch.manual_seed(0)
    # eager attention: its matmuls are plain bmm that FlopCounterMode counts (CPU SDPA kernels it does not)
    model = Qwen2ForCausalLM._from_config(config, attn_implementation="eager")
    return model, shape_from_hf_config(config.to_dict())


@pytest.mark.parametrize("tied", [False, True])
def test_forward_flops_equal_torch_flop_counter(tied):
    model, shape = tiny_model(tied)
    model.eval()
    total = 0
    for length in (5, 23):
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model(torch.randint(0, 97, (1, length)))
        total += counter.get_total_flops()
    assert forward_flops(shape, [5, 23]) == total


def test_training_flops_are_three_forwards_by_torch_flop_counter():
    model, shape = tiny_model(False)
    model.train()
    with FlopCounterMode(display=False) as counter:
        model(torch.randint(0, 97, (1, 17))).logits.sum().backward()
    assert train_flops(shape, [17]) == counter.get_total_flops()


def test_attention_term_grows_with_the_square_of_the_length():
    _, shape = tiny_model(False)
    linear = forward_flops(shape, [1])  # 2N + 4*layers*q_dim
    attn = 4 * shape.num_layers * shape.q_dim
    assert forward_flops(shape, [10]) == pytest.approx(10 * (linear - attn) + 100 * attn)


def test_peak_table(monkeypatch):
    monkeypatch.delenv(PEAK_ENV, raising=False)
    assert peak_flops("NVIDIA H200", "bfloat16") == 989e12
    assert peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == 989e12
    assert peak_flops("NVIDIA H100 PCIe", "bfloat16") == 756e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", "float16") == 312e12
    assert peak_flops("H100", "float32") is None  # no fp32 entry: no MFU rather than a wrong one
    assert peak_flops(None, "bfloat16") is None  # CPU
    assert peak_flops("Some Future GPU", "bfloat16") is None
    monkeypatch.setenv(PEAK_ENV, "100")
    assert peak_flops("Some Future GPU", "bfloat16") == 100e12


def test_phase_perf_arithmetic():
    _, shape = tiny_model(False)
    lengths = [12, 20, 7]
    fwd = forward_flops(shape, lengths)
    seconds = {"gen": 2.0, "ref": 0.5, "old_log_prob": 0.25, "update_actor": 1.0, "step": 4.0, "adv": 0.1}
    devices = {"rollout": 4, "ref": 4, "actor": 4, "all": 8}
    out = phase_perf(shape, lengths, seconds, devices, peak=1e9, epochs=2)
    assert out["perf/tflops_per_device/gen"] == pytest.approx(fwd / 2.0 / 4 / 1e12)
    assert out["perf/mfu/update_actor"] == pytest.approx(3 * 2 * fwd / 1.0 / 4 / 1e9)
    total = fwd * (1 + 1 + 1 + 6)
    assert out["perf/mfu"] == pytest.approx(total / 4.0 / 8 / 1e9)
    assert not any(k.endswith("/adv") for k in out)  # no model work in the driver's phases
    cpu = phase_perf(shape, lengths, seconds, devices, peak=None)
    assert "perf/mfu" not in cpu and "perf/tflops_per_device/ref" in cpu


def test_rows_sharing_a_prompt_are_credited_with_it_once():
    _, shape = tiny_model(False)
    prompts, groups = [5, 5, 5, 9, 4, 4], [0, 0, 0, 1, 2, 2]  # three rows of one prompt, one alone, two of another
    assert shared_prompt_savings(shape, prompts, groups) == pytest.approx(forward_flops(shape, [5, 5, 4]))
    assert shared_prompt_savings(shape, prompts, list(range(6))) == 0.0
    lengths = [p + 7 for p in prompts]
    saved = shared_prompt_savings(shape, prompts, groups)
    seconds, devices = {"ref": 0.5, "update_actor": 1.0, "step": 2.0}, {"ref": 1, "actor": 1, "all": 1}
    plain = phase_perf(shape, lengths, seconds, devices, peak=1e9)
    shared = phase_perf(shape, lengths, seconds, devices, peak=1e9, saved={"actor": saved})
    fwd = forward_flops(shape, lengths)
    assert shared["perf/mfu/update_actor"] == pytest.approx(3 * (fwd - saved) / 1e9)
    assert shared["perf/mfu/ref"] == plain["perf/mfu/ref"]  # the reference repeats its prompts here


def test_step_metrics_credit_a_sharing_role_with_each_distinct_prompt_once(tmp_path):
    """``step_perf_metrics`` finds the prompt groups in the batch itself: the sharing role's work shrinks by
    exactly ``shared_prompt_savings``, the other role's does not."""
    from types import SimpleNamespace

    from hybridrl.engines.batch import PROMPT_IDS, PROMPT_MASK, RESPONSE_IDS, RESPONSE_MASK, Batch
    from hybridrl.observe.flops import step_perf_metrics

    model, shape = tiny_model(False)
    model.config.save_pretrained(tmp_path)
    prompts = torch.tensor([[0, 5, 6], [0, 5, 6], [7, 8, 9], [0, 5, 6]])  # rows 0, 1 and 3 share a prompt
    prompt_mask = (prompts != 0).long()
    batch = Batch.from_tensors({PROMPT_IDS: prompts, PROMPT_MASK: prompt_mask,
                                RESPONSE_IDS: torch.ones(4, 4, dtype=torch.long),
                                RESPONSE_MASK: torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]])})
    plan = SimpleNamespace(role_pool={"actor": "p", "ref": "p"}, pools={"p": [0]},
                           cluster=SimpleNamespace(device="cpu"), group_of=lambda role: SimpleNamespace(world_size=1))
    metrics = {"timing/update_actor": 1.0, "timing/ref": 1.0, "timing/step": 2.0}
    out = step_perf_metrics(str(tmp_path), plan, "bfloat16", 1, batch, metrics, shared_prompt_roles={"actor"})
    lengths = [2 + 4, 2 + 2, 3 + 1, 2 + 3]
    assert out["perf/tflops_per_device/ref"] == pytest.approx(forward_flops(shape, lengths) / 1e12)
    saved = forward_flops(shape, [2, 2])  # the shared prompt's second and third copies
    expected = 3 * (forward_flops(shape, lengths) - saved) / 1e12
    assert out["perf/tflops_per_device/update_actor"] == pytest.approx(expected)
