"""A full disk and a read-only folder, for real (a small tmpfs; a read-only bind mount). Both need root;
elsewhere the tests that use them skip."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def _mount(*args: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs or a read-only folder needs root")
    done = subprocess.run(["mount", *args], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount here: {done.stderr.strip()}")


@contextmanager
def small_disk(folder: Path, megabytes: int) -> Iterator[Path]:
    """``folder`` as a tmpfs of ``megabytes``: writes past its size fail with ENOSPC."""
    folder.mkdir(parents=True, exist_ok=True)
    _mount("-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(folder))
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


@contextmanager
def read_only(folder: Path) -> Iterator[Path]:
    """``folder`` bind-mounted read-only onto itself (root ignores permission bits, not a read-only mount)."""
    _mount("--bind", "-o", "ro", str(folder), str(folder))
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


def fill(folder: Path) -> None:
    """Write zeros into ``folder`` until its filesystem is full."""
    with open(folder / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError:
            pass
