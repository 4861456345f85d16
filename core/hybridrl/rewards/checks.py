"""Pre-flight checks of the rule rewards against the data, before any process starts: every function
resolves and can be called on a first prompt, every row's source has a reward, every reward that needs a
reference answer finds one in every row, and a pool can receive the functions. Each problem is
``(key path, reason)``, reported with the others by ``prepare_run``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybridrl.rewards.calling import RewardCall, describe_exception, is_number
from hybridrl.rewards.rules import RuleSpec, needs_ground_truth

Problems = list[tuple[str, str]]


def probe_problems(spec: RuleSpec, first_rows: dict[Any, tuple[str, dict[str, Any]]]) -> Problems:
    """Call every term once, as the trainer will, on the first prompt (rendered) of a source that uses it with
    an empty response: it must not raise and must return a finite number. ``first_rows``: source (None: rows
    without one) -> ``(prompt, fields)``."""
    from hybridrl.plugins.registry import load_object
    from hybridrl.run.guarded_call import note

    problems: Problems = []
    for source, (prompt, fields) in first_rows.items():
        for term in spec.terms_for(source) or ():
            note(f"{term.key} '{term.name}'")
            try:
                value = RewardCall(load_object(term.target))(prompt, "", fields, **term.args)
            except Exception as exc:  # noqa: BLE001 - whatever it raises, the run would score 0 for every row
                problems.append((term.key, f"'{term.name}' {describe_exception(exc)} when probed on the first "
                                           f"prompt with an empty response (fields: {sorted(fields)}"
                                           f"{', args: ' + str(sorted(term.args)) if term.args else ''})"))
                continue
            if not is_number(value):  # NaN passes here: it scores 0 and is counted while training
                problems.append((term.key, f"'{term.name}' returned {type(value).__name__} {value!r:.60} for the "
                                           "first prompt; a reward must be a number"))
    return problems


def guarded_probe_problems(spec: RuleSpec, first_rows: dict[Any, tuple[str, dict[str, Any]]], timeout_s: float
                           ) -> Problems:
    """``probe_problems`` in a spawned child with a deadline of ``timeout_s`` per call
    (``hybridrl.run.guarded_call``): a reward that hangs, exits or kills its process is one problem under its key
    instead of a driver that never returns or ends without a word. hybridrl's own rewards, and functions that
    cannot be sent to a process (registered as objects: they run inline anyway), are probed in the driver."""
    from hybridrl.run.guarded_call import ChildFailure, call_in_child

    if spec.bundled() or not spec.picklable():
        return probe_problems(spec, first_rows)
    try:
        return call_in_child(probe_problems, (spec, first_rows), timeout_s, noted=True)
    except ChildFailure as exc:
        where = exc.last_note or next((f"{t.key} '{t.name}'" for t in spec.all_terms()), "roles.reward.fn")
        key, _, name = where.partition(" ")
        how = (f"{exc.reason} (roles.reward.timeout_s)" if exc.reason.startswith("timed out") else exc.reason)
        return [(key, f"{name} {how} when probed on the first prompt with an empty response, in a process of its "
                      "own; a reward must return a number, not hang or end its process")]


def data_problems(spec: RuleSpec, rows_by_split: dict[str, Sequence[tuple[str, dict[str, Any]]]]) -> Problems:
    """Sources without a reward, and rows without the reference answer a reward needs. ``rows_by_split``:
    ``train``/``val`` -> ``(where, fields)`` of every row (``where``: file and line)."""
    from hybridrl.plugins.registry import load_object

    problems: Problems = []
    needs = {id(t): needs_ground_truth(load_object(t.target)) for t in spec.all_terms()}
    for split, rows in rows_by_split.items():
        uncovered: dict[Any, list[str]] = {}
        missing: dict[str, list[str]] = {}
        for where, fields in rows:
            source = fields.get("data_source")
            terms = spec.terms_for(source)
            if terms is None:
                uncovered.setdefault(source, []).append(where)
                continue
            if "ground_truth" not in fields:
                for term in terms:
                    if needs[id(term)]:
                        missing.setdefault(term.name, []).append(where)
        for source, places in uncovered.items():
            problems.append(("roles.reward.by_source",
                             f"{len(places)} {split} row(s) of data_source {source!r} have no reward (first: "
                             f"{places[0]}); add it to roles.reward.by_source or set roles.reward.fn"))
        for name, places in missing.items():
            problems.append(("data.answer_key",
                             f"reward '{name}' needs a reference answer, and {len(places)} {split} row(s) have none "
                             f"(first: {places[0]}: no reward_model.ground_truth, ground_truth, answer or solution "
                             "field); name the field with data.answer_key"))
    return problems


def runner_problems(spec: RuleSpec, runner: str) -> Problems:
    if runner == "process" and not spec.picklable():
        names = [t.name for t in spec.all_terms() if not isinstance(t.target, str)]
        return [("roles.reward.runner", f"process: the reward(s) {names} were registered as objects that cannot "
                                        "be sent to a process (register them as 'module:function', or use "
                                        "roles.reward.runner=inline)")]
    return []


def run_problems(spec: RuleSpec, reward_cfg: Any, data_cfg: Any, raw: dict[str, Any], prompts: Sequence[Any]
                 ) -> Problems:
    """All the checks above for a run: ``raw`` holds the raw rows of each split (``train``, ``val``),
    ``prompts`` the tokenised training prompts (whose rendered text the probe uses)."""
    from hybridrl.data.fields import reward_fields
    from hybridrl.data.loading import where

    problems = runner_problems(spec, reward_cfg.runner)
    by_split = {split: [(where(rows, i), reward_fields(row, data_cfg.prompt_key, data_cfg.answer_key,
                                                       data_cfg.data_source_key)) for i, row in enumerate(rows)]
                for split, rows in raw.items()}
    problems += data_problems(spec, by_split)
    first: dict[Any, tuple[str, dict[str, Any]]] = {}
    for row in prompts:
        source = row.meta.get("data_source")
        key = source if source in spec.by_source else None
        if key not in first and spec.terms_for(source) is not None:
            first[key] = (row.prompt, row.meta)
    return problems + guarded_probe_problems(spec, first, reward_cfg.timeout_s)
