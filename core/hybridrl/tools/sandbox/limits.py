"""``SandboxLimits``: what one call of model-written code may use, shared by every backend."""

from __future__ import annotations

from dataclasses import dataclass

from hybridrl.errors import HybridRLError


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 5.0  # wall clock of the call; the whole sandbox is killed when it runs out
    cpu_s: int = 5  # RLIMIT_CPU of each process
    memory_mb: int = 512  # RLIMIT_AS of each process (a Python interpreter alone needs ~30 MB)
    file_mb: int = 4  # RLIMIT_FSIZE: no file larger
    disk_mb: int = 32  # size of the writable folder (a tmpfs, under bwrap)
    open_files: int = 64  # RLIMIT_NOFILE
    processes: int = 16  # RLIMIT_NPROC inside the user namespace, and pids.max where a pids cgroup is writable
    max_output_chars: int = 2000  # what the model reads: the start and the end of the output
    output_limit_kb: int = 1024  # output read past this stops the call (never more is held in memory)

    def __post_init__(self) -> None:
        """Every limit must be a positive number (0 or less would switch the rlimit off, or time out at once);
        whole numbers where the kernel takes whole numbers."""
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            whole = name != "timeout_s"
            if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)) or value <= 0:
                kind = "a whole number" if whole else "a number"
                raise ValueError(f"{name} must be {kind} > 0, got {value!r}")


class SandboxUnavailable(HybridRLError, ValueError):
    """The configured isolation cannot work on this machine (a pre-flight error under the tool's key)."""
