"""A backend's options model: validated once, each problem under its key, documented from its fields."""

from __future__ import annotations

from typing import Annotated

import pytest
from pydantic import Field, model_validator

from hybridrl.engines.options import BackendOptions, is_options_model, one_of
from hybridrl.engines.sleep import BACKUP, DISCARD, KEEP, KV_CACHE, WEIGHTS, SleepStages


class ToyOptions(BackendOptions):
    mode: Annotated[str, one_of("fast", "exact")] = Field("fast", description="how the toy engine runs")
    depth: int = Field(1, ge=1, description="how deep it goes")
    flag: Annotated[bool, one_of(True, False)] = Field(False, description="a switch that needs depth > 1")

    @model_validator(mode="after")
    def _flag_needs_depth(self) -> ToyOptions:
        if self.flag and self.depth < 2:
            raise ValueError("flag: needs depth >= 2")
        return self


def test_good_options_validate_to_the_model() -> None:
    opts, problems = ToyOptions.read({"mode": "exact", "depth": 3})
    assert problems == [] and opts == ToyOptions(mode="exact", depth=3)
    assert is_options_model(ToyOptions) and not is_options_model(ToyOptions())


def test_each_problem_names_its_key() -> None:
    opts, problems = ToyOptions.read({"mode": "slow", "depth": 0, "colour": "red", "flag": 1})
    found = dict(problems)
    assert opts is None
    assert found["mode"] == "must be one of fast, exact, got 'slow'"
    assert "greater than or equal to 1" in found["depth"]
    assert found["colour"].startswith("unknown option (known: depth, flag, mode)")
    assert "must be one of true, false" in found["flag"]  # 1 is not True


def test_a_whole_model_check_is_reported_under_the_key_it_names() -> None:
    _, problems = ToyOptions.read({"flag": True})
    assert problems == [("flag", "needs depth >= 2")]


def test_docs_come_from_the_fields_and_every_field_needs_a_description() -> None:
    docs = {d.key: d for d in ToyOptions.docs()}
    assert docs["depth"].default == 1 and docs["depth"].type == "int"
    assert docs["mode"].description == "how the toy engine runs"

    class Undocumented(BackendOptions):
        size: int = 3

    with pytest.raises(ValueError, match=r"without a description: \['size'\]"):
        Undocumented.docs()


def test_sleep_stages_discard_only_when_an_import_will_refill() -> None:
    s = SleepStages(engine="toy", fix="toy.keep=true")
    assert s.on_sleep() == BACKUP  # fresh weights: never discarded
    assert s.on_sleep() is None
    assert s.on_wake() == [WEIGHTS, KV_CACHE]
    s.on_generate()
    assert s.on_sleep() == BACKUP and s.on_import_begin() == [WEIGHTS]  # an import seen while asleep
    s.on_import_end()
    assert s.on_wake() == [KV_CACHE]
    s.on_generate()
    assert s.on_sleep() == DISCARD
    with pytest.raises(RuntimeError, match="toy.keep=true"):
        s.on_wake()
    keep = SleepStages(policy=KEEP)
    assert keep.on_sleep() == KEEP and keep.on_import_begin() == [] and keep.on_wake() == [KV_CACHE]
    with pytest.raises(ValueError, match="sleep policy"):
        SleepStages(policy="sometimes")
