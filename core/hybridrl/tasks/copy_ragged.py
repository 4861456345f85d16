"""A long-tailed synthetic task: copy a string whose length is drawn from a lognormal.

Prompt ``cp abba=``, answer ``abba``. Lengths run from 1 to 64 characters (median 6, sigma 1.0 by default), so a
step's responses are ragged with a long tail, as reasoning responses are, while a tiny model still learns on a
CPU: the reward gives credit for stopping at the right length and for each character in its place, which a
freshly initialised policy improves on within a few dozen steps.

Registered as the reward and the dataset ``copy_ragged``. Regenerate the bundled data file with::

    python -m hybridrl.tasks.copy_ragged --out examples/data/copy_ragged.jsonl
"""

from __future__ import annotations

import argparse
import math
import random
import re
import sys
from typing import Any

from hybridrl.tasks.reverse import clean_response, write_jsonl

PROMPT_PREFIX = "cp "
PROMPT_SUFFIX = "="
ALPHABET = "ab"
MAX_LEN = 64
#: weights of the partial credit of a wrong answer (an exact copy scores 1.0): characters in place, length.
POSITION_WEIGHT = 0.5
LENGTH_WEIGHT = 0.3

_PROMPT_RE = re.compile(r"cp\s*([a-z]+)\s*=")


def make_prompt(text: str) -> str:
    return f"{PROMPT_PREFIX}{text}{PROMPT_SUFFIX}"


def draw_length(rng: random.Random, median: float, sigma: float, max_len: int = MAX_LEN) -> int:
    """One length from a lognormal of this median and sigma, rounded and clipped to ``1..max_len``."""
    return min(max_len, max(1, round(math.exp(rng.gauss(math.log(median), sigma)))))


def make_copy_ragged_rows(count: int = 512, median: float = 6.0, sigma: float = 1.0, max_len: int = MAX_LEN,
                          alphabet: str = ALPHABET, seed: int = 0) -> list[dict[str, str]]:
    """``count`` rows ``{"prompt": "cp abba=", "answer": "abba"}``: each string's length is drawn from a seeded
    lognormal (``median``, ``sigma``) clipped to ``1..max_len``, its characters uniformly from ``alphabet``."""
    if count <= 0 or median <= 0 or sigma < 0 or max_len <= 0:
        raise ValueError(f"copy_ragged: count, median and max_len must be positive and sigma >= 0, got "
                         f"{count}, {median}, {max_len}, {sigma}")
    if not alphabet or not alphabet.isalpha() or not alphabet.islower():
        raise ValueError(f"copy_ragged: alphabet must be lowercase letters, got {alphabet!r}")
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        text = "".join(rng.choice(alphabet) for _ in range(draw_length(rng, median, sigma, max_len)))
        rows.append({"prompt": make_prompt(text), "answer": text})
    return rows


def answer_for(prompt: str) -> str:
    """The expected answer of a prompt: its string, unchanged."""
    match = _PROMPT_RE.search(prompt)
    if match is None:
        raise ValueError(f"not a copy prompt (expected like 'cp abba='): {prompt!r}")
    return match.group(1)


def copy_ragged_reward(prompt: str, response: str, answer: str | None = None, **meta: Any) -> float:
    """1.0 for the exact copy; otherwise ``0.5 * (characters in place) / (the longer length)`` plus
    ``0.3 * (the shorter length) / (the longer length)``. Dividing by the longer length makes a response that
    runs on cost credit, so a policy must learn where to stop as well as what to write."""
    target = str(answer).strip() if answer is not None else answer_for(prompt)
    got = clean_response(response)
    if got == target:
        return 1.0
    longer = max(len(got), len(target))
    right = sum(a == b for a, b in zip(got, target))
    return POSITION_WEIGHT * right / longer + LENGTH_WEIGHT * min(len(got), len(target)) / longer


copy_ragged_reward.inline_safe = True  # type: ignore[attr-defined]  # a string comparison: runs inline by default


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridrl.tasks.copy_ragged",
                                     description="Write copy-task prompt rows of lognormal lengths as jsonl.")
    parser.add_argument("--count", type=int, default=512)
    parser.add_argument("--median", type=float, default=6.0, help="the lengths' median, in characters")
    parser.add_argument("--sigma", type=float, default=1.0, help="the lognormal's sigma")
    parser.add_argument("--max-len", type=int, default=MAX_LEN)
    parser.add_argument("--alphabet", default=ALPHABET)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="output .jsonl file")
    args = parser.parse_args(argv)
    rows = make_copy_ragged_rows(args.count, args.median, args.sigma, args.max_len, args.alphabet, args.seed)
    path = write_jsonl(rows, args.out)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
