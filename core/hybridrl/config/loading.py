"""Reading a run config: YAML plus dotted overrides, validated into ``RunConfig``; every problem is reported
with its key path, all at once (``ConfigError``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from hybridrl.config.schema import ConfigError, RunConfig

def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` -> (["a","b","c"], value parsed as YAML)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError([(text, "override must look like key.path=value")])
    return key.strip().split("."), yaml.safe_load(raw) if raw.strip() else None


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for i, part in enumerate(path[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                reason = f"is a {type(child).__name__}, cannot set '{path[i + 1]}' in it"
                raise ConfigError([(".".join(path[: i + 1]), reason)])
            node = child
        node[path[-1]] = value
    return data


def _format_errors(err: ValidationError) -> list[tuple[str, str]]:
    problems = []
    for e in err.errors():
        path = (e.get("ctx") or {}).get("path") or ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            reason = "unknown key"
        elif e["type"] == "missing":
            reason = "required key missing"
        else:
            reason = e["msg"].removeprefix("Value error, ")
            if "input" in e and e["type"] not in ("model_type", "dict_type") and not isinstance(e["input"], dict):
                reason += f" (got {e['input']!r})"
        problems.append((path, reason))
    return problems


def load_config(path: str | Path | None, overrides: list[str] | None = None,
                base: dict[str, Any] | None = None) -> RunConfig:
    """Read YAML (or start from ``base``), apply dotted overrides, validate. Raises ``ConfigError``."""
    data: dict[str, Any] = dict(base or {})
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError([("<file>", f"config file '{p}' not found")])
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError([("<file>", f"{p} is not valid YAML: {exc}")]) from None
        if not isinstance(loaded, dict):
            raise ConfigError([("<file>", f"{p} must hold a mapping at the top level")])
        data.update(loaded)
    data = apply_overrides(data, list(overrides or []))
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_errors(err)) from None
