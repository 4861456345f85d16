"""The bundled synthetic task: reverse a digit string.

Prompt ``rev 47=``, answer ``74``. The reward is 1.0 for the exact answer and a capped partial credit for
answers of the right length, so that a policy that ignores the prompt cannot score more than 0.3 on average.

Regenerate the bundled data file with::

    python -m hybridrl.tasks.reverse --digits 2 --out examples/data/reverse2.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path
from typing import Any

PROMPT_PREFIX = "rev "
PROMPT_SUFFIX = "="
#: weight of the per-position credit for a wrong answer of the right length (exact answers score 1.0).
PARTIAL_WEIGHT = 0.4
FORMAT_WEIGHT = 0.1
EOS_MARKERS = ("<eos>",)  # as decoded by the character tokenizer with special tokens kept
PAD_MARKER = "<pad>"

_PROMPT_RE = re.compile(r"rev\s*(\d+)\s*=")


def make_prompt(digits: str) -> str:
    return f"{PROMPT_PREFIX}{digits}{PROMPT_SUFFIX}"


def make_reverse_rows(n_digits: int = 2, count: int | None = None, seed: int = 0) -> list[dict[str, str]]:
    """Rows ``{"prompt": "rev 47=", "answer": "74"}`` over digit strings of length ``n_digits`` (leading zeros
    included). ``count=None``: all ``10**n_digits`` strings in order; otherwise ``count`` strings drawn
    without replacement (with replacement when ``count`` exceeds the number of strings) by ``seed``."""
    if n_digits <= 0:
        raise ValueError(f"n_digits must be positive, got {n_digits}")
    total = 10 ** n_digits
    if count is None:
        numbers = list(range(total))
    else:
        if count <= 0:
            raise ValueError(f"count must be positive, got {count}")
        rng = random.Random(seed)
        numbers = rng.sample(range(total), count) if count <= total else [rng.randrange(total) for _ in range(count)]
    rows = []
    for n in numbers:
        digits = str(n).zfill(n_digits)
        rows.append({"prompt": make_prompt(digits), "answer": digits[::-1]})
    return rows


def answer_for(prompt: str) -> str:
    """The expected answer of a prompt: its digit string reversed."""
    match = _PROMPT_RE.search(prompt)
    if match is None:
        raise ValueError(f"not a reverse prompt (expected like 'rev 47='): {prompt!r}")
    return match.group(1)[::-1]


def clean_response(response: str) -> str:
    """The response up to its first EOS marker, without pad markers, stripped of surrounding whitespace."""
    for marker in EOS_MARKERS:
        response = response.split(marker, 1)[0]
    return response.replace(PAD_MARKER, "").strip()


def reverse_reward(prompt: str, response: str, answer: str | None = None, **meta: Any) -> float:
    """1.0 for the exact answer; otherwise partial credit that gives a randomly initialised policy a
    gradient to follow: ``0.4 * (fraction of answer positions holding the right digit)``, plus
    ``0.1`` when the response is a digit string of the right length.

    A policy that ignores the prompt answers the same distribution of strings to every prompt; each
    position is then right with probability 1/10, so its expected reward is at most
    ``0.1**n + 0.1 + 0.04`` <= 0.25 (n digits), under 0.3.
    """
    target = str(answer).strip() if answer is not None else answer_for(prompt)
    got = clean_response(response)
    if got == target:
        return 1.0
    right = sum(a == b for a, b in zip(got, target))
    well_formed = len(got) == len(target) and got.isdigit()
    return FORMAT_WEIGHT * well_formed + PARTIAL_WEIGHT * right / len(target)


reverse_reward.inline_safe = True  # type: ignore[attr-defined]  # a string comparison: runs inline by default


def write_jsonl(rows: list[dict[str, Any]], out: str | Path) -> Path:
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridrl.tasks.reverse",
                                     description="Write reverse-task prompt rows as jsonl.")
    parser.add_argument("--digits", type=int, default=2, help="length of the digit strings")
    parser.add_argument("--count", type=int, default=None, help="number of rows (default: all 10**digits)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="output .jsonl file")
    args = parser.parse_args(argv)
    path = write_jsonl(make_reverse_rows(args.digits, args.count, args.seed), args.out)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
