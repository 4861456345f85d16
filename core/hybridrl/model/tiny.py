"""A tiny Qwen2 causal LM built in code (no download) with the bundled character tokenizer (or its chat
variant, or any saved tokenizer: ``model.tiny.tokenizer``); with ``model.tiny.num_experts`` a tiny Qwen3-MoE
(routed experts in every layer, top-``experts_per_token``), so mixture-of-experts training runs on a CPU too.

``build_tiny_model(cfg, out_dir)`` writes an ordinary Hugging Face checkpoint folder (safetensors weights,
``config.json``, ``generation_config.json`` and the tokenizer), so every backend loads it like any other model.
The same config always gives bit-identical weights, and a folder already built from the same config is reused.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from hybridrl.config import TinyModelConfig
from hybridrl.model.tokenizer import build_char_tokenizer, load_tokenizer

#: the file that marks a folder as built by ``build_tiny_model`` and records what it was built from.
MARKER = "hybridrl_tiny.json"
#: bump when the way the model is built changes, so old folders are rebuilt.
FORMAT_VERSION = 1


#: ``model.tiny.tokenizer`` values naming the bundled tokenizers (anything else is a tokenizer folder).
BUNDLED_TOKENIZERS = ("char", "char_chat")


#: transformers' default initializer_range, the tiny model's unless ``model.tiny.init_std`` says otherwise.
DEFAULT_INIT_STD = 0.02


def tiny_tokenizer(cfg: TinyModelConfig) -> Any:
    """The tokenizer a tiny model is built with: the bundled character one (``char``), its chat variant
    (``char_chat``), or the one saved in the folder ``cfg.tokenizer``."""
    if cfg.tokenizer in BUNDLED_TOKENIZERS:
        return build_char_tokenizer(chat=cfg.tokenizer == "char_chat")
    folder = Path(cfg.tokenizer)
    if not folder.is_dir():
        raise ValueError(f"tiny model: tokenizer '{cfg.tokenizer}' is neither {' nor '.join(BUNDLED_TOKENIZERS)} "
                         "nor a folder")
    return load_tokenizer(folder)


def tokenizer_problem(cfg: TinyModelConfig) -> str | None:
    """Why ``cfg.tokenizer`` cannot be used, or None (checked before anything is built)."""
    if cfg.tokenizer in BUNDLED_TOKENIZERS:
        return None
    folder = Path(cfg.tokenizer)
    if not folder.is_dir():
        return f"'{folder}' is neither {' nor '.join(BUNDLED_TOKENIZERS)} nor a folder"
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return f"'{folder}' holds no tokenizer (no tokenizer.json or tokenizer_config.json)"
    return None


def _spec(cfg: TinyModelConfig, tokenizer: Any) -> dict[str, Any]:
    vocab = json.dumps(sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]))
    config = cfg.model_dump(mode="json")
    spec = {
        "format": FORMAT_VERSION,
        "config": config,
        "vocab_sha256": hashlib.sha256(vocab.encode()).hexdigest(),
    }
    if cfg.tokenizer != "char":  # the plain char model's spec stays as it was (its folders are reused)
        spec["chat_template_sha256"] = hashlib.sha256(str(getattr(tokenizer, "chat_template", "")).encode()).hexdigest()
    else:
        del config["tokenizer"]
    if cfg.init_std == DEFAULT_INIT_STD:  # as before the key existed: those folders are reused
        del config["init_std"]
    if not cfg.num_experts:  # a dense model's spec stays as it was before the MoE keys existed
        for key in ("num_experts", "experts_per_token", "moe_intermediate_size"):
            del config[key]
    return spec


def _read_marker(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _check(cfg: TinyModelConfig) -> None:
    if cfg.hidden_size % cfg.num_heads:
        raise ValueError(f"tiny model: hidden_size {cfg.hidden_size} is not divisible by num_heads {cfg.num_heads}")
    if cfg.num_heads % cfg.num_kv_heads:
        raise ValueError(f"tiny model: num_heads {cfg.num_heads} is not divisible by num_kv_heads {cfg.num_kv_heads}")
    if (cfg.hidden_size // cfg.num_heads) % 2:
        raise ValueError(f"tiny model: head size {cfg.hidden_size // cfg.num_heads} must be even (rotary embeddings)")
    if cfg.num_experts and cfg.experts_per_token > cfg.num_experts:
        raise ValueError(f"tiny model: experts_per_token {cfg.experts_per_token} exceeds num_experts "
                         f"{cfg.num_experts}")


def tiny_hf_config(cfg: TinyModelConfig, tokenizer: Any | None = None) -> Any:
    """The ``Qwen2Config`` (``Qwen3MoeConfig`` with ``num_experts``) ``build_tiny_model`` builds from ``cfg``
    (nothing is written: pre-flight compares it with a checkpoint's before the model folder is built)."""
    from transformers import Qwen2Config, Qwen3MoeConfig

    tokenizer = tokenizer if tokenizer is not None else tiny_tokenizer(cfg)
    shared = dict(vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                  num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                  num_key_value_heads=cfg.num_kv_heads, max_position_embeddings=cfg.max_position,
                  initializer_range=cfg.init_std, tie_word_embeddings=True, use_sliding_window=False,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
    if not cfg.num_experts:
        return Qwen2Config(**shared)
    # a Qwen3-MoE: every layer's MLP is ``num_experts`` routed experts of width ``cfg.expert_size``, each token
    # going to its top ``experts_per_token`` (their weights renormalised, as Qwen3-30B-A3B does); the
    # load-balancing coefficient is transformers' default. Its head is its own (untied), as in every Qwen3-MoE
    # checkpoint: SGLang's Qwen3-MoE always loads ``lm_head.weight`` and ignores ``tie_word_embeddings``
    return Qwen3MoeConfig(**{**shared, "tie_word_embeddings": False}, moe_intermediate_size=cfg.expert_size,
                          num_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                          norm_topk_prob=True, head_dim=cfg.hidden_size // cfg.num_heads)


def _write(cfg: TinyModelConfig, tokenizer: Any, folder: Path, spec: dict[str, Any]) -> None:
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = tiny_hf_config(cfg, tokenizer)
    # Seed a private copy of the global RNG: the same cfg gives the same weights, and the caller's random
    # state is left untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a one-shard "Writing model shards" bar is noise in worker logs
    try:
        model.save_pretrained(str(folder), safe_serialization=True)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(str(folder))
    (folder / MARKER).write_text(json.dumps(spec, indent=2, sort_keys=True) + "\n")


def build_tiny_model(cfg: TinyModelConfig, out_dir: str | Path) -> Path:
    """Build (or reuse) the tiny model for ``cfg`` in ``out_dir``; returns the folder.

    A folder built earlier from the same config (recorded in ``hybridrl_tiny.json``) is reused as is; one
    built from another config is replaced. A non-empty folder that this function did not build is never
    overwritten (``FileExistsError``). The folder is written next to its final place and then renamed into
    it, so concurrent builders (several workers on one machine) never see a half-written model.
    """
    _check(cfg)
    out = Path(out_dir)
    tokenizer = tiny_tokenizer(cfg)
    spec = _spec(cfg, tokenizer)
    if _read_marker(out) == spec:
        return out
    if out.exists():
        if not out.is_dir():
            raise FileExistsError(f"tiny model folder '{out}' exists and is not a folder")
        if any(out.iterdir()) and _read_marker(out) is None:
            raise FileExistsError(
                f"'{out}' is not empty and was not built by build_tiny_model; refusing to overwrite it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _write(cfg, tokenizer, tmp, spec)
        if out.exists():
            if _read_marker(out) == spec:  # another process finished first
                return out
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / "model")
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.replace(tmp, out)
        except OSError:
            if _read_marker(out) == spec:  # lost a race against an identical build
                return out
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
