"""The Linux namespaces a call runs in, through bubblewrap (``bwrap``).

The child sees a root of its own: ``/usr`` and the interpreter's folders read-only, a generated two-line
``/etc/passwd`` and ``/etc/group``, a fresh ``/proc`` and a minimal ``/dev``, and one writable folder,
``/sandbox``, a tmpfs of ``disk_mb`` (its working directory); nothing else of the host (no ``/etc``, ``/root``,
``/home``, ``/tmp``, ``/work``, no run folder). It runs as uid/gid 65534 inside a user namespace with every
capability dropped and no further user namespaces, in new pid, network (a loopback only), ipc, uts and cgroup
namespaces, in a new session. The pid namespace dies with its first process, so nothing it starts (``setsid``,
daemons) outlives the call; ``--die-with-parent`` ends it with the thread that started it.

Processes: ``RLIMIT_NPROC`` counts per user inside the namespace, but the kernel never applies it to the host's
root (bwrap started by root maps the sandbox's user onto root). Root therefore gives each call a pids cgroup with
``pids.max`` where one is writable (``PidsCgroup``), else starts bwrap as uid 65534 where that works (the
interpreter readable by it); ``BwrapBackend.processes_limited`` says whether one of the three applies.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

log = logging.getLogger(__name__)

UID = GID = 65534
WORKDIR = "/sandbox"
PASSWD = b"sandbox:x:65534:65534:sandbox:/sandbox:/usr/sbin/nologin\n"
GROUP = b"sandbox:x:65534:\n"
DEFAULT_BWRAP = "bwrap"
_SYSTEM_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_counter = itertools.count()


def interpreter_roots() -> list[str]:
    """The folders the interpreter needs (its prefix, a virtual environment's, and the real binary's), outside
    ``/usr`` (bound whole), without repeats or nesting."""
    exe = Path(os.path.realpath(sys.executable))
    candidates = {os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix, sys.prefix, sys.exec_prefix)}
    candidates.add(str(exe.parent.parent))
    roots: list[str] = []
    for path in sorted(candidates, key=len):
        if path in ("/", "") or path == "/usr" or path.startswith("/usr/"):
            continue
        if not any(path == r or path.startswith(r + "/") for r in roots):
            roots.append(path)
    return roots


def system_args() -> list[str]:
    """``/usr`` read-only and ``/bin``, ``/lib`` ... as the host has them (merged-usr symlinks or folders)."""
    args = ["--ro-bind", "/usr", "/usr"]
    for path in _SYSTEM_DIRS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    if os.path.exists("/etc/ld.so.cache"):  # where the dynamic loader finds shared libraries
        args += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    return args


@lru_cache(maxsize=8)
def bwrap_options(bwrap: str) -> frozenset[str]:
    """The options this bwrap knows (``--disable-userns`` came with 0.8, ``--size`` with 0.7): older ones still
    sandbox, without those two layers."""
    import subprocess

    try:
        text = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return frozenset()
    return frozenset(word for word in text.split() if word.startswith("--"))


def bwrap_args(bwrap: str, disk_mb: int, passwd_fd: int, group_fd: int, network: bool) -> list[str]:
    """The ``bwrap`` command line up to the program to run (see the module docstring)."""
    known = bwrap_options(bwrap)
    args = [bwrap, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            "--uid", str(UID), "--gid", str(GID), "--hostname", "sandbox", "--clearenv"]
    if "--disable-userns" in known:
        args.append("--disable-userns")
    if network:
        args.append("--share-net")
    args += system_args()
    for root in interpreter_roots():
        args += ["--ro-bind", root, root]
    args += ["--ro-bind-data", str(passwd_fd), "/etc/passwd", "--ro-bind-data", str(group_fd), "/etc/group",
             "--proc", "/proc", "--dev", "/dev"]
    if "--size" in known:
        args += ["--size", str(disk_mb * 2**20)]
    args += ["--tmpfs", WORKDIR, "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", WORKDIR, "--"]
    return args


def data_fd(data: bytes) -> int:
    """A pipe's read end holding ``data`` (bwrap copies it into the sandbox; small enough not to block)."""
    read, write = os.pipe()
    try:
        os.write(write, data)
    finally:
        os.close(write)
    return read


def resolve_bwrap(path: str | None) -> str | None:
    """The bwrap binary: ``path`` as given (a name is looked up on PATH), or None when there is none."""
    name = path or DEFAULT_BWRAP
    found = shutil.which(name) if os.sep not in name else (name if os.access(name, os.X_OK) else None)
    return found


# --- processes: a pids cgroup where the host's root starts bwrap ---------------------------------------------
@lru_cache(maxsize=1)
def pids_cgroup_parent() -> str | None:
    """A writable folder of the pids controller (v1 ``pids`` hierarchy, or v2 with ``pids`` enabled) at this
    process's own cgroup, or None."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
        groups = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    own: dict[str, str] = {}
    for line in groups:
        _, controllers, path = line.split(":", 2)
        for c in (controllers.split(",") if controllers else [""]):
            own[c] = path
    for line in mounts:
        parts = line.split()
        if len(parts) < 4:
            continue
        mountpoint, fstype, options = parts[1], parts[2], parts[3].split(",")
        if fstype == "cgroup" and "pids" in options and "pids" in own:
            parent = os.path.join(mountpoint, own["pids"].lstrip("/"))
        elif fstype == "cgroup2" and "" in own:
            parent = os.path.join(mountpoint, own[""].lstrip("/"))
            try:
                if "pids" not in Path(parent, "cgroup.subtree_control").read_text().split():
                    continue
            except OSError:
                continue
        else:
            continue
        if os.access(parent, os.W_OK) and _cgroup_works(parent):
            return parent
    return None


def _cgroup_works(parent: str) -> bool:
    path = os.path.join(parent, f"hybridrl-sandbox-probe-{os.getpid()}")
    try:
        os.mkdir(path)
        Path(path, "pids.max").write_text("8")
        return True
    except OSError:
        return False
    finally:
        try:
            os.rmdir(path)
        except OSError:
            pass


class PidsCgroup:
    """One call's pids cgroup: ``wrap(argv)`` starts ``argv`` inside it (a shell writes its own pid into
    ``cgroup.procs`` and then execs, so every descendant is counted from the first), ``remove()`` deletes it."""

    def __init__(self, parent: str, max_pids: int) -> None:
        self.path = os.path.join(parent, f"hybridrl-sandbox-{os.getpid()}-{threading.get_ident()}-{next(_counter)}")
        os.mkdir(self.path)
        Path(self.path, "pids.max").write_text(str(max_pids))

    def wrap(self, argv: list[str]) -> list[str]:
        shell = shutil.which("sh") or "/bin/sh"
        return [shell, "-c", 'echo $$ > "$0" && exec "$@"', os.path.join(self.path, "cgroup.procs"), *argv]

    def remove(self) -> None:
        """Delete the cgroup (the call's processes are gone once its pid namespace is; a few retries for the
        kernel to finish reaping)."""
        for _ in range(50):
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.02)
        log.warning("sandbox: could not remove the pids cgroup %s (still busy)", self.path)


@dataclass(frozen=True)
class Probe:
    """What a trial run found: ``problem`` None when bwrap works here."""

    problem: str | None
    processes_limited: bool = False
