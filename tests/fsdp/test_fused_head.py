"""The fused LM head (``linear_log_probs``, ``LogProbHead``) against ``log_softmax`` of the full logits: values and
gradients in fp32 to 1e-5, with chunks that split the tokens unevenly, with and without temperature, entropy and
bias; the Triton kernels under Triton's interpreter; and the head inside a tiny Qwen2 (tied and untied)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridrl_fsdp import head_kernels
from hybridrl_fsdp.fused_head import KeptLogits, LogProbHead, install_log_prob_head, linear_log_probs

ATOL = 1e-5


def reference(hidden, weight, bias, labels, temperature):
    logits = hidden @ weight.t() + (bias if bias is not None else 0.0)
    log_p = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return log_p.gather(-1, labels[..., None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


def leaves(n: int, hidden: int, vocab: int, with_bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, hidden, generator=gen)).requires_grad_(True)
    w = (torch.randn(vocab, hidden, generator=gen) * 0.5).requires_grad_(True)
    b = (torch.randn(vocab, generator=gen)).requires_grad_(True) if with_bias else None
    labels = torch.randint(0, vocab, (n,), generator=gen)
    weights = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    return h, w, b, labels, weights


def head_node(log_probs: torch.Tensor):
    """The fused head's autograd node behind ``log_probs`` (under the view that gives them their shape)."""
    node = log_probs.grad_fn
    while not hasattr(node, "kept"):
        node = node.next_functions[0][0]
    return node


def check_against_log_softmax(temperature, with_entropy, with_bias, triton, chunk_rows, n=23, hidden=16, vocab=37,
                              keep_logits=False):
    h, w, b, labels, (w_lp, w_ent) = leaves(n, hidden, vocab, with_bias)
    lp, ent = linear_log_probs(h, w, b, labels, temperature, with_entropy, triton=triton, chunk_rows=chunk_rows,
                               kept_logits=KeptLogits() if keep_logits else None)
    node = head_node(lp)
    kept = node.kept
    assert (kept is not None) == keep_logits and (kept is None or tuple(kept.shape) == (n, vocab))
    loss = (lp * w_lp).sum() + ((ent * w_ent).sum() if with_entropy else 0.0)
    params = [h, w] + ([b] if b is not None else [])
    grads = torch.autograd.grad(loss, params)
    assert node.kept is None  # the backward consumed what the forward kept

    ref_lp, ref_ent = reference(h, w, b, labels, temperature)
    ref_loss = (ref_lp * w_lp).sum() + ((ref_ent * w_ent).sum() if with_entropy else 0.0)
    ref_grads = torch.autograd.grad(ref_loss, params)
    assert lp.dtype == torch.float32 and lp.shape == labels.shape
    torch.testing.assert_close(lp, ref_lp, atol=ATOL, rtol=0)
    if with_entropy:
        torch.testing.assert_close(ent, ref_ent, atol=ATOL, rtol=0)
    else:
        assert ent is None
    for name, got, want in zip(["hidden", "weight", "bias"], grads, ref_grads):
        assert float(want.abs().max()) > 1e-3, f"{name}: a gradient this small would pass anything"
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=name)


@pytest.mark.parametrize("temperature,with_entropy,with_bias", [(None, True, False), (0.7, True, True),
                                                                  (1.3, False, False), (None, False, True)])
@pytest.mark.parametrize("chunk_rows", [5, 1000])  # 23 tokens: 5 uneven chunks, or one
@pytest.mark.parametrize("keep_logits", [False, True])  # recomputed in the backward, or kept from the forward
def test_eager_head_matches_log_softmax_values_and_gradients(temperature, with_entropy, with_bias, chunk_rows,
                                                             keep_logits):
    check_against_log_softmax(temperature, with_entropy, with_bias, triton=False, chunk_rows=chunk_rows,
                              keep_logits=keep_logits)


def test_micro_batches_keep_their_logits_in_one_buffer():
    """Forward/backward pairs reuse one buffer (no fresh multi-GiB block per micro-batch); a second forward before
    the first one's backward gets logits of its own, so both gradients stay right; ``release`` frees it."""
    buffer = KeptLogits(rows=30)
    h, w, _, labels, (w_lp, _) = leaves(23, 16, 37, with_bias=False)
    ref_lp, _ = reference(h, w, None, labels, None)
    (ref_g,) = torch.autograd.grad((ref_lp * w_lp).sum(), [w])
    pointers = []
    for _ in range(2):
        lp, _ = linear_log_probs(h, w, None, labels, None, False, triton=False, kept_logits=buffer)
        pointers.append(head_node(lp).kept.data_ptr())
        (g,) = torch.autograd.grad((lp * w_lp).sum(), [w])
        torch.testing.assert_close(g, ref_g, atol=ATOL, rtol=0)
    assert pointers[0] == pointers[1] and buffer.bytes == 30 * 37 * 4  # sized for the budget's rows
    first, _ = linear_log_probs(h, w, None, labels, None, False, triton=False, kept_logits=buffer)
    second, _ = linear_log_probs(h, w, None, labels, None, False, triton=False, kept_logits=buffer)
    assert head_node(first).kept.data_ptr() != head_node(second).kept.data_ptr()
    for lp in (second, first):
        (g,) = torch.autograd.grad((lp * w_lp).sum(), [w])
        torch.testing.assert_close(g, ref_g, atol=ATOL, rtol=0)
    buffer.release()
    assert buffer.bytes == 0


def test_kept_logits_only_where_a_backward_follows():
    """Under no_grad, or with nothing to differentiate, ``kept_logits`` keeps nothing (a reference's forward)."""
    h, w, _, labels, _ = leaves(7, 8, 11, with_bias=False)
    with torch.no_grad():
        lp, _ = linear_log_probs(h, w, None, labels, None, True, triton=False, kept_logits=KeptLogits())
    assert lp.grad_fn is None
    frozen_lp, _ = linear_log_probs(h.detach(), w.detach(), None, labels, None, True, triton=False,
                                    kept_logits=KeptLogits())
    assert frozen_lp.grad_fn is None
    torch.testing.assert_close(lp, frozen_lp, atol=0, rtol=0)


INTERPRETER_CASES = [(None, True, False), (0.7, True, True), (1.3, False, False)]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (for its interpreter)")
def test_triton_kernels_match_log_softmax_under_the_interpreter():
    """The kernels' own code path (in-place gradient, online softmax over several column blocks: the block is
    cut to 16 columns so a 37-wide vocabulary takes three, the last one partial), run by Triton's interpreter on
    CPU. In a fresh process: the interpreter must be chosen before Triton is first imported."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok") == len(INTERPRETER_CASES)


def test_only_the_log_probs_in_the_loss_leaves_the_entropy_free():
    """The entropy as a metric (not in the loss) gets no gradient work and changes nothing."""
    h, w, _, labels, (w_lp, _) = leaves(9, 8, 11, with_bias=False)
    lp, ent = linear_log_probs(h, w, None, labels, None, True, triton=False, chunk_rows=4)
    (g,) = torch.autograd.grad((lp * w_lp).sum(), [w])
    ref_lp, _ = reference(h, w, None, labels, None)
    (ref_g,) = torch.autograd.grad((ref_lp * w_lp).sum(), [w])
    torch.testing.assert_close(g, ref_g, atol=ATOL, rtol=0)


def test_bf16_head_returns_fp32_values_and_bf16_gradients():
    h, w, _, labels, _ = leaves(6, 8, 11, with_bias=False)
    h, w = h.detach().bfloat16().requires_grad_(True), w.detach().bfloat16().requires_grad_(True)
    lp, ent = linear_log_probs(h, w, None, labels, None, True, triton=False, chunk_rows=4)
    (lp.sum() + ent.sum()).backward()
    assert lp.dtype == ent.dtype == torch.float32
    assert h.grad.dtype == w.grad.dtype == torch.bfloat16 and torch.isfinite(w.grad.float()).all()
    ref_lp, _ = reference(h.float(), w.float(), None, labels, None)
    torch.testing.assert_close(lp, ref_lp.detach(), atol=0.1, rtol=0)


@pytest.mark.parametrize("tie", [True, False])
def test_log_prob_head_inside_the_model_matches_full_logits(tmp_path: Path, tie: bool):
    """``install_log_prob_head`` keeps the parameters and their names; under ``computing`` the model's forward with
    ``logits_to_keep`` positions returns the log-probs and entropies of the full logits there, and the same
    gradients for every parameter (the tied embedding included)."""
    from _fsdp_helpers import save_tiny_qwen2
    from transformers import AutoModelForCausalLM

    path = save_tiny_qwen2(tmp_path / "m", tie=tie)
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    fused = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    names = [n for n, _ in fused.named_parameters()]
    head = install_log_prob_head(fused)
    assert isinstance(head, LogProbHead) and [n for n, _ in fused.named_parameters()] == names
    assert (fused.lm_head.weight is fused.model.embed_tokens.weight) == tie

    ids = torch.randint(1, 40, (2, 9), generator=torch.Generator().manual_seed(0))
    keep = torch.tensor([3, 4, 5, 6, 7])
    labels = ids[:, keep + 1]
    logits = plain(input_ids=ids).logits[:, keep]
    log_p = torch.log_softmax(logits / 0.8, -1)
    ref_lp = log_p.gather(-1, labels[..., None]).squeeze(-1)
    ref_ent = -(log_p.exp() * log_p).sum(-1)
    (ref_lp.sum() - 0.3 * ref_ent.sum()).backward()

    with head.computing(labels, 0.8, with_entropy=True):
        out = fused(input_ids=ids, logits_to_keep=keep).logits
    assert out.shape == (2, 5, 2)
    torch.testing.assert_close(out[..., 0], ref_lp.detach(), atol=ATOL, rtol=0)
    torch.testing.assert_close(out[..., 1], ref_ent.detach(), atol=ATOL, rtol=0)
    (out[..., 0].sum() - 0.3 * out[..., 1].sum()).backward()
    for (name, p), q in zip(fused.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=ATOL, rtol=0, msg=name)
    assert fused(input_ids=ids).logits.shape == (2, 9, 40), "outside computing() it is the plain head"


if __name__ == "__main__":  # the interpreter run of test_triton_kernels_match_log_softmax_under_the_interpreter
    head_kernels.BLOCK = 16
    for i, case in enumerate(INTERPRETER_CASES):
        check_against_log_softmax(*case, triton=True, chunk_rows=7, keep_logits=i % 2 == 1)
        print("ok", case)


@pytest.mark.parametrize("temperature,with_entropy,with_bias", INTERPRETER_CASES)
@pytest.mark.gpu
@pytest.mark.skipif(not head_kernels.available(), reason="needs a CUDA device and Triton")
def test_cuda_kernels_match_log_softmax_in_fp32(temperature, with_entropy, with_bias):
    """The compiled kernels (not the interpreter) in fp32 on CUDA, several column blocks and chunks."""
    torch.backends.cuda.matmul.allow_tf32 = False
    h, w, b, labels, (w_lp, w_ent) = leaves(300, 64, 9000, with_bias)
    h, w = h.detach().cuda().requires_grad_(True), w.detach().cuda().requires_grad_(True)
    b = b.detach().cuda().requires_grad_(True) if b is not None else None
    labels, w_lp, w_ent = labels.cuda(), w_lp.cuda(), w_ent.cuda()
    params = [h, w] + ([b] if b is not None else [])
    lp, ent = linear_log_probs(h, w, b, labels, temperature, with_entropy, triton=True, chunk_rows=128,
                               kept_logits=KeptLogits() if with_bias else None)  # one of the three keeps them
    grads = torch.autograd.grad((lp * w_lp).sum() + ((ent * w_ent).sum() if with_entropy else 0.0), params)
    ref_lp, ref_ent = reference(h, w, b, labels, temperature)
    ref_grads = torch.autograd.grad((ref_lp * w_lp).sum() + ((ref_ent * w_ent).sum() if with_entropy else 0.0),
                                    params)
    torch.testing.assert_close(lp, ref_lp, atol=1e-4, rtol=0)
    if with_entropy:
        torch.testing.assert_close(ent, ref_ent, atol=1e-4, rtol=0)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not head_kernels.available(), reason="needs a CUDA device and Triton")
def test_cuda_bf16_head_at_a_qwen_vocabulary_matches_fp32_reference():
    """bf16 hidden states and weight, a 151936-wide vocabulary: the kernels' fp32 statistics over bf16 logits
    against log_softmax of the same bf16 logits upcast; the gradients against the same reference."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(2048, 896, device="cuda", generator=gen) * 0.5).bfloat16().requires_grad_(True)
    w = (torch.randn(151936, 896, device="cuda", generator=gen) * 0.05).bfloat16().requires_grad_(True)
    labels = torch.randint(0, 151936, (2048,), device="cuda", generator=gen)
    lp, ent = linear_log_probs(h, w, None, labels, 0.9, True)
    (g_h, g_w) = torch.autograd.grad(lp.sum() + 0.1 * ent.sum(), [h, w])
    logits = (h @ w.t()).float() / 0.9
    log_p = torch.log_softmax(logits, -1)
    ref_lp, ref_ent = log_p.gather(-1, labels[:, None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)
    (r_h, r_w) = torch.autograd.grad(ref_lp.sum() + 0.1 * ref_ent.sum(), [h, w])
    torch.testing.assert_close(lp, ref_lp, atol=2e-3, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=2e-3, rtol=0)
    torch.testing.assert_close(g_h.float(), r_h.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(g_w.float(), r_w.float(), atol=2e-2, rtol=2e-2)
