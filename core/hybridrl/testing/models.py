"""The kit's own tiny models: two Qwen2 checkpoints built in code, saved as ordinary HF folders, and a GPT-2
one (``build_absolute_position_model``) whose learned absolute positions make a left-padded batch show
position ids that count from the padding (rotary models only see relative positions, so they cannot).

``policy`` is what every engine is built from; ``other`` has the same architecture and different weights (what
``import_weights`` and the bridge bring in). Both carry the bundled character tokenizer, so an engine that
loads a tokenizer (vLLM, SGLang) finds one. The policy's EOS embedding is scaled until greedy decoding of the
kit's prompts ends some rows early and leaves others running to the full width, so the EOS and padding
contracts are exercised on every run, not only when the random weights happen to produce an EOS.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

#: prompts of several lengths (left padding is exercised) in the character vocabulary.
KIT_PROMPTS = ("rev 47=", "rev 1234567=", "a", "rev 00=", "x 9=", "hello world")
#: decoding width of the rollout checks; the EOS tuning targets it.
KIT_WIDTH = 8
MARKER = "hybridrl_kit.json"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class KitModelSpec:
    """Architecture of the kit's models. head size 64 (hidden / heads) suits every attention kernel."""

    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 1
    max_position: int = 64
    init_std: float = 0.2  # wider than the default: peaky distributions, few near-ties under greedy decoding
    tie_word_embeddings: bool = True
    seed: int = 0
    other_seed: int = 1


@dataclass(frozen=True)
class KitModels:
    """Where the kit's models are and the facts the checks need about them."""

    policy: Path
    other: Path
    eos_ids: tuple[int, ...]
    pad_id: int
    vocab_size: int
    context_length: int
    prompts: tuple[tuple[int, ...], ...]


def _tokenizer():
    from hybridrl.model.tokenizer import build_char_tokenizer

    return build_char_tokenizer()


def _config(spec: KitModelSpec, tok):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=len(tok), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                       num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
                       num_key_value_heads=spec.num_kv_heads, max_position_embeddings=spec.max_position,
                       initializer_range=spec.init_std, tie_word_embeddings=spec.tie_word_embeddings,
                       use_sliding_window=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id)


def _random_model(spec: KitModelSpec, tok, seed: int):
    from transformers import GenerationConfig, Qwen2ForCausalLM

    with torch.random.fork_rng(devices=[]):  # the caller's random state is left alone
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(_config(spec, tok)).to(torch.float32).eval()
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    return model


@torch.no_grad()
def _eos_banned_path(model, prompts: tuple[tuple[int, ...], ...], eos: int, width: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decoding with EOS banned (one batched, uncached forward per step): ``(eos_logit, best_other)``,
    each ``(rows, width)``, at every step."""
    from hybridrl.engines.batch import left_pad

    ids, mask = left_pad([list(p) for p in prompts], pad_id=0)
    eos_logit = torch.zeros(len(prompts), width)
    best_other = torch.zeros(len(prompts), width)
    for step in range(width):
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1].float()
        eos_logit[:, step] = logits[:, eos]
        logits[:, eos] = float("-inf")
        best = logits.max(dim=-1)
        best_other[:, step] = best.values
        ids = torch.cat([ids, best.indices[:, None]], dim=1)
        mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=mask.dtype)], dim=1)
    return eos_logit, best_other


def _tune_eos(model, prompts: tuple[tuple[int, ...], ...], eos: int, width: int) -> float:
    """Scale the EOS row of the output embedding until greedy decoding stops some rows at a step in
    ``[1, width - 2]`` and never stops others; returns the scale.

    The EOS logit is linear in that row (no LM-head bias) and, since an EOS is never fed back, nothing
    before a row's first EOS depends on it: under scale ``c`` the first EOS is the first step of the
    EOS-banned greedy path where ``c * eos_logit`` beats the best other token. One pass serves every scale."""
    eos_logit, best_other = _eos_banned_path(model, prompts, eos, width)
    for scale in (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0):
        wins = eos_logit * scale > best_other
        firsts = [int(row.nonzero()[0]) if row.any() else None for row in wins]
        if any(f is not None and 1 <= f <= width - 2 for f in firsts) and any(f is None for f in firsts):
            with torch.no_grad():
                model.get_output_embeddings().weight[eos] *= scale
            return scale
    raise RuntimeError("kit model: no EOS scale stops some greedy rows early and leaves others at full width")


def _digest(spec: KitModelSpec) -> str:
    import transformers

    text = json.dumps({"spec": asdict(spec), "format": FORMAT_VERSION, "transformers": transformers.__version__},
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _save(model, tok, folder: Path) -> None:
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(str(folder), safe_serialization=True)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    tok.save_pretrained(str(folder))


def build_kit_models(root: str | Path, spec: KitModelSpec = KitModelSpec()) -> KitModels:
    """Build (or reuse, when ``root`` already holds this spec's build) the policy and other models."""
    tok = _tokenizer()
    prompts = tuple(tuple(tok.encode(p)) for p in KIT_PROMPTS)
    folder = Path(root) / f"kit-{_digest(spec)}"
    marker = folder / MARKER
    if not marker.is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".kit-", dir=folder.parent))
        try:
            policy = _random_model(spec, tok, spec.seed)
            scale = _tune_eos(policy, prompts, tok.eos_token_id, KIT_WIDTH)
            other = _random_model(spec, tok, spec.other_seed)
            _save(policy, tok, tmp / "policy")
            _save(other, tok, tmp / "other")
            (tmp / MARKER).write_text(json.dumps({"spec": asdict(spec), "eos_scale": scale}, indent=2))
            if not marker.is_file():  # another builder may have won the race
                shutil.rmtree(folder, ignore_errors=True)
                tmp.rename(folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return KitModels(policy=folder / "policy", other=folder / "other", eos_ids=(tok.eos_token_id,),
                     pad_id=tok.pad_token_id, vocab_size=len(tok), context_length=spec.max_position,
                     prompts=prompts)


def set_eos(folder: Path, eos: int) -> None:
    """Make ``eos`` the saved model's end-of-sequence id (config and generation config), e.g. a token its greedy
    continuations reach, so that stopping is exercised."""
    for name in ("config.json", "generation_config.json"):
        path = Path(folder) / name
        data = json.loads(path.read_text())
        data["eos_token_id"] = eos
        path.write_text(json.dumps(data))


#: architecture of the absolute-position model (GPT-2: learned position embeddings). Head size 64.
GPT2_SPEC = {"n_embd": 128, "n_layer": 2, "n_head": 2, "n_positions": 64, "initializer_range": 0.2}


def build_absolute_position_model(root: str | Path, seed: int = 0) -> Path:
    """A tiny random GPT-2 with the character tokenizer (reused when ``root`` already holds it): where a
    token's position id is added to its embedding, so position ids that count the left padding change
    every output of a padded row."""
    import transformers
    from transformers import GenerationConfig, GPT2Config, GPT2LMHeadModel

    tok = _tokenizer()
    key = json.dumps({"gpt2": GPT2_SPEC, "seed": seed, "format": FORMAT_VERSION,
                      "transformers": transformers.__version__}, sort_keys=True)
    folder = Path(root) / f"kit-gpt2-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if (folder / MARKER).is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".kit-gpt2-", dir=folder.parent))
    try:
        config = GPT2Config(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                            pad_token_id=tok.pad_token_id, **GPT2_SPEC)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = GPT2LMHeadModel(config).to(torch.float32).eval()
        model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                                   pad_token_id=tok.pad_token_id)
        _save(model, tok, tmp)
        (tmp / MARKER).write_text(key)
        if not (folder / MARKER).is_file():  # another builder may have won the race
            shutil.rmtree(folder, ignore_errors=True)
            tmp.rename(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
