"""The vLLM engine's memory model (``hybridrl.rollout.memory.PreallocatingRollout``): what it profiles at start,
what it adds to a device beyond the worker's CUDA context, and its KV sizing policy. Engine-free: the planner
imports it without vLLM."""

from __future__ import annotations

from hybridrl.rollout.memory import PreallocatingRollout, preallocating_oom_fixes

GIB = float(2**30)
#: (tokens per step, sequences at once) vLLM profiles at start: on devices of at least 70 GiB, then smaller.
BATCH_DEFAULTS = ((16384, 1024), (8192, 256))
#: the engine runs inside the worker's process: its handles and workspaces.
EXTRA_CONTEXT_BYTES = 0.5 * GIB
#: the LoRA ranks vLLM allocates adapter slots for (a rank rounds up to the next).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

#: a numeric ``gpu_memory_utilization`` is a share of the device's total memory.
VLLM_MEMORY = PreallocatingRollout(BATCH_DEFAULTS, EXTRA_CONTEXT_BYTES, share_of_free=False, lora_ranks=LORA_RANKS)
oom_fixes = preallocating_oom_fixes
