"""The procedural tasks: the in-repo arithmetic generator (the CPU example's) and the reasoning-gym adapter
(when the package is installed)."""

from __future__ import annotations

import importlib.util

import pytest

from hybridrl.config import DataConfig, RewardConfig
from hybridrl.data.loading import DataError, load_rows, tokenize_rows
from hybridrl.model.tokenizer import build_char_tokenizer
from hybridrl.plugins.discovery import get_registry
from hybridrl.rewards.rules import Rules, build_spec
from hybridrl.tasks.arithmetic import make_arithmetic_rows


def test_arithmetic_rows_are_chats_with_answers_and_fit_the_tiny_chat_tokenizer():
    rows = make_arithmetic_rows(200, max_operand=9, ops="+-*")
    assert {r["data_source"] for r in rows} == {"arithmetic/+-*"}
    for row in rows:
        a, op, b = row["prompt"][0]["content"][0], row["prompt"][0]["content"][1], row["prompt"][0]["content"][2]
        assert str(eval(f"{a}{op}{b}")) == row["ground_truth"]  # noqa: S307 - digits and one operator
    cfg = DataConfig(dataset="arithmetic", dataset_args={"count": 50}, max_prompt_len=7)
    prompts = tokenize_rows(load_rows(cfg), build_char_tokenizer(chat=True), cfg)
    assert all("?" not in p.prompt for p in prompts)  # every character is in the vocabulary
    rules = Rules(build_spec(RewardConfig(fn="gsm8k"), get_registry())[0])
    assert rules.score(prompts[0].prompt, prompts[0].meta["ground_truth"], prompts[0].meta) == 1.0


def test_arithmetic_splits_are_separate_draws():
    assert make_arithmetic_rows(30, split="train") != make_arithmetic_rows(30, split="val")
    assert make_arithmetic_rows(30, split="val") == make_arithmetic_rows(30, split="val")
    with pytest.raises(DataError, match=r"dataset 'arithmetic' with \{'ops': '/'\}: arithmetic: ops must be made of"):
        load_rows(DataConfig(dataset="arithmetic", dataset_args={"ops": "/"}))


@pytest.mark.skipif(importlib.util.find_spec("reasoning_gym") is None,
                    reason="reasoning-gym is not installed (pip install 'hybridrl[reasoning]')")
def test_reasoning_gym_rows_and_their_verifier():
    cfg = DataConfig(dataset="reasoning_gym", dataset_args={"name": "chain_sum", "size": 4, "seed": 1})
    rows = load_rows(cfg)
    assert len(rows) == 4 and rows[0]["data_source"] == "reasoning_gym/chain_sum"
    rules = Rules(build_spec(RewardConfig(fn="reasoning_gym"), get_registry())[0])
    row = {k: v for k, v in rows[0].items() if k != "prompt"}
    assert rules.score("q", f"thinking... <answer>{row['ground_truth']}</answer>", row) == 1.0
    assert rules.score("q", "<answer>no</answer>", row) == 0.0
