"""Prompt data: load rows from a file or a registered dataset, tokenize them, and feed them step by step.

``load_rows`` -> ``tokenize_rows`` -> ``PromptLoader``. Every problem is a ``DataError`` naming the file and,
for jsonl, the line number, so that a bad dataset fails before any worker starts.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from hybridrl.config import DataConfig
from hybridrl.data.chat import PromptFormatError, PromptFormatter, prompt_problem

log = logging.getLogger(__name__)


class DataError(ValueError):
    """The prompt data cannot be used (missing file, bad line, missing prompt field, empty, too long ...).
    ``key``: the config key the problem is reported under, when it is not the data file's."""

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

def _where(rows: list, i: int) -> str:
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


def _from_dataset(cfg: DataConfig, registry: Any) -> Rows:
    name = cfg.dataset
    try:
        fn = registry.get("dataset", name)
    except ValueError as exc:  # RegistryError: unknown name, with the known ones listed
        raise DataError(str(exc)) from None
    try:
        produced = fn(**cfg.dataset_args)
    except TypeError as exc:
        raise DataError(f"dataset '{name}' does not accept data.dataset_args={cfg.dataset_args}: {exc}") from None
    rows = list(produced)
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"dataset '{name}', row {i + 1}: expected a dict, got {type(row).__name__}")
    return Rows(rows, f"dataset '{name}'")


def load_rows(cfg: DataConfig, registry: Any = None) -> Rows:
    """Raw rows (dicts) from ``cfg.train`` (``.jsonl`` / ``.parquet``) or the registered dataset ``cfg.dataset``
    called with ``cfg.dataset_args``. Checks that every row has a prompt under ``cfg.prompt_key``: a non-empty
    string or a list of ``{role, content}`` messages (``hybridrl.data.chat``)."""
    if cfg.train is not None:
        path = Path(cfg.train)
        if not path.is_file():
            raise DataError(f"data file '{path}' not found" + (" (it is a folder)" if path.is_dir() else ""))
        suffix = path.suffix.lower()
        if suffix in (".jsonl", ".ndjson"):
            rows = _read_jsonl(path)
        elif suffix in (".parquet", ".pq"):
            rows = _read_parquet(path)
        else:
            raise DataError(f"data file '{path}': unsupported extension '{path.suffix}' (use .jsonl or .parquet)")
    elif cfg.dataset is not None:
        if registry is None:
            from hybridrl.plugins.discovery import get_registry

            registry = get_registry()
        rows = _from_dataset(cfg, registry)
    else:
        raise DataError("no prompt data: give data.train (a file) or data.dataset (a registered name)")

    if not rows:
        raise DataError(f"{rows.source}: the dataset is empty")
    key = cfg.prompt_key
    for i, row in enumerate(rows):
        if key not in row:
            raise DataError(f"{_where(rows, i)}: no '{key}' field (data.prompt_key); fields: {sorted(row)}")
        problem = prompt_problem(row[key])
        if problem is not None:
            raise DataError(f"{_where(rows, i)}: '{key}' {problem}")
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
            text, messages = formatter.format(row[key])
        except PromptFormatError as exc:
            raise DataError(f"{_where(rows, i)}: '{key}' {exc}") from None
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
            raise DataError(f"{_where(rows, i)}: the prompt encodes to zero tokens")
        out.append(PromptRow(text, ids, {k: v for k, v in row.items() if k != key}, messages))
    if too_long:
        first = too_long[0]
        n_first = len(encoded[first])
        what = (f"{len(too_long)} of {len(rows)} prompts are longer than data.max_prompt_len={cfg.max_prompt_len} "
                f"tokens (first: {_where(rows, first)}, {n_first} tokens)")
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
