"""Procedural reasoning tasks with verifiers from ``reasoning-gym`` (``pip install 'hybridrl[reasoning]'``),
as chat rows and a reward: ``data: {dataset: reasoning_gym, dataset_args: {name: chain_sum, size: 1000}}`` with
``roles.reward.fn: reasoning_gym``.

Each row carries the task's own entry (question, answer, metadata) so that its verifier scores the response;
an answer inside ``<answer>...</answer>`` is taken from the tags, else the whole response is the answer. The
package works offline but brings a dozen dependencies and seconds of import time, and its questions use capitals
and newlines that the bundled character tokenizer lacks: it is for real tokenizers, not the tiny CPU example
(which uses ``hybridrl.tasks.arithmetic``).
"""

from __future__ import annotations

import re
from typing import Any

INSTALL = "pip install 'hybridrl[reasoning]'  (or: pip install reasoning-gym)"
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _reasoning_gym() -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise ValueError(f"the reasoning_gym dataset and reward need the reasoning-gym package: {INSTALL}") from None
    return reasoning_gym


def make_reasoning_gym_rows(name: str, size: int = 500, seed: int = 0, **config: Any) -> list[dict[str, Any]]:
    """``size`` problems of the reasoning-gym task ``name`` (``config``: the task's own options)."""
    rg = _reasoning_gym()
    dataset = rg.create_dataset(name, size=size, seed=seed, **config)
    return [{"prompt": [{"role": "user", "content": entry["question"]}], "ground_truth": entry["answer"],
             "data_source": f"reasoning_gym/{name}", "reasoning_gym": {"name": name, "entry": dict(entry)}}
            for entry in dataset]


def reasoning_gym_reward(prompt: str, response: str, reasoning_gym: dict[str, Any] | None = None, **_: Any) -> float:
    """The task's verifier on the response's answer (inside ``<answer>`` tags when there are some)."""
    if reasoning_gym is None:
        raise ValueError("the reasoning_gym reward scores rows of the reasoning_gym dataset (no 'reasoning_gym' field)")
    rg = _reasoning_gym()
    found = _ANSWER.findall(response)
    answer = found[-1].strip() if found else response.strip()
    return float(rg.get_score_answer_fn(reasoning_gym["name"])(answer, reasoning_gym["entry"]))
