"""A test plugin for the out-of-memory answer: the transformers rollout, except that its second ``wake`` raises the
error a GPU engine's wake raises (``torch.OutOfMemoryError``; the CPU test), and the FSDP engine, except that its
second ``update`` really exhausts the GPU (the GPU test). The rollout writes its worker's pid to
``$HYBRIDRL_TEST_PID_FILE`` so that the test can check no process is left behind."""

from __future__ import annotations

import os

import torch

from hybridrl import hookimpl
from hybridrl.rollout.hf import HFRollout


class OOMOnSecondWake(HFRollout):
    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.wakes = 0
        pid_file = os.environ.get("HYBRIDRL_TEST_PID_FILE")
        if pid_file:
            with open(pid_file, "a") as f:
                f.write(f"{os.getpid()}\n")

    def wake(self) -> None:
        self.wakes += 1
        if self.wakes == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total "
                                         "capacity of 79.10 GiB of which 3.12 GiB is free (raised by the test engine)")
        super().wake()


class OOMOnSecondUpdate:
    """The FSDP engine, except that its second ``update`` asks the CUDA allocator for twice the device (a real
    out-of-memory error of the allocator, for the GPU test)."""

    def __new__(cls, ctx):
        from hybridrl_fsdp.engine import FSDPEngine

        class _Engine(FSDPEngine):
            updates = 0

            def update(self, batch, objective):
                type(self).updates += 1
                if type(self).updates == 2:
                    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
                    torch.empty(2 * total, dtype=torch.uint8, device="cuda")
                return super().update(batch, objective)

        return _Engine(ctx)


@hookimpl
def hybridrl_register_backends(registry):
    # the wrapped engines' memory models and out-of-memory keys: the plan and the answer are theirs
    registry.add_rollout("oom_hf", OOMOnSecondWake, process_family="any", supports={"sleep"},
                         memory_model="hybridrl.rollout.memory:HF_MEMORY")
    registry.add_train_engine("oom_fsdp", OOMOnSecondUpdate, process_family="torch-dist", supports={"checkpoint"},
                              memory_model="hybridrl_fsdp.memory:FSDP_MEMORY",
                              oom_fixes="hybridrl_fsdp.memory:oom_fixes")
