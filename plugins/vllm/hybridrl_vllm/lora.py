"""LoRA adapters served by the vLLM engine (``roles.actor.lora`` with ``sync: adapter``; ``hybridrl.lora``).

The engine starts with LoRA enabled for one adapter of the run's rank (``engine_kwargs``) and keeps the base
weights it loaded from ``model.path`` for the whole run. Each weight sync brings the adapters alone (megabytes):
they are staged as they arrive, written as a peft adapter folder (safetensors and ``adapter_config.json``, in
``/dev/shm`` where it exists, rewritten at every sync) and handed to vLLM as one ``LoRARequest`` with
``load_inplace``: the same adapter id is replaced in place, and every generation asks for it. vLLM's public
path loads adapters from a folder; its in-memory loaders are internal and differ between versions.

Because no sync brings the base weights back, the engine must not discard them while it sleeps:
``sleep_level: auto`` becomes ``kv_cache`` (the weights stay on the device, the KV cache is released), level
1 (weights to host memory and back) is kept if asked for, and level 2 (discard) is refused.
"""

from __future__ import annotations

import shutil
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

import torch

from hybridrl.engines import WeightBucket
from hybridrl.lora import LoraSpec, is_adapter_name, pair_adapters, target_names, write_adapter
from hybridrl_vllm.sleep import KV_ONLY

#: the values vLLM accepts for ``max_lora_rank`` (0.26.0 and 0.32.0 alike).
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: the id and name of the run's one adapter (vLLM ids start at 1).
ADAPTER_ID, ADAPTER_NAME = 1, "hybridrl-policy"


def max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts that holds ``rank``; ``ValueError`` past its largest."""
    for allowed in MAX_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"roles.actor.lora.rank={rank} is above vLLM's largest LoRA rank ({MAX_LORA_RANKS[-1]}); "
                     "use sync=merged")


def engine_kwargs(spec: LoraSpec) -> dict[str, Any]:
    """``vllm.LLM`` arguments for serving the run's one adapter (``roles.rollout.options.engine_kwargs`` win)."""
    return {"enable_lora": True, "max_lora_rank": max_lora_rank(spec.rank), "max_loras": 1, "max_cpu_loras": 1}


def sleep_level(level: int | str) -> int | str:
    """The sleep level of an engine that is sent adapters alone: its base weights must survive every sleep."""
    if level == "auto":
        return KV_ONLY
    if str(level) == "2":
        raise ValueError("roles.rollout.options.sleep_level=2 discards the engine's weights, but with "
                         "roles.actor.lora.sync=adapter no sync sends the base back: use kv_cache, 1 or auto")
    return level


def _loads_in_place() -> bool:
    """Whether this vLLM's ``LoRARequest`` can replace an adapter under the same id (``load_inplace``)."""
    import inspect

    from vllm.lora.request import LoRARequest

    return "load_inplace" in inspect.signature(LoRARequest).parameters


def adapter_folder() -> Path:
    """A private folder for the adapter files: in shared memory where there is some (no disk write per sync)."""
    shm = Path("/dev/shm")
    return Path(tempfile.mkdtemp(prefix="hybridrl-lora-", dir=str(shm) if shm.is_dir() else None))


class AdapterSync:
    """One sync's adapters on their way into vLLM: staged per bucket, written, then loaded in place."""

    def __init__(self, spec: LoraSpec, base_model: str) -> None:
        self.spec = spec
        self.base_model = base_model
        self.folder = adapter_folder()
        # removed when the engine goes or the process exits (a process killed outright leaves it behind)
        self._remove = weakref.finalize(self, shutil.rmtree, str(self.folder), True)
        self.staged: dict[str, torch.Tensor] = {}
        self.loads = 0  # syncs loaded so far
        self.loading = False
        self.timing: dict[str, float] = {}

    def stage(self, bucket: WeightBucket) -> None:
        """Copy the bucket's adapter matrices to host memory (the bucket may be a buffer reused next)."""
        for name, tensor in bucket:
            if not is_adapter_name(name):
                raise ValueError(f"the vLLM rollout is sent LoRA adapters alone (sync=adapter), got '{name}'")
            self.staged[name] = tensor.detach().to("cpu", copy=True)

    def write(self) -> Path:
        """The staged adapters as a peft folder (every matrix paired, checked); clears the stage."""
        start = time.perf_counter()
        modules = pair_adapters(self.staged.items())
        write_adapter(self.folder, self.staged, self.spec.peft_config(self.base_model, target_names(modules)))
        self.staged = {}
        self.timing = {"adapter_write_s": time.perf_counter() - start}
        return self.folder

    def request(self, replace: bool = False) -> Any:
        """The run's ``LoRARequest``: ``replace`` for the sync that reloads the adapter in place; without it for
        the generations (vLLM applies a request's adapter at every scheduler step, and one asking to be loaded
        in place would be read from its folder again each time). A vLLM without in-place reloads gets a new
        adapter id per sync instead (the previous one removed)."""
        from vllm.lora.request import LoRARequest

        if _loads_in_place():
            return LoRARequest(ADAPTER_NAME, ADAPTER_ID, str(self.folder), load_inplace=replace)
        return LoRARequest(f"{ADAPTER_NAME}-{self.version}", ADAPTER_ID + self.version, str(self.folder))

    @property
    def version(self) -> int:
        """The adapter id's offset without in-place reloads: one per sync (the first sync's is 0)."""
        return max(0, self.loads - (0 if self.loading else 1))

    def load(self, llm: Any) -> None:
        """Write the staged adapters and load them into the engine now (not at the next generation)."""
        self.write()
        start = time.perf_counter()
        self.loading = True
        try:
            if not llm.llm_engine.add_lora(self.request(replace=True)):
                raise RuntimeError(f"vLLM did not load the LoRA adapter from {self.folder}")
        finally:
            self.loading = False
        if not _loads_in_place() and self.loads > 0:
            llm.llm_engine.remove_lora(ADAPTER_ID + self.loads - 1)
        self.loads += 1
        self.timing["adapter_load_s"] = time.perf_counter() - start

    def close(self) -> None:
        self._remove()
