"""Small datasets and tokenizers in the formats users bring, made in code (nothing is downloaded).

- ``build_chat_tokenizer(style, out)``: a byte-level BPE tokenizer folder as Qwen2.5-Instruct (ChatML,
  ``Qwen2Tokenizer``) or Llama 3 Instruct (header tokens, a BOS its post-processor adds) save them:
  ``tokenizer.json`` + ``tokenizer_config.json`` with the ``chat_template`` in it, trained on the fixture texts
  so that it stays a few tens of kB.
- ``write_fixtures(out)``: GSM8K- and MATH-style rows in verl's parquet schema (``prompt`` as messages,
  ``data_source``, ``ability``, ``reward_model: {style, ground_truth}``, ``extra_info``) and in TRL's common
  columns (``prompt`` as messages with ``answer``; text with ``solution``), plus the Qwen2-style tokenizer.

Regenerate the committed fixtures with::

    python -m hybridrl.data.fixtures --out tests/fixtures/data
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

#: verl's GSM8K preprocessing appends this instruction to the question.
GSM8K_INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."
#: ... and MATH's asks for a boxed answer.
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."

QWEN2_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' -%}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' }}{%- endif -%}"
)
LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif -%}"
)
#: the split regex of Qwen2's and Llama 3's byte-level pre-tokenizers.
_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")

_NAMES = ["natalia", "weng", "betty", "julie", "james", "albert", "ken", "alexis", "tina", "mark"]
_ITEMS = ["clips", "apples", "books", "pencils", "cookies", "marbles", "stickers", "tickets"]


# --- rows ------------------------------------------------------------------------------------------

def gsm8k_items(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """GSM8K-like word problems (question, worked solution ending ``#### n``, answer n)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        name, item = rng.choice(_NAMES).capitalize(), rng.choice(_ITEMS)
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        if i % 2:
            question = f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?"
            total, step = a + b, f"{a} + {b} = {a + b}"
        else:
            question = f"{name} sells {item} for ${a} each and sells {b} of them. How many dollars does {name} earn?"
            total, step = a * b, f"{a} * {b} = {a * b}"
        out.append({"question": question, "solution": f"{name} gets {step}.\n#### {total:,}", "answer": str(total)})
    return out


def math_items(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """MATH-like problems whose answers are LaTeX (fractions, square roots, integers)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        a, b = rng.randint(1, 9), rng.randint(2, 9)
        kind = i % 3
        if kind == 0:
            question, answer = f"Simplify $\\frac{{{a * 2}}}{{{b * 2}}}$.", _fraction(a, b)
        elif kind == 1:
            a, b = a + 1, (2, 3, 5, 6, 7)[b % 5]  # a square-free b: a*sqrt(b) is the simplest form
            question, answer = f"What is $\\sqrt{{{a * a * b}}}$ in simplest form?", f"{a}\\sqrt{{{b}}}"
        else:
            question, answer = f"Compute ${a} \\cdot {b} - {a}$.", str(a * b - a)
        out.append({"problem": question, "solution": f"The answer is $\\boxed{{{answer}}}$.", "answer": answer,
                    "level": f"Level {1 + i % 5}", "type": "Algebra"})
    return out


def _fraction(a: int, b: int) -> str:
    from math import gcd

    g = gcd(a, b)
    a, b = a // g, b // g
    return str(a) if b == 1 else f"\\frac{{{a}}}{{{b}}}"


def verl_gsm8k_rows(items: list[dict[str, Any]], split: str = "train") -> list[dict[str, Any]]:
    """Rows as verl's ``examples/data_preprocess/gsm8k.py`` writes them."""
    return [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "user", "content": f"{it['question']} {GSM8K_INSTRUCTION}"}],
             "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": it["answer"]},
             "extra_info": {"split": split, "index": i, "answer": it["solution"], "question": it["question"]}}
            for i, it in enumerate(items)]


def verl_math_rows(items: list[dict[str, Any]], split: str = "train") -> list[dict[str, Any]]:
    """Rows as verl's MATH preprocessing writes them (``ground_truth``: the boxed answer)."""
    return [{"data_source": "DigitalLearningGmbH/MATH-lighteval",
             "prompt": [{"role": "user", "content": f"{it['problem']} {MATH_INSTRUCTION}"}],
             "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": it["answer"]},
             "extra_info": {"split": split, "index": i}}
            for i, it in enumerate(items)]


def trl_gsm8k_rows(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """TRL's conversational prompt-only layout: ``prompt`` as messages, the reference in ``answer``."""
    return [{"prompt": [{"role": "system", "content": "Answer with the final number after ####."},
                        {"role": "user", "content": it["question"]}],
             "answer": it["answer"]} for it in items]


def trl_math_rows(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """TRL's standard (text) prompt-only layout with a ``solution`` column (as in its MATH examples)."""
    return [{"prompt": f"{it['problem']} Put the final answer in \\boxed{{}}.", "solution": it["solution"]}
            for it in items]


# --- tokenizers ------------------------------------------------------------------------------------

def _corpus() -> list[str]:
    texts = []
    for it in gsm8k_items(64, seed=1):
        texts += [it["question"], it["solution"], GSM8K_INSTRUCTION]
    for it in math_items(30, seed=1):
        texts += [it["problem"], it["solution"], MATH_INSTRUCTION]
    texts += ["You are Qwen, created by Alibaba Cloud. You are a helpful assistant.", "system user assistant",
              "Answer with the final number after ####.", "The answer is 42. So the total is 1,234 dollars."]
    texts += [" ".join(str(n) for n in range(0, 1000, 7))]
    return texts


def build_chat_tokenizer(style: str, out: str | Path, corpus: Iterable[str] | None = None,
                         vocab_size: int = 600) -> Path:
    """Write a tokenizer folder in the style of ``qwen2`` (Qwen2.5-Instruct) or ``llama3`` (Llama 3 Instruct):
    a byte-level BPE trained on ``corpus`` (default: the fixture texts), its special tokens, and a
    ``tokenizer_config.json`` holding the chat template, as those checkpoints ship them."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    if style not in ("qwen2", "llama3"):
        raise ValueError(f"unknown tokenizer style '{style}' (qwen2 or llama3)")
    specials = (["<|endoftext|>", "<|im_start|>", "<|im_end|>"] if style == "qwen2" else
                ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])
    tok = Tokenizer(models.BPE())
    if style == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(corpus) if corpus is not None else _corpus(), trainer)
    if style == "llama3":  # Llama 3 adds its BOS on encode; a rendered template already holds one
        bos = "<|begin_of_text|>"
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    added = {str(tok.token_to_id(s)): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                                       "single_word": False, "special": True} for s in specials}
    if style == "qwen2":
        config = {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
                  "pad_token": "<|endoftext|>", "chat_template": QWEN2_CHAT_TEMPLATE, "errors": "replace",
                  "split_special_tokens": False, "add_prefix_space": False}
    else:
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
                  "eos_token": "<|eot_id|>", "chat_template": LLAMA3_CHAT_TEMPLATE}
    config.update({"added_tokens_decoder": added, "clean_up_tokenization_spaces": False, "model_max_length": 131072})
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


# --- files -----------------------------------------------------------------------------------------

def write_parquet(rows: list[dict[str, Any]], path: str | Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return path


def write_jsonl(rows: list[dict[str, Any]], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_fixtures(out: str | Path, train: int = 16, val: int = 8) -> list[Path]:
    """The fixture set under ``out``; returns the files and folders written."""
    out = Path(out)
    gsm_train, gsm_val = gsm8k_items(train, seed=0), gsm8k_items(val, seed=100)
    math_train = math_items(train, seed=0)
    return [
        write_parquet(verl_gsm8k_rows(gsm_train), out / "verl_gsm8k_train.parquet"),
        write_parquet(verl_gsm8k_rows(gsm_val, "test"), out / "verl_gsm8k_val.parquet"),
        write_parquet(verl_math_rows(math_train), out / "verl_math_train.parquet"),
        write_parquet(trl_gsm8k_rows(gsm_train), out / "trl_gsm8k_train.parquet"),
        write_jsonl(trl_math_rows(math_train), out / "trl_math_train.jsonl"),
        build_chat_tokenizer("qwen2", out / "qwen2_tokenizer"),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridrl.data.fixtures", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder to write the fixtures into")
    parser.add_argument("--train", type=int, default=16, help="rows per training file")
    parser.add_argument("--val", type=int, default=8, help="rows of the validation file")
    args = parser.parse_args(argv)
    for path in write_fixtures(args.out, args.train, args.val):
        print(path, file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
