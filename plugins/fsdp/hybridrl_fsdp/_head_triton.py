"""The Triton kernels of ``head_kernels`` (imported only where they run: Triton at module level, as its
interpreter expects). See ``head_kernels`` for what they compute and why."""

import triton
import triton.language as tl


@triton.jit
def softmax_stats(logits, row_stride, labels, lse_out, logp_out, entropy_out, inv_temp, N_COLS: tl.constexpr,
                  WANT_ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * row_stride
    lanes = tl.arange(0, BLOCK)
    run_max = tl.full([BLOCK], float("-inf"), tl.float32)
    run_sum = tl.zeros([BLOCK], dtype=tl.float32)  # sum of exp(z - run_max), per lane
    run_dot = tl.zeros([BLOCK], dtype=tl.float32)  # sum of exp(z - run_max) * z, per lane
    for start in range(0, N_COLS, BLOCK):
        cols = start + lanes
        valid = cols < N_COLS
        z = tl.load(base + cols, mask=valid, other=float("-inf")).to(tl.float32) * inv_temp
        new_max = tl.maximum(run_max, z)
        seen = new_max > float("-inf")
        rescale = tl.where(seen, tl.exp(run_max - new_max), 0.0)
        e = tl.where(valid, tl.exp(z - new_max), 0.0)
        run_sum = run_sum * rescale + e
        if WANT_ENTROPY:
            run_dot = run_dot * rescale + tl.where(valid, e * z, 0.0)
        run_max = new_max
    row_max = tl.max(run_max, axis=0)
    weight = tl.where(run_max > float("-inf"), tl.exp(run_max - row_max), 0.0)
    total = tl.sum(run_sum * weight, axis=0)
    lse = row_max + tl.log(total)
    label = tl.load(labels + row)
    picked = tl.load(base + label).to(tl.float32) * inv_temp
    tl.store(lse_out + row, lse)
    tl.store(logp_out + row, picked - lse)
    if WANT_ENTROPY:
        tl.store(entropy_out + row, lse - tl.sum(run_dot * weight, axis=0) / total)


@triton.jit
def softmax_grad(logits, row_stride, labels, lse_in, entropy_in, grad_lp_in, grad_ent_in, inv_temp,
                 N_COLS: tl.constexpr, HAS_GRAD_LOG_PROBS: tl.constexpr, HAS_GRAD_ENTROPY: tl.constexpr,
                 BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * row_stride
    lanes = tl.arange(0, BLOCK)
    lse = tl.load(lse_in + row)
    label = tl.load(labels + row)
    # Absent inputs point at ``lse`` (same length): loaded, never used.
    g_lp = tl.load(grad_lp_in + row)
    g_ent = tl.load(grad_ent_in + row)
    entropy = tl.load(entropy_in + row)
    for start in range(0, N_COLS, BLOCK):
        cols = start + lanes
        valid = cols < N_COLS
        log_p = tl.load(base + cols, mask=valid, other=0.0).to(tl.float32) * inv_temp - lse
        p = tl.exp(log_p)
        grad = tl.zeros([BLOCK], dtype=tl.float32)
        if HAS_GRAD_LOG_PROBS:  # d logp_y / dz_j = [j == y] - p_j
            grad = tl.where(cols == label, g_lp, 0.0) - p * g_lp
        if HAS_GRAD_ENTROPY:  # dH / dz_j = -p_j (log p_j + H)
            grad = grad - p * (log_p + entropy) * g_ent
        tl.store(base + cols, (grad * inv_temp).to(logits.dtype.element_ty), mask=valid)
