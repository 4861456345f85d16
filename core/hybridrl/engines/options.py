"""A backend's own options (``roles.<role>.options``): declared once, as a typed model, validated once.

A backend registers ``options=`` a ``BackendOptions`` subclass: one pydantic model whose fields carry their
type, default and ``description=``. Pre-flight validates the role's options against it before any process
starts, naming each bad key as ``roles.<role>.options.<key>``; ``hybridrl plugins NAME`` prints the fields; the
engine builds the same model from ``ctx.options``. ``check_options`` is then only needed for what a model cannot
say (checks against the role's shared training settings).

The older declaration, a sequence of ``OptionDoc``, documents without checking and is still accepted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError


@dataclass(frozen=True)
class OptionDoc:
    """One option key of a backend: its type and default as text (``None`` default: unset), and why it exists."""

    key: str
    type: str
    default: Any
    description: str


def dataclass_options(settings: type, descriptions: Mapping[str, str], types: Mapping[str, str] | None = None
                      ) -> tuple[OptionDoc, ...]:
    """The options of a settings dataclass (a backend's typed view of ``ctx.options``): key, annotated type and
    default from each field, the description from ``descriptions``; a field without one is an error, so a new
    setting cannot go undocumented. ``types``: the type text of fields annotated loosely (``Any``)."""
    fields = dataclasses.fields(settings)
    missing = sorted(f.name for f in fields if f.name not in descriptions)
    extra = sorted(set(descriptions) - {f.name for f in fields})
    if missing or extra:
        raise ValueError(f"{settings.__name__}: options without a description: {missing}; "
                         f"descriptions of no option: {extra}")
    types = types or {}
    return tuple(OptionDoc(f.name, str(types.get(f.name) or (f.type if isinstance(f.type, str) else
                                                             getattr(f.type, "__name__", str(f.type)))),
                           f.default if f.default is not dataclasses.MISSING else None, descriptions[f.name])
                 for f in fields)


class BackendOptions(BaseModel):
    """The base of a backend's options model: unknown keys are refused, and a validated value never changes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @classmethod
    def read(cls, options: Mapping[str, Any]) -> tuple[BackendOptions | None, list[tuple[str, str]]]:
        """The validated options, or None and ``(key, reason)`` for each problem (the key without its prefix)."""
        try:
            return cls.model_validate(dict(options)), []
        except ValidationError as exc:
            return None, [_problem(cls, err) for err in exc.errors()]

    @classmethod
    def docs(cls) -> tuple[OptionDoc, ...]:
        """One ``OptionDoc`` per field, for ``hybridrl plugins NAME``; a field without a description is an error,
        so a new option cannot go undocumented."""
        missing = sorted(name for name, f in cls.model_fields.items() if not f.description)
        if missing:
            raise ValueError(f"{cls.__name__}: options without a description: {missing}")
        return tuple(OptionDoc(name, _type_text(f), f.default, str(f.description))
                     for name, f in cls.model_fields.items())


def is_options_model(obj: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, BackendOptions)


def one_of(*allowed: Any) -> Any:
    """A field type that takes exactly one of ``allowed`` (``True`` is not ``1``), with a message that lists
    them: ``Annotated[str, one_of("auto", "keep")]``."""

    def check(value: Any) -> Any:
        if not any(value is a or (type(value) is type(a) and value == a) for a in allowed):
            shown = ", ".join(str(a).lower() if isinstance(a, bool) else str(a) for a in allowed)
            raise ValueError(f"must be one of {shown}, got {value!r}")
        return value

    return BeforeValidator(check)


def _problem(model: type[BaseModel], err: Any) -> tuple[str, str]:
    """``(key, reason)`` of one validation error; a whole-model check names its key first (``"key: reason"``)."""
    loc = err.get("loc") or ()
    key = str(loc[0]) if loc else ""
    if err.get("type") == "extra_forbidden":
        known = ", ".join(sorted(model.model_fields))
        return key, f"unknown option (known: {known})"
    message = str(err.get("msg", "")).removeprefix("Value error, ")
    named, sep, rest = message.partition(": ")
    if not key and sep and named in model.model_fields:
        return named, rest
    if "got " not in message and "input" in err and key:
        message += f", got {err['input']!r}"
    return key, message


def _type_text(field: Any) -> str:
    """The type as people read it: a field's ``json_schema_extra={"type": ...}`` where set, else its annotation."""
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    if extra.get("type"):
        return str(extra["type"])
    annotation = field.annotation
    return annotation.__name__ if isinstance(annotation, type) else str(annotation).replace("typing.", "")
