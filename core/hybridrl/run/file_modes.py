"""Who may read a run's files: its owner only. A run folder holds the config (reward service headers, even
redacted, name the services used), metrics, samples and checkpoints (the trained weights), so folders are made
0700 and files 0600, whatever the umask."""

from __future__ import annotations

import os
from pathlib import Path

DIR_MODE = 0o700
FILE_MODE = 0o600


def private_dir(path: str | Path) -> Path:
    """Create ``path`` (and its missing parents, which keep the umask's mode) and make it 0700."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, DIR_MODE)
    return path


def write_private(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` as a 0600 file (an existing file is made 0600 before it is rewritten)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    os.fchmod(fd, FILE_MODE)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def open_private(path: str | Path, mode: str = "a"):
    """``open(path, mode)`` for a text file that is created (or kept) 0600."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if mode == "a" else os.O_TRUNC)
    fd = os.open(path, flags, FILE_MODE)
    os.fchmod(fd, FILE_MODE)
    return os.fdopen(fd, mode)


def make_private_tree(root: str | Path) -> None:
    """Every folder under ``root`` (itself included) 0700 and every file 0600: what workers wrote under their
    own umask (checkpoint shards) before the folder is published."""
    root = Path(root)
    os.chmod(root, DIR_MODE)
    for folder, dirs, files in os.walk(root):
        for name in dirs:
            os.chmod(os.path.join(folder, name), DIR_MODE)
        for name in files:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                os.chmod(path, FILE_MODE)


def write_config(path: str | Path, config: dict) -> None:
    """A run config as ``config.json``: secrets redacted (``hybridrl.config.secrets``), 0600."""
    import json

    from hybridrl.config.secrets import redacted

    write_private(path, json.dumps(redacted(config), indent=2))
