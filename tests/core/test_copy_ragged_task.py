"""The long-tailed copy task: seeded ragged lengths within 1..64, the bundled file, the reward's partial credit."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from hybridrl.config import DataConfig, load_config
from hybridrl.data.loading import load_rows, tokenize_rows
from hybridrl.model.tokenizer import build_char_tokenizer
from hybridrl.plugins.discovery import get_registry
from hybridrl.tasks.copy_ragged import answer_for, copy_ragged_reward, main, make_copy_ragged_rows

REPO = Path(__file__).resolve().parents[2]


def test_rows_are_seeded_copies_with_long_tailed_lengths():
    rows = make_copy_ragged_rows(2000, median=6, sigma=1.0, seed=3)
    assert rows == make_copy_ragged_rows(2000, median=6, sigma=1.0, seed=3)
    assert rows != make_copy_ragged_rows(2000, median=6, sigma=1.0, seed=4)
    lengths = [len(r["answer"]) for r in rows]
    assert all(r["prompt"] == f"cp {r['answer']}=" and set(r["answer"]) <= set("ab") for r in rows)
    assert min(lengths) == 1 and max(lengths) == 64  # clipped at both ends
    assert 5 <= statistics.median(lengths) <= 7
    assert statistics.mean(lengths) > 1.4 * statistics.median(lengths)  # the tail pulls the mean up
    assert sum(n >= 32 for n in lengths) >= 0.02 * len(lengths)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="count"):
        make_copy_ragged_rows(0)
    with pytest.raises(ValueError, match="alphabet"):
        make_copy_ragged_rows(4, alphabet="a1")


@pytest.mark.parametrize("response, expected", [
    ("abba", 1.0),
    ("abba<eos><pad>", 1.0),
    (" abba ", 1.0),
    ("abbb", 0.5 * 3 / 4 + 0.3),         # right length, three characters in place
    ("ab", 0.5 * 2 / 4 + 0.3 * 2 / 4),   # stopped early
    ("abbaabba", 0.5 * 4 / 8 + 0.3 * 4 / 8),  # ran on: the longer length divides
    ("", 0.0),
    ("<eos>abba", 0.0),
])
def test_reward_table(response, expected):
    assert copy_ragged_reward("cp abba=", response, "abba") == pytest.approx(expected)


def test_answer_derived_from_prompt_and_metadata_accepted():
    assert answer_for("cp ab=") == "ab"
    assert copy_ragged_reward("cp ab=", "ab", data_source="copy_ragged", index=2) == 1.0
    with pytest.raises(ValueError, match="not a copy prompt"):
        copy_ragged_reward("rev 47=", "74")


def test_a_policy_ignoring_the_prompt_stays_well_below_a_copy():
    rows = make_copy_ragged_rows(500)
    constants = [c * n for c in "ab" for n in (1, 3, 6, 10, 20)]
    best = max(statistics.mean(copy_ragged_reward(r["prompt"], c, r["answer"]) for r in rows) for c in constants)
    assert best <= 0.5
    assert all(copy_ragged_reward(r["prompt"], r["answer"]) == 1.0 for r in rows)


def test_bundled_file_matches_the_generator_and_fits_the_example(tmp_path):
    out = tmp_path / "c.jsonl"
    assert main(["--out", str(out)]) == 0
    bundled = REPO / "examples" / "data" / "copy_ragged.jsonl"
    assert out.read_text() == bundled.read_text()
    assert [json.loads(line) for line in bundled.read_text().splitlines()] == make_copy_ragged_rows()
    cfg = DataConfig(train=str(bundled), max_prompt_len=72)  # examples/long-tail.yaml's
    prompts = tokenize_rows(load_rows(cfg), build_char_tokenizer(), cfg)
    assert len(prompts) == 512 and all("?" not in p.prompt for p in prompts)


def test_registered_as_reward_and_dataset():
    registry = get_registry()
    assert registry.get("reward", "copy_ragged") is copy_ragged_reward
    assert registry.get("dataset", "copy_ragged") is make_copy_ragged_rows


def test_example_config_fits_the_longest_prompt_and_response():
    cfg = load_config(REPO / "examples" / "long-tail.yaml", [])
    longest_prompt = len("cp =") + 64
    assert cfg.roles.rollout.max_new_tokens == 64 and cfg.data.max_prompt_len >= longest_prompt
    assert cfg.model.tiny.max_position >= longest_prompt + 64
    assert cfg.roles.reward.fn == "copy_ragged"
