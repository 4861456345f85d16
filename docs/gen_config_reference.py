"""Write docs/config.md, the reference of every config key, from the pydantic models of the run config.

The schema (``core/hybridrl/config/schema.py``) is the one place a key, its type, its default and its
description are written, so the reference is generated from it rather than kept by hand:

    python docs/gen_config_reference.py            # rewrite docs/config.md
    python docs/gen_config_reference.py --check    # exit 1 if docs/config.md is out of date

The output depends on the schema alone (fields in declaration order, no dates), so it is the same on every
machine and a test can compare it with the committed file.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "config.md"
REGENERATE = "python docs/gen_config_reference.py"

HEADER = f"""# Config reference

Every key of a run config, generated from `core/hybridrl/config/schema.py` by `{REGENERATE}`
(do not edit by hand: change the schema's `description=` and regenerate; a test fails when this page is stale).

Any key can be overridden on the command line by its dotted path (`roles.rollout.temperature=0.7`). A key
whose default is `auto` is resolved before any process starts and recorded under `auto` in
`<trainer.out>/config.json` ([memory-and-auto.md](memory-and-auto.md)). `roles.<role>.options` holds the
backend's own settings, checked by the backend at pre-flight ([vllm.md](vllm.md), [sglang.md](sglang.md),
[memory-and-auto.md](memory-and-auto.md) for FSDP's). `<name>` in a path stands for a name you choose.

## Checked before the run

`hybridrl train` and `hybridrl plan` report every problem at once, with its key path, before any process starts
and before anything is written: bad keys, wrong types, an override that is not YAML, a key given twice in the
YAML file (key path and lines), unknown backends or pools, a pool larger than the cluster, a `cluster.address`
that does not answer (one short try), a model folder that is missing or holds no weights or no tokenizer,
`algorithm.n_samples: 1` with a group-relative advantage, a missing, empty or malformed data file (file and
line), prompts over `data.max_prompt_len` (unless `data.long_prompts=drop`), a prompt plus
`roles.rollout.max_new_tokens` longer than the model's positions, a reward function that cannot be imported,
raises or returns something other than a number on the first prompt, a data source without a reward, a reward
that needs a reference answer on rows without one, a tracker whose package is missing, a `trainer.out` that is a
file, is not writable or holds another run, and a `trainer.resume` that is not a checkpoint or does not fit the
run.
"""


def _is_model(tp: Any) -> bool:
    from pydantic import BaseModel

    return inspect.isclass(tp) and issubclass(tp, BaseModel)


def _union_args(tp: Any) -> tuple[Any, ...] | None:
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        return typing.get_args(tp)
    return None


def _type_name(tp: Any) -> str:
    """A short, Markdown-safe name for an annotation (no `|`: it would split the table cell)."""
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any"
    args = _union_args(tp)
    if args is not None:
        return " or ".join(_type_name(a) for a in args)
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " / ".join(json.dumps(v) if not isinstance(v, str) else v for v in typing.get_args(tp))
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        return f"list of {_type_name(item)}"
    if origin is dict:
        key, value = typing.get_args(tp) or (Any, Any)
        return f"map {_type_name(key)} to {_type_name(value)}"
    if origin is tuple:
        return "[" + ", ".join(_type_name(a) for a in typing.get_args(tp)) + "]"
    if _is_model(tp):
        return "{" + ", ".join(f.alias or n for n, f in tp.model_fields.items()) + "}"
    return getattr(tp, "__name__", str(tp))


_BOUNDS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<=", "min_length": "length >="}


def _bounds(field: Any) -> str:
    parts = []
    for item in field.metadata:
        for attr, sign in _BOUNDS.items():
            value = getattr(item, attr, None)
            if value is not None:
                parts.append(f"{sign} {value}")
    return ", ".join(parts)


def _default(field: Any) -> str:
    from pydantic_core import PydanticUndefined

    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if _is_model(type(value)):
        return "(section below)"
    if isinstance(value, tuple):
        value = list(value)
    return "`" + json.dumps(value) + "`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _model_of(tp: Any) -> type | None:
    """The model a field holds (directly or as ``X | None``), else None."""
    if _is_model(tp):
        return tp
    args = _union_args(tp)
    if args is not None:
        models = [a for a in args if _is_model(a)]
        rest = [a for a in args if not _is_model(a) and a is not type(None)]
        if len(models) == 1 and not rest:
            return models[0]
    return None


def _doc(model: type) -> str:
    doc = model.__dict__.get("__doc__")
    return " ".join(inspect.cleandoc(doc).split()) if doc else ""


def _sections(model: type, path: str) -> list[tuple[str, type]]:
    """Every model reachable from ``model``, depth first in declaration order, with its key path."""
    out = [(path, model)]
    for name, field in model.model_fields.items():
        key = field.alias or name
        sub = _model_of(field.annotation)
        if sub is not None:
            out += _sections(sub, f"{path}.{key}" if path else key)
        elif typing.get_origin(field.annotation) is dict:
            value_type = typing.get_args(field.annotation)[1]
            if _is_model(value_type):
                out += _sections(value_type, f"{path}.{key}.<name>" if path else f"{key}.<name>")
    return out


def render() -> str:
    """The text of docs/config.md for the schema that is imported."""
    from hybridrl.config.schema import RunConfig

    lines = [HEADER]
    for path, model in _sections(RunConfig, ""):
        rows = []
        for name, field in model.model_fields.items():
            sub = _model_of(field.annotation)
            dict_of_models = (typing.get_origin(field.annotation) is dict
                              and _is_model(typing.get_args(field.annotation)[1]))
            key = f"{path}.{field.alias or name}" if path else field.alias or name
            if sub is not None or dict_of_models:
                if not field.description:
                    continue  # its own section below says what it is
                type_text = "section" + (" or null" if sub is not None and _union_args(field.annotation) else "")
                if dict_of_models:
                    type_text = "map of name to section"
            else:
                type_text = _type_name(field.annotation)
            bounds = _bounds(field)
            if bounds:
                type_text += f" ({bounds})"
            cells = [f"`{key}`", type_text, _default(field), field.description or ""]
            rows.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        if not rows:
            continue
        lines.append(f"## `{path}`" if path else "## top level")
        lines.append("")
        if _doc(model):
            lines += [_doc(model), ""]
        lines += ["| key | type | default | description |", "|---|---|---|---|", *rows, ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/config.md is out of date")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "core"))  # this checkout's schema, not an installed one
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is out of date: run {REGENERATE}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
