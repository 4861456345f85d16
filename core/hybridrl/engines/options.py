"""What a backend declares about its own options (``roles.<role>.options``), for people: each key's type,
default and one-line description, shown by ``hybridrl plugins NAME``.

The declaration documents; it does not check: a backend's ``check_options`` stays the one judge of a value
(registered next to it, ``registry.add_train_engine(..., options=..., check_options=...)``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


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
    return tuple(OptionDoc(f.name, types.get(f.name) or (f.type if isinstance(f.type, str) else
                                                         getattr(f.type, "__name__", str(f.type))),
                           f.default if f.default is not dataclasses.MISSING else None, descriptions[f.name])
                 for f in fields)
