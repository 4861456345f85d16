"""Advising from a run's own ``config.json``: the ``auto`` settings given back.

A run folder's ``config.json`` is the config pre-flight resolved for that run's device map: every ``auto`` it
chose (micro-batch token budgets, offload, activation checkpointing, ...) is spelled out there. Planned as is,
another map would inherit them: a map that fits with its own choices could be dropped for memory, or run with
settings sized for another. ``run_plan.json`` beside it (``hybridrl.run.run_plan``) records which keys were
``auto`` and what the user gave; ``auto_resets`` turns them back into overrides, so each candidate map resolves
its own, as it would from the user's YAML.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: the record pre-flight writes beside a run's ``config.json``
RUN_PLAN_FILE = "run_plan.json"
_UNSET = object()


def auto_resets(config: str | Path) -> list[str]:
    """Overrides that give each ``auto`` choice recorded beside ``config`` back to what the user wrote: its given
    value, else ``auto`` for a backend option (``...options.<name>``), else ``null`` (unset: the schema's
    default). Empty for a config that is no run's (no ``run_plan.json`` beside it, or an unreadable one)."""
    record_path = Path(config).resolve().parent / RUN_PLAN_FILE
    if Path(config).name != "config.json" or not record_path.is_file():
        return []
    try:
        record = json.loads(record_path.read_text())
        choices = [c["key"] for c in record.get("auto", [])]
        given = record.get("given", {})
    except (OSError, ValueError, KeyError, TypeError):
        return []
    out = []
    for key in dict.fromkeys(choices):
        value = _at(given, key.split("."))
        if value is _UNSET:
            out.append(f"{key}={'auto' if '.options.' in key else 'null'}")
        else:
            out.append(f"{key}={value if isinstance(value, str) else json.dumps(value)}")
    return out


def _at(tree: Any, path: list[str]) -> Any:
    for part in path:
        if not isinstance(tree, dict) or part not in tree:
            return _UNSET
        tree = tree[part]
    return tree
