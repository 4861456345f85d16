"""A procedural arithmetic task in chat form, sized for the bundled tiny model on a CPU.

Each row is a verl-style chat row: ``prompt`` a one-message chat (``3+4=``), ``ground_truth`` the answer,
``data_source`` ``arithmetic/<ops>``. The ``gsm8k`` reward checks the answer (its last number), so nothing about
the task is special-cased in the trainer. Operands are drawn from ``0..max_operand``; ``split`` picks disjoint
seeds so that ``train`` and ``val`` are separate draws of the same distribution (with one-digit operands there
are only 100 distinct problems, so a draw repeats some of them: the validation set measures the policy's
greedy accuracy on the task, not generalisation to unseen problems).

Registered as the dataset ``arithmetic``: ``data: {dataset: arithmetic, dataset_args: {count: 512}}``.
"""

from __future__ import annotations

import random
from typing import Any

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
SPLIT_SEEDS = {"train": 0, "val": 1_000_003}


def make_arithmetic_rows(count: int = 512, max_operand: int = 9, ops: str = "+", split: str = "train",
                         seed: int = 0) -> list[dict[str, Any]]:
    """``count`` problems ``a<op>b=`` with ``a, b`` in ``0..max_operand`` and ``op`` drawn from ``ops``."""
    if count <= 0 or max_operand < 0:
        raise ValueError(f"arithmetic: count must be positive and max_operand >= 0, got {count}, {max_operand}")
    unknown = set(ops) - set(OPS)
    if not ops or unknown:
        raise ValueError(f"arithmetic: ops must be made of {''.join(OPS)}, got {ops!r}")
    if split not in SPLIT_SEEDS:
        raise ValueError(f"arithmetic: split must be one of {', '.join(SPLIT_SEEDS)}, got {split!r}")
    rng = random.Random(seed * 7_919 + SPLIT_SEEDS[split])
    rows = []
    for _ in range(count):
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(ops)
        rows.append({"prompt": [{"role": "user", "content": f"{a}{op}{b}="}], "ground_truth": str(OPS[op](a, b)),
                     "data_source": f"arithmetic/{ops}"})
    return rows
