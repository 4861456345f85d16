"""What a run folder holds, to compare before and after an operation that must not touch it."""

from __future__ import annotations

import hashlib
from pathlib import Path


def folder_state(root: Path) -> dict[str, tuple[int, str]]:
    """Every file under ``root``: relative path -> (size, sha256). Folders appear through their files."""
    state = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            state[path.relative_to(root).as_posix()] = (path.stat().st_size, digest)
    return state
