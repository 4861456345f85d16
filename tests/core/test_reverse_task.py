import itertools
import json
from pathlib import Path

import pytest

from hybridrl.model.tokenizer import build_char_tokenizer
from hybridrl.plugins.registry import Registry
from hybridrl.tasks import plugin as task_plugin
from hybridrl.tasks.reverse import answer_for, main, make_reverse_rows, reverse_reward

REPO = Path(__file__).resolve().parents[2]


def test_all_rows_when_count_is_none():
    rows = make_reverse_rows(2)
    assert len(rows) == 100
    assert rows[47] == {"prompt": "rev 47=", "answer": "74"}
    assert rows[5] == {"prompt": "rev 05=", "answer": "50"}
    assert len({r["prompt"] for r in rows}) == 100
    assert all(r["answer"] == r["prompt"][4:6][::-1] for r in rows)
    assert len(make_reverse_rows(1)) == 10


def test_sampled_rows_are_seeded():
    a = make_reverse_rows(3, count=20, seed=1)
    assert a == make_reverse_rows(3, count=20, seed=1)
    assert a != make_reverse_rows(3, count=20, seed=2)
    assert len({r["prompt"] for r in a}) == 20  # without replacement while possible
    assert len(make_reverse_rows(1, count=25, seed=0)) == 25  # with replacement beyond 10**n


def test_prompt_is_short_in_tokens():
    tok = build_char_tokenizer()
    assert len(tok.encode(make_reverse_rows(2)[0]["prompt"])) == 7


@pytest.mark.parametrize("response, expected", [
    ("74", 1.0),
    ("74<eos>", 1.0),
    (" 74 ", 1.0),
    ("74<eos>junk", 1.0),
    ("74<eos><pad><pad>", 1.0),
    ("71", 0.3),         # well formed, first position right
    ("14", 0.3),         # well formed, second position right
    ("47", 0.1),         # right digits, wrong places: only the format
    ("99", 0.1),
    ("740", 0.4),        # wrong length: the positions still count
    ("7", 0.2),
    ("7a", 0.2),         # not all digits: no format credit
    ("", 0.0),           # empty
    ("<eos>74", 0.0),    # nothing before the EOS
])
def test_reward_table(response, expected):
    assert reverse_reward("rev 47=", response, "74") == pytest.approx(expected)


def test_answer_derived_from_prompt_when_missing():
    assert answer_for("rev 47=") == "74"
    assert reverse_reward("rev 47=", "74") == 1.0
    assert reverse_reward("rev 120=", "021") == 1.0
    assert reverse_reward("rev 120=", "001") == pytest.approx(0.1 + 0.4 * 2 / 3)
    with pytest.raises(ValueError, match="not a reverse prompt"):
        reverse_reward("hello", "74")


def test_extra_metadata_is_accepted():
    assert reverse_reward("rev 47=", "74", answer="74", data_source="reverse", index=3) == 1.0


@pytest.mark.parametrize("n_digits", [1, 2, 3])
def test_a_policy_ignoring_the_prompt_scores_at_most_0_3(n_digits):
    rows = make_reverse_rows(n_digits)
    constants = ["".join(d) for d in itertools.product("0123456789", repeat=n_digits)]
    candidates = constants[:: max(1, len(constants) // 100)] + ["", "1" * (n_digits + 1)]
    best = max(sum(reverse_reward(r["prompt"], c, r["answer"]) for r in rows) / len(rows) for c in candidates)
    assert best <= 0.3
    # and a policy that does reverse gets everything
    assert all(reverse_reward(r["prompt"], r["answer"]) == 1.0 for r in rows)


def test_bundled_file_matches_the_generator(tmp_path):
    out = tmp_path / "r.jsonl"
    assert main(["--digits", "2", "--out", str(out)]) == 0
    bundled = REPO / "examples" / "data" / "reverse2.jsonl"
    assert out.read_text() == bundled.read_text()
    rows = [json.loads(line) for line in bundled.read_text().splitlines()]
    assert rows == make_reverse_rows(2)


def test_plugin_registers_reward_and_dataset():
    registry = Registry()
    task_plugin.hybridrl_register_rewards(registry)
    task_plugin.hybridrl_register_datasets(registry)
    assert registry.get("reward", "reverse") is reverse_reward
    assert registry.get("dataset", "reverse") is make_reverse_rows


def test_plugin_is_found_through_entry_points():
    from hybridrl.plugins.discovery import get_registry

    registry = get_registry()
    assert "reverse" in registry.names("reward")
    assert "reverse" in registry.names("dataset")
    assert registry.backend("rollout", "hf").target == "hybridrl.rollout.hf:HFRollout"
