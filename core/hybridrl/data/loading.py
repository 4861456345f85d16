"""Prompt data: load rows from a file or a registered dataset, tokenize them, and feed them step by step.

``load_rows`` -> ``tokenize_rows`` -> ``PromptLoader``. Every problem is a ``DataError`` naming the file and,
for jsonl, the line number, so that a bad dataset fails before any worker starts.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hybridrl.config import DataConfig
from hybridrl.data import fields
from hybridrl.data.chat import PromptFormatError, PromptFormatter, prompt_problem
from hybridrl.errors import HybridRLError

log = logging.getLogger(__name__)


class DataError(HybridRLError, ValueError):
    """The prompt data cannot be used (missing file, bad line, missing prompt field, empty, too long ...).
    ``key``: the config key the problem is reported under, when it is not the data file's."""

    exit_status = 2  # refused before any work

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class Rows(list):
    """``list[dict]`` of raw rows that remembers where each came from, for error messages.

    ``source``: the file (or ``dataset 'name'``); ``locations[i]``: ``"line 7"`` / ``"row 7"`` of row ``i``.
    """

    def __init__(self, rows: Iterable[dict[str, Any]] = (), source: str = "<rows>",
                 locations: list[str] | None = None) -> None:
        super().__init__(rows)
        self.source = source
        self.locations = locations if locations is not None else [f"row {i + 1}" for i in range(len(self))]


@dataclass
class PromptRow:
    """One prompt: the text the model is given (a chat rendered by its template), its token ids, the other
    fields of its row (``answer`` ...), and the chat it came from (None for a text prompt)."""

    prompt: str
    token_ids: list[int]
    meta: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, str]] | None = None


class PromptRows(list):
    """``list[PromptRow]`` returned by ``tokenize_rows``; ``dropped`` counts prompts dropped as too long."""

    def __init__(self, rows: Iterable[PromptRow] = (), dropped: int = 0) -> None:
        super().__init__(rows)
        self.dropped = dropped


# --- loading --------------------------------------------------------------------------------------

def where(rows: list, i: int) -> str:
    """``"file, line 7"`` of row ``i`` (``"row 7"`` for parquet and datasets)."""
    source = getattr(rows, "source", "<rows>")
    locations = getattr(rows, "locations", None)
    loc = locations[i] if locations is not None and i < len(locations) else f"row {i + 1}"
    return f"{source}, {loc}"


def _read_jsonl(path: Path) -> Rows:
    rows: list[dict[str, Any]] = []
    locations: list[str] = []
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read data file '{path}': {exc}") from None
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}, line {lineno}: invalid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}, line {lineno}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
        locations.append(f"line {lineno}")
    return Rows(rows, str(path), locations)


def _read_parquet(path: Path) -> Rows:
    try:
        import pyarrow.parquet as pq

        rows = pq.read_table(str(path)).to_pylist()
    except Exception as exc:  # pyarrow raises several types (ArrowInvalid, OSError ...)
        raise DataError(f"cannot read parquet file '{path}': {exc}") from None
    return Rows(rows, str(path))


def _from_dataset(cfg: DataConfig, registry: Any, args: dict[str, Any]) -> Rows:
    name = cfg.dataset
    try:
        fn = registry.get("dataset", name)
    except ValueError as exc:  # RegistryError: unknown name, with the known ones listed
        raise DataError(str(exc)) from None
    try:
        produced = fn(**args)
    except TypeError as exc:
        raise DataError(f"dataset '{name}' does not accept data.dataset_args={args}: {exc}") from None
    except (ValueError, ImportError) as exc:  # its own refusal of the arguments, or a package it needs
        raise DataError(f"dataset '{name}' with {args}: {exc}") from None
    rows = list(produced)
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"dataset '{name}', row {i + 1}: expected a dict, got {type(row).__name__}")
    return Rows(rows, f"dataset '{name}'")


def _read_file(path: Path) -> Rows:
    if not path.is_file():
        raise DataError(f"data file '{path}' not found" + (" (it is a folder)" if path.is_dir() else ""))
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return _read_jsonl(path)
    if suffix in (".parquet", ".pq"):
        return _read_parquet(path)
    raise DataError(f"data file '{path}': unsupported extension '{path.suffix}' (use .jsonl or .parquet)")


def load_rows(cfg: DataConfig, registry: Any = None, split: str = "train") -> Rows:
    """Raw rows (dicts) of ``split``: ``train`` from ``cfg.train`` (``.jsonl`` / ``.parquet``) or the registered
    dataset ``cfg.dataset`` called with ``cfg.dataset_args``; ``val`` from ``cfg.val`` or that dataset called
    with ``cfg.val_dataset_args``. Checks every row: a prompt under ``cfg.prompt_key`` (a non-empty string or a
    list of ``{role, content}`` messages, ``hybridrl.data.chat``), the ``cfg.answer_key`` field when one is
    named, a string ``data_source`` (``hybridrl.data.fields``)."""
    path = cfg.train if split == "train" else cfg.val
    if path is not None:
        rows = _read_file(Path(path))
    elif cfg.dataset is not None and (split == "train" or cfg.val_dataset_args is not None):
        if registry is None:
            from hybridrl.plugins.discovery import get_registry

            registry = get_registry()
        rows = _from_dataset(cfg, registry, cfg.dataset_args if split == "train" else cfg.val_dataset_args)
    elif split == "train":
        raise DataError("no prompt data: give data.train (a file) or data.dataset (a registered name)")
    else:
        raise DataError("no validation data: give data.val (a file) or data.val_dataset_args (with data.dataset)")

    if not rows:
        raise DataError(f"{rows.source}: the dataset is empty")
    key = cfg.prompt_key
    for i, row in enumerate(rows):
        if not fields.has(row, key):
            raise DataError(f"{where(rows, i)}: no '{key}' field (data.prompt_key); fields: {sorted(row)}")
        problem = prompt_problem(fields.lookup(row, key))
        if problem is not None:
            raise DataError(f"{where(rows, i)}: '{key}' {problem}")
        if cfg.answer_key is not None:
            problem = fields.field_problem(row, cfg.answer_key, "data.answer_key")
            if problem is not None:
                raise DataError(f"{where(rows, i)}: {problem}")
        problem = fields.source_problem(fields.lookup(row, cfg.data_source_key), cfg.data_source_key) \
            if fields.has(row, cfg.data_source_key) else None
        if problem is not None:
            raise DataError(f"{where(rows, i)}: {problem}")
    return rows


# --- tokenizing -----------------------------------------------------------------------------------

def prompt_formatter(tokenizer: Any, cfg: DataConfig) -> PromptFormatter:
    """The formatter of ``cfg.chat_template`` / ``cfg.system_prompt``; a ``DataError`` names a bad template file."""
    try:
        return PromptFormatter(tokenizer, cfg.chat_template, cfg.system_prompt)
    except PromptFormatError as exc:
        raise DataError(str(exc).removeprefix("data.chat_template: ").removeprefix("data.system_prompt "),
                        key="data.chat_template") from None


def tokenize_rows(rows: list[dict[str, Any]], tokenizer: Any, cfg: DataConfig) -> PromptRows:
    """Format (chats through their template, ``hybridrl.data.chat``) and tokenize the prompt of every row;
    text prompts keep the tokenizer's own special-token convention (e.g. a BOS).

    Prompts longer than ``cfg.max_prompt_len`` tokens raise a ``DataError`` naming the first one and the count
    (``cfg.long_prompts == "error"``) or are dropped, with the count logged and kept in ``.dropped`` ("drop").
    """
    if not rows:
        raise DataError(f"{getattr(rows, 'source', '<rows>')}: the dataset is empty")
    key = cfg.prompt_key
    formatter = prompt_formatter(tokenizer, cfg)
    texts: list[str] = []
    chats: list[list[dict[str, str]] | None] = []
    for i, row in enumerate(rows):
        try:
            text, messages = formatter.format(fields.lookup(row, key))
        except PromptFormatError as exc:
            raise DataError(f"{where(rows, i)}: '{key}' {exc}") from None
        texts.append(text)
        chats.append(messages)
    encoded = formatter.encode(texts, [m is not None for m in chats])
    out: list[PromptRow] = []
    too_long: list[int] = []
    for i, (row, text, messages, ids) in enumerate(zip(rows, texts, chats, encoded)):
        if len(ids) > cfg.max_prompt_len:
            too_long.append(i)
            continue
        if not ids:
            raise DataError(f"{where(rows, i)}: the prompt encodes to zero tokens")
        meta = fields.reward_fields(row, key, cfg.answer_key, cfg.data_source_key)
        out.append(PromptRow(text, ids, meta, messages))
    if too_long:
        first = too_long[0]
        n_first = len(encoded[first])
        what = (f"{len(too_long)} of {len(rows)} prompts are longer than data.max_prompt_len={cfg.max_prompt_len} "
                f"tokens (first: {where(rows, first)}, {n_first} tokens)")
        if cfg.long_prompts == "error":
            raise DataError(f"{what}; raise data.max_prompt_len or set data.long_prompts=drop")
        if not out:
            raise DataError(f"{what}; dropping them leaves no prompts")
        log.warning("%s; dropped them (data.long_prompts=drop)", what)
    return PromptRows(out, dropped=len(too_long))


# --- feeding --------------------------------------------------------------------------------------

def _epoch_seed(seed: int, epoch: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + 1) % (2**63)


class PromptLoader:
    """Endless iterator of ``prompts_per_step``-long lists of rows.

    Each epoch visits every row once, in an order drawn from ``seed`` and the epoch number (or in file order
    when ``shuffle`` is off); a step that runs past the end of an epoch continues into the next one, so a
    dataset smaller than ``prompts_per_step`` wraps around deterministically. ``state_dict()`` is
    ``{"epoch", "position"}`` (plus the row count, checked on load): a resumed loader yields exactly what
    the original would have.
    """

    def __init__(self, rows: list[PromptRow], prompts_per_step: int, seed: int = 0, shuffle: bool = True) -> None:
        if not rows:
            raise DataError("PromptLoader needs at least one row")
        if prompts_per_step <= 0:
            raise ValueError(f"prompts_per_step must be positive, got {prompts_per_step}")
        self.rows = list(rows)
        self.prompts_per_step = int(prompts_per_step)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.epoch = 0
        self.position = 0
        self._order_epoch: int | None = None
        self._order: list[int] = []

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    def _order_of(self, epoch: int) -> list[int]:
        if self._order_epoch != epoch:
            if self.shuffle:
                gen = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
                self._order = torch.randperm(len(self.rows), generator=gen).tolist()
            else:
                self._order = list(range(len(self.rows)))
            self._order_epoch = epoch
        return self._order

    def __iter__(self) -> Iterator[list[PromptRow]]:
        return self

    def __next__(self) -> list[PromptRow]:
        batch: list[PromptRow] = []
        while len(batch) < self.prompts_per_step:
            order = self._order_of(self.epoch)
            take = min(self.prompts_per_step - len(batch), len(order) - self.position)
            batch.extend(self.rows[i] for i in order[self.position:self.position + take])
            self.position += take
            if self.position >= len(order):
                self.epoch += 1
                self.position = 0
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "num_rows": len(self.rows)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        num_rows = state.get("num_rows")
        if num_rows is not None and int(num_rows) != len(self.rows):
            raise DataError(f"cannot resume the prompt loader: the checkpoint saw {num_rows} rows, "
                            f"the data now has {len(self.rows)}")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < len(self.rows):
            raise DataError(f"invalid prompt loader state {dict(state)} for {len(self.rows)} rows")
        self.epoch, self.position = epoch, position
