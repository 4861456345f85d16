"""FLOPs of a decoder-only transformer (dense, or mixture-of-experts counted by its active parameters), device
peak FLOP/s, and the MFU of each phase of a step.

Convention (PaLM appendix B, the one verl's counter uses, so numbers compare): a forward pass over a
sequence of L tokens costs ``2 * N * L`` for the weight matmuls (N: parameters inside matmuls, the LM head
included, the embedding lookup not) plus ``4 * layers * q_dim * L**2`` for attention scores and their
weighted sum (counted without the causal halving); training costs three forwards (backward = 2x forward).
A role whose engine computes each distinct prompt once (a GRPO group's samples repeat it; its backend says so
through ``BackendSpec.shares_prompts``: ``shared_prompt_roles``) is credited with that prompt once: ``k - 1``
forwards of the prompt alone come off a group of ``k`` rows (``shared_prompt_savings``).
Generation is counted as one forward over prompt + response, which is what decoding with a KV cache
computes. Only real tokens count (padding is waste, not work), and time is the phase's wall time, so MFU
includes every overhead of the phase.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Iterable, Mapping, Sequence
from functools import lru_cache
from typing import Any

from hybridrl.placement.memory import ModelShape

log = logging.getLogger(__name__)

#: dense bf16/fp16 tensor-core peak FLOP/s by GPU name (first match wins: the specific names first).
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("GH200", 989e12), ("H200", 989e12), ("H100", 989e12),
    ("H800", 989e12), ("H20", 148e12), ("B200", 2250e12), ("A100", 312e12), ("A800", 312e12),
    ("L40S", 362e12), ("L4", 121e12),
)
#: overrides the table (TFLOP/s per device), for GPUs it does not know.
PEAK_ENV = "HYBRIDRL_PEAK_TFLOPS"

#: phase -> (role whose devices do it, passes: 1 forward, 3 training).
PHASE_WORK = {"gen": ("rollout", 1), "ref": ("ref", 1), "old_log_prob": ("actor", 1), "values": ("critic", 1),
              "update_actor": ("actor", 3), "update_critic": ("critic", 3)}


def matmul_params(shape: ModelShape, lm_head: bool = True) -> int:
    """Weights that take part in a matmul per token: the decoder layers' projections and the LM head. A
    mixture-of-experts layer counts the router and the ``experts_per_token`` experts a token runs through (its
    active parameters), not every expert: MFU is the work done, which the idle experts are not."""
    h, q, kv, i = shape.hidden_size, shape.q_dim, shape.kv_dim, shape.token_intermediate
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + shape.num_experts * h
    return shape.num_layers * per_layer + (shape.vocab_size * h if lm_head else 0)


def forward_flops(shape: ModelShape, seq_lens: Iterable[int], lm_head: bool = True) -> float:
    """FLOPs of one forward pass over sequences of the given lengths."""
    n = matmul_params(shape, lm_head)
    attn = 4 * shape.num_layers * shape.q_dim
    return float(sum(2 * n * L + attn * L * L for L in seq_lens))


def shared_prompt_savings(shape: ModelShape, prompt_lens: Sequence[int], groups: Sequence[int],
                          lm_head: bool = True) -> float:
    """Forward FLOPs that rows sharing a prompt (``groups``: each row's prompt group) do not spend when the
    prompt is computed once: for each group of ``k`` rows, ``k - 1`` forwards of its prompt alone."""
    seen: set[int] = set()
    repeats = []
    for length, group in zip(prompt_lens, groups):
        if group in seen:
            repeats.append(int(length))
        seen.add(group)
    return forward_flops(shape, repeats, lm_head)


def batch_prompt_savings(shape: ModelShape, batch: Any, lm_head: bool = True) -> float:
    """``shared_prompt_savings`` of a ``Batch``: its rows grouped by their prompts' real tokens."""
    from hybridrl.engines.batch import PROMPT_IDS, PROMPT_MASK, distinct_prompts

    groups = distinct_prompts(batch[PROMPT_IDS], batch[PROMPT_MASK])[0].tolist()
    return shared_prompt_savings(shape, batch[PROMPT_MASK].sum(-1).tolist(), groups, lm_head)


def shared_prompt_roles(cfg: Any, plan: Any, registry: Any) -> set[str]:
    """The placed roles whose backend computes each distinct prompt of a group once with the role's (resolved)
    options (``BackendSpec.shares_prompts``)."""
    from hybridrl.plugins.registry import RegistryError
    from hybridrl.roles import role_spec

    out = set()
    for role in plan.role_pool:
        try:
            hook = registry.backend(role_spec(role).kind, plan.group_of(role).roles[role]).hook("shares_prompts")
        except RegistryError:
            continue
        options = dict(getattr(getattr(cfg.roles, role, None), "options", None) or {})
        if hook is not None and hook(role, options):
            out.add(role)
    return out


def train_flops(shape: ModelShape, seq_lens: Iterable[int], lm_head: bool = True) -> float:
    """Forward + backward (the backward costs two forwards)."""
    return 3.0 * forward_flops(shape, seq_lens, lm_head)


def peak_flops(device_name: str | None, dtype: str = "bfloat16") -> float | None:
    """Dense peak FLOP/s of one device for ``dtype``; None when unknown (CPU, an unknown GPU, fp32 math)."""
    if os.environ.get(PEAK_ENV):
        return float(os.environ[PEAK_ENV]) * 1e12
    if not device_name or dtype not in ("bfloat16", "float16"):
        return None
    name = device_name.upper()
    for pattern, flops in PEAK_BF16_FLOPS:
        if pattern.upper() in name:
            return flops
    return None


@lru_cache(maxsize=4)
def detect_device_name(device: str) -> str | None:
    """The GPU model the run uses: this process's GPU, else the accelerator type Ray reports."""
    if device != "cuda":
        return None
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - a broken CUDA install: fall through to Ray
        pass
    try:
        import ray

        if ray.is_initialized():
            for key in ray.cluster_resources():
                if key.startswith("accelerator_type:"):
                    return key.split(":", 1)[1]
    except Exception:  # noqa: BLE001
        pass
    return None


@lru_cache(maxsize=4)
def _shape_of(model_path: str) -> ModelShape:
    from hybridrl.placement.memory import read_hf_config, shape_from_hf_config

    return shape_from_hf_config(read_hf_config(model_path))


def phase_perf(shape: ModelShape, seq_lens: list[int], seconds: dict[str, float], devices: dict[str, int],
               peak: float | None, epochs: int = 1, saved: Mapping[str, float] | None = None) -> dict[str, float]:
    """``perf/tflops_per_device/<phase>`` for every timed phase of ``PHASE_WORK``, ``perf/mfu/<phase>`` and the
    step's ``perf/mfu`` (all devices of the run over the whole step) when the device peak is known. ``saved``:
    per role, the forward FLOPs its engine skips (``shared_prompt_savings``)."""
    saved = saved or {}
    out: dict[str, float] = {}
    total = 0.0
    for phase, (role, passes) in PHASE_WORK.items():
        if phase not in seconds or role not in devices or seconds[phase] <= 0:
            continue
        flops = (forward_flops(shape, seq_lens, lm_head=role != "critic") - saved.get(role, 0.0)) * passes
        if phase.startswith("update_"):
            flops *= epochs
        total += flops
        per_device = flops / seconds[phase] / devices[role]
        out[f"perf/tflops_per_device/{phase}"] = per_device / 1e12
        if peak:
            out[f"perf/mfu/{phase}"] = per_device / peak
    if peak and seconds.get("step", 0) > 0 and devices.get("all"):
        out["perf/mfu"] = total / seconds["step"] / devices["all"] / peak
    return out


def step_perf_metrics(model_path: str, plan: Any, dtype: str, epochs: int, batch: Any,
                      metrics: dict[str, float], shared_prompt_roles: Collection[str] = ()) -> dict[str, float]:
    """MFU and achieved TFLOP/s per phase for one step, from the model at ``model_path``, the placement
    ``plan`` (devices per role), the step's token counts and its ``timing/*`` metrics (called at the end of
    ``Trainer.train_step``; never fails the step). ``shared_prompt_roles``: roles whose engine computes each
    distinct prompt once."""
    from hybridrl.engines.batch import PROMPT_MASK, response_attention_mask

    try:
        shape = _shape_of(model_path)
        lengths = (batch[PROMPT_MASK].sum(-1) + response_attention_mask(batch).sum(-1)).tolist()
        devices = {role: plan.group_of(role).world_size for role in plan.role_pool}
        devices["all"] = len({d for ds in plan.pools.values() for d in ds})  # shared devices counted once
        seconds = {k.removeprefix("timing/"): v for k, v in metrics.items() if k.startswith("timing/")}
        peak = peak_flops(detect_device_name(plan.cluster.device), dtype)
        saved = {role: batch_prompt_savings(shape, batch, lm_head=role != "critic") for role in shared_prompt_roles}
        return phase_perf(shape, [int(n) for n in lengths], seconds, devices, peak, epochs, saved)
    except Exception as exc:  # noqa: BLE001 - a metric must never stop training
        if not _warned:
            _warned.append(True)
            log.warning("no FLOP metrics (%s: %s)", type(exc).__name__, exc)
        return {}


_warned: list[bool] = []
