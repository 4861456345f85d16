"""The SGLang engine's memory model (``hybridrl.rollout.memory.PreallocatingRollout``): what it profiles at
start, the CUDA contexts of its own processes, and its KV sizing policy. Engine-free: the planner imports it
without SGLang."""

from __future__ import annotations

from hybridrl.rollout.memory import PreallocatingRollout, preallocating_oom_fixes

GIB = float(2**30)
#: (tokens per step, sequences at once) SGLang profiles at start: on devices of at least 70 GiB, then smaller.
BATCH_DEFAULTS = ((8192, 1024), (8192, 256))
#: the engine's scheduler and model processes have CUDA contexts of their own.
EXTRA_CONTEXT_BYTES = 1.0 * GIB

#: a numeric ``gpu_memory_utilization`` is ``mem_fraction_static``: a share of the memory free at its start.
SGLANG_MEMORY = PreallocatingRollout(BATCH_DEFAULTS, EXTRA_CONTEXT_BYTES, share_of_free=True)
oom_fixes = preallocating_oom_fixes
