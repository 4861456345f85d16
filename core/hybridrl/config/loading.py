"""Reading a run config: YAML plus dotted overrides, validated into ``RunConfig``; every problem is reported
with its key path, all at once (``ConfigError``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from hybridrl.config.schema import ConfigError, RunConfig
from hybridrl.config.secrets import resolve_env


class DuplicateKeyError(yaml.YAMLError):
    """A mapping with the same key twice: PyYAML keeps the last one silently, so a duplicated ``lr:`` would
    set one value and hide the other."""

    def __init__(self, path: str, first: int, again: int) -> None:
        super().__init__(f"duplicate key '{path}' at line {again} (first at line {first})")
        self.path, self.first, self.again = path, first, again


def _check_unique(node: yaml.Node, path: str) -> None:
    """Walk the composed YAML: every mapping's keys unique (keys a merge ``<<:`` brings in may be overridden,
    which is what merges are for)."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else repr(key_node.value)
            where = f"{path}.{key}" if path else key
            line = key_node.start_mark.line + 1
            if key in seen:
                raise DuplicateKeyError(where, seen[key], line)
            seen[key] = line
            _check_unique(value_node, where)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_unique(item, f"{path}[{i}]")


def load_yaml(text: str, path: str = "") -> Any:
    """``yaml.safe_load`` that refuses duplicate keys (``DuplicateKeyError``, with the key's dotted path under
    ``path``)."""
    node = yaml.compose(text, Loader=yaml.SafeLoader)
    if node is not None:
        _check_unique(node, path)
    return yaml.safe_load(text)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` -> (["a","b","c"], value parsed as YAML); a value that is not valid YAML (an unclosed
    ``[console,``) is a ``ConfigError`` naming the key."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError([(text, "override must look like key.path=value")])
    try:
        value = load_yaml(raw, key.strip()) if raw.strip() else None
    except DuplicateKeyError as exc:
        raise ConfigError([(exc.path, f"duplicate key in the override '{text}'; keep one")]) from None
    except yaml.YAMLError as exc:
        raise ConfigError([(key.strip(), f"the value '{raw}' is not valid YAML ({_yaml_reason(exc)}); quote it "
                                         "for the shell, and close brackets and quotes")]) from None
    return key.strip().split("."), value


def _yaml_reason(exc: yaml.YAMLError) -> str:
    """The problem of a YAML error in one line (PyYAML's message spans several, with a pointer)."""
    if isinstance(exc, DuplicateKeyError):
        return str(exc)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    mark = getattr(exc, "problem_mark", None)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem


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
    """Read YAML (or start from ``base``), apply dotted overrides, validate. Raises ``ConfigError``.
    ``key=null`` on the command line sets an optional key to None and unsets any other (see ``_validate``)."""
    data: dict[str, Any] = dict(base or {})
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError([("<file>", f"config file '{p}' not found")])
        try:
            loaded = load_yaml(p.read_text()) or {}
        except DuplicateKeyError as exc:
            raise ConfigError([(exc.path, f"{p}, line {exc.again}: duplicate key (first at line {exc.first}); "
                                          "keep one")]) from None
        except yaml.YAMLError as exc:
            raise ConfigError([("<file>", f"{p} is not valid YAML: {_yaml_reason(exc)}")]) from None
        if not isinstance(loaded, dict):
            raise ConfigError([("<file>", f"{p} must hold a mapping at the top level")])
        data.update(loaded)
    overrides = list(overrides or [])
    data = apply_overrides(data, overrides)
    data, missing = resolve_env(data)  # ${VAR}: the variable's value (hybridrl.config.secrets)
    if missing:
        raise ConfigError(missing)
    return _validate(data, _null_overrides(data, overrides))


def _null_overrides(data: dict[str, Any], overrides: list[str]) -> set[str]:
    """The dotted keys the overrides set to null in words (``key=null`` or ``key=~``). An empty value
    (``key=``) is not among them: a slip of the keyboard stays an error where the key needs a value."""
    nulls = set()
    for text in overrides:
        key, _, value = text.partition("=")
        if value.strip().lower() not in ("null", "~"):
            continue
        path = key.strip().split(".")
        node: Any = data
        for part in path[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and path[-1] in node and node[path[-1]] is None:
            nulls.add(".".join(path))
    return nulls


def _validate(data: dict[str, Any], nulls: set[str]) -> RunConfig:
    """``RunConfig`` of ``data``. A key set to null on the command line is None where the key accepts None;
    where it does not, null unsets it (its default applies), and a required key given null is refused by name."""
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        unset = _refused_nulls(err, nulls)
        if not unset:
            raise ConfigError(_format_errors(err)) from None
    for key in unset:
        *parents, last = key.split(".")
        node = data
        for part in parents:
            node = node[part]
        del node[last]
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        problems = [(path, "is required: null cannot unset it; give a value" if path in unset
                     and reason == "required key missing" else reason) for path, reason in _format_errors(err)]
        raise ConfigError(problems) from None


def _refused_nulls(err: ValidationError, nulls: set[str]) -> set[str]:
    """The null keys whose field does not accept None (their error is at the key, or at a member of its union
    type, and its input is the None given)."""
    refused = set()
    for e in err.errors():
        if e["type"] == "extra_forbidden" or e.get("input", ...) is not None:
            continue
        where = ".".join(str(p) for p in e["loc"])
        refused |= {key for key in nulls if where == key or where.startswith(key + ".")}
    return refused
