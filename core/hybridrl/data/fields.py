"""Where a row keeps its prompt, its reference answer and its data source, for the layouts users bring.

- verl's parquet schema: ``prompt`` (messages), ``data_source``, ``reward_model: {style, ground_truth}``,
  ``extra_info``;
- TRL's common columns: ``prompt`` (messages or text) with ``answer`` or ``solution``;
- anything else through ``data.prompt_key`` / ``data.answer_key`` / ``data.data_source_key``, each a field name
  or a dotted path into nested fields (``extra_info.question``).

Every row handed to a reward carries its reference as ``ground_truth`` and its source as ``data_source`` (when
it has them), whatever the layout, so rewards read one name.
"""

from __future__ import annotations

from typing import Any

#: where the reference answer is looked for when ``data.answer_key`` is unset, in this order.
ANSWER_FIELDS = ("reward_model.ground_truth", "ground_truth", "answer", "solution")
_MISSING = object()


def lookup(row: dict[str, Any], path: str) -> Any:
    """The value at dotted ``path`` in ``row`` (a field name containing dots is tried whole first), or
    ``_MISSING``."""
    if path in row:
        return row[path]
    value: Any = row
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def has(row: dict[str, Any], path: str) -> bool:
    return lookup(row, path) is not _MISSING


def answer_of(row: dict[str, Any], answer_key: str | None) -> tuple[Any, str | None]:
    """``(reference answer, the field it came from)``; ``(None, None)`` when the row has none. With an explicit
    ``answer_key`` only that field counts."""
    for path in (answer_key,) if answer_key else ANSWER_FIELDS:
        value = lookup(row, path)
        if value is not _MISSING and value is not None:
            return value, path
    return None, None


def field_problem(row: dict[str, Any], path: str, key: str) -> str | None:
    """Why ``row`` lacks the field that config key ``key`` names, or None."""
    if has(row, path):
        return None if lookup(row, path) is not None else f"'{path}' is null ({key})"
    top = sorted(row) if isinstance(row, dict) else []
    return f"no '{path}' field ({key}); fields: {top}"


def source_problem(value: Any, path: str) -> str | None:
    if value is None or isinstance(value, str):
        return None
    return f"'{path}' must be a string (data.data_source_key), got {type(value).__name__}"


def reward_fields(row: dict[str, Any], prompt_key: str, answer_key: str | None,
                  data_source_key: str) -> dict[str, Any]:
    """The fields a reward gets: the row's own (its prompt left out), plus ``ground_truth`` and
    ``data_source`` resolved through the keys."""
    meta = {k: v for k, v in row.items() if k != prompt_key}
    answer, _ = answer_of(row, answer_key)
    if answer is not None:
        meta["ground_truth"] = answer
    source = lookup(row, data_source_key)
    if source is not _MISSING and source is not None:
        meta["data_source"] = source
    return meta
