"""verl's parquet schema and TRL's columns load unchanged (the committed fixtures, made by
``python -m hybridrl.data.fixtures``); other layouts through data.answer_key / data.data_source_key; every
error names the file, the row and the field; rewards are checked against the data before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridrl.config import ConfigError, DataConfig, load_config
from hybridrl.data.fixtures import write_fixtures
from hybridrl.data.loading import DataError, load_rows, tokenize_rows
from hybridrl.model.tokenizer import load_tokenizer
from hybridrl.placement.plan import ClusterSpec
from hybridrl.plugins.discovery import get_registry
from hybridrl.rewards.rules import Rules, build_spec
from hybridrl.run.preflight import prepare_run

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "data"
QUICKSTART = ROOT / "examples" / "quickstart.yaml"


@pytest.fixture(scope="module")
def qwen2():
    return load_tokenizer(FIXTURES / "qwen2_tokenizer")


def _load(qwen2, path, **cfg):
    cfg = DataConfig(train=str(path), **cfg)
    return tokenize_rows(load_rows(cfg), qwen2, cfg)


def test_the_committed_fixtures_are_what_the_script_makes(tmp_path):
    write_fixtures(tmp_path)
    for made in tmp_path.rglob("*"):
        if made.is_file():
            committed = FIXTURES / made.relative_to(tmp_path)
            if made.suffix == ".parquet":  # compare contents (the writer's metadata may differ by version)
                assert pq.read_table(made).to_pylist() == pq.read_table(committed).to_pylist(), made.name
            else:
                assert made.read_bytes() == committed.read_bytes(), made.name


def test_verl_gsm8k_parquet_loads_unchanged(qwen2):
    rows = _load(qwen2, FIXTURES / "verl_gsm8k_train.parquet", max_prompt_len=200)
    assert len(rows) == 16
    row = rows[0]
    assert row.prompt.startswith("<|im_start|>system\n") and row.prompt.endswith("<|im_start|>assistant\n")
    assert row.meta["data_source"] == "openai/gsm8k" and row.meta["ground_truth"] == "72"
    assert row.meta["reward_model"] == {"style": "rule", "ground_truth": "72"}
    assert row.meta["extra_info"]["index"] == 0 and row.meta["ability"] == "math"
    assert Rules(build_spec(_reward("gsm8k"), get_registry())[0]).score(row.prompt, "#### 72", row.meta) == 1.0


def test_verl_math_parquet_loads_and_scores(qwen2):
    rows = _load(qwen2, FIXTURES / "verl_math_train.parquet", max_prompt_len=200)
    rules = Rules(build_spec(_reward("math"), get_registry())[0])
    for row in rows:
        assert rules.score(row.prompt, f"so \\boxed{{{row.meta['ground_truth']}}}", row.meta) == 1.0
        assert rules.score(row.prompt, "\\boxed{999}", row.meta) == 0.0


def test_trl_conversational_and_text_layouts(qwen2):
    chat = _load(qwen2, FIXTURES / "trl_gsm8k_train.parquet", max_prompt_len=200)
    assert chat[0].messages[0]["role"] == "system" and chat[0].meta == {"answer": "72", "ground_truth": "72"}
    text = _load(qwen2, FIXTURES / "trl_math_train.jsonl", max_prompt_len=200)
    assert text[0].messages is None and text[0].prompt.startswith("Simplify")
    assert text[0].meta["ground_truth"] == text[0].meta["solution"]  # the boxed answer is found in it
    rules = Rules(build_spec(_reward("math"), get_registry())[0])
    assert rules.score(text[0].prompt, "\\boxed{\\frac{7}{8}}", text[0].meta) == 1.0


def _reward(fn, **kw):
    from hybridrl.config import RewardConfig

    return RewardConfig(fn=fn, **kw)


def test_other_layouts_through_field_mapping(tmp_path, qwen2):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"input": {"question": "1+1?"}, "label": 2, "origin": "toy"}) + "\n")
    [row] = _load(qwen2, path, prompt_key="input.question", answer_key="label", data_source_key="origin")
    assert row.prompt == "1+1?" and row.meta["ground_truth"] == 2 and row.meta["data_source"] == "toy"


@pytest.mark.parametrize("rows, cfg, match", [
    ([{"prompt": "a", "label": 1}, {"prompt": "b"}], {"answer_key": "label"},
     r"d\.parquet, row 2: 'label' is null \(data\.answer_key\)"),
    ([{"prompt": "a", "reward_model": {"style": "rule"}}], {"answer_key": "reward_model.ground_truth"},
     r"d\.parquet, row 1: no 'reward_model\.ground_truth' field \(data\.answer_key\); "
     r"fields: \['prompt', 'reward_model'\]"),
    ([{"prompt": "a", "data_source": 3}], {},
     r"d\.parquet, row 1: 'data_source' must be a string \(data\.data_source_key\), got int"),
    ([{"x": {"q": "a"}}, {"x": {"r": "b"}}], {"prompt_key": "x.q"},
     r"d\.parquet, row 2: 'x\.q' must be a string or a list of \{role, content\} messages, got NoneType"),
    ([{"x": "a"}], {"prompt_key": "x.q"}, r"d\.parquet, row 1: no 'x\.q' field \(data\.prompt_key\)"),
])
def test_field_errors_name_file_row_and_field(tmp_path, rows, cfg, match):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(DataError, match=match):
        load_rows(DataConfig(train=str(path), **cfg))


# --- rewards against the data, in the pre-flight -----------------------------------------------------

def problems(tmp_path, overrides):
    cfg = load_config(QUICKSTART, [f"trainer.out={tmp_path / 'run'}",
                                   f"model.tiny.tokenizer={FIXTURES / 'qwen2_tokenizer'}",
                                   "data.max_prompt_len=120", "roles.rollout.max_new_tokens=4", *overrides])
    with pytest.raises(ConfigError) as err:
        prepare_run(cfg, get_registry(), ClusterSpec(1, 2, "cpu"))
    return dict(err.value.problems)


def test_a_source_without_a_reward_is_found(tmp_path):
    found = problems(tmp_path, [f"data.train={FIXTURES / 'verl_gsm8k_train.parquet'}",
                                "roles.reward.fn=null", "roles.reward.by_source={other/source: gsm8k}"])
    assert "16 train row(s) of data_source 'openai/gsm8k' have no reward (first: " in found["roles.reward.by_source"]
    assert "verl_gsm8k_train.parquet, row 1)" in found["roles.reward.by_source"]


def test_rows_without_a_reference_are_found(tmp_path):
    found = problems(tmp_path, [f"data.train={FIXTURES / 'verl_gsm8k_train.parquet'}",
                                f"data.val={FIXTURES / 'trl_math_train.jsonl'}",
                                "data.answer_key=reward_model.ground_truth",
                                "roles.reward.fn=gsm8k"])
    assert "data.val" in found and "no 'reward_model.ground_truth' field (data.answer_key)" in found["data.val"]


def test_a_reward_needing_a_reference_on_data_without_one(tmp_path):
    rows = tmp_path / "noanswer.jsonl"
    rows.write_text('{"prompt": "rev 12="}\n{"prompt": "rev 34="}\n')
    found = problems(tmp_path, ["roles.reward.fn=gsm8k", f"data.train={rows}"])
    assert ("reward 'gsm8k' needs a reference answer, and 2 train row(s) have none (first: "
            f"{rows}, line 1") in found["data.answer_key"]
