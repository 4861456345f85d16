"""The bundled character-level tokenizer, built in code (no download), and a loader for saved tokenizers.

Every character of the vocabulary is one token, so a digit string of n characters is n tokens and decoding
gives the text back exactly (no spaces are inserted between tokens).

Its chat variant (``build_char_tokenizer(chat=True)``, ``model.tiny.tokenizer: char_chat``) adds one special
token per role after the characters (so every character keeps its id) and a chat template in the style of
ChatML: ``<|user|>content<eos>`` per message, ``<|assistant|>`` as the generation prompt. A turn ends with the
model's EOS, as Qwen's ``<|im_end|>`` does, so a generated answer stops where an assistant turn would.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD, EOS, BOS = "<pad>", "<eos>", "<bos>"
SPECIAL_TOKENS = (PAD, EOS, BOS)
CHARACTERS = string.digits + string.ascii_lowercase + " :=?,.+-"
# Characters outside the vocabulary encode as "?". It is deliberately not declared as the wrapper's unk_token:
# that would make it a special token, dropped by ``decode(..., skip_special_tokens=True)``.
UNK = "?"
#: role -> its special token in the chat variant (ids after the characters, in this order).
CHAT_ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>", "tool": "<|tool|>"}
CHAR_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{ raise_exception('unknown role ' + message['role'] + ' (the char_chat template knows system, user, "
    "assistant, tool)') }}"
    "{%- endif -%}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '" + EOS + "' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>' }}{%- endif -%}"
)


def build_char_tokenizer(chat: bool = False) -> PreTrainedTokenizerFast:
    """Character-level tokenizer: ids 0,1,2 are ``<pad>``, ``<eos>``, ``<bos>``; then one id per character
    of ``CHARACTERS``. No special tokens are added automatically when encoding. ``chat``: the role tokens of
    ``CHAT_ROLE_TOKENS`` follow, and ``CHAR_CHAT_TEMPLATE`` is the tokenizer's chat template."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARACTERS:
        vocab[ch] = len(vocab)
    # WordLevel over single characters: the Split pre-tokenizer with an empty pattern cuts the text into
    # characters (keeping spaces as their own pieces), so each character is looked up on its own.
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()  # join the pieces with nothing in between
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    if chat:
        tok.add_special_tokens(list(CHAT_ROLE_TOKENS.values()))
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        bos_token=BOS,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=1_000_000,
    )
    if chat:
        wrapped.chat_template = CHAR_CHAT_TEMPLATE
    return wrapped


# ``tokenizer_class`` values of a generic fast tokenizer: transformers < 5 saves "PreTrainedTokenizerFast",
# transformers 5 saves "TokenizersBackend" (PreTrainedTokenizerFast is an alias of it there).
GENERIC_FAST_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer saved in folder ``path``.

    A folder whose ``tokenizer_config.json`` names a generic fast tokenizer (``PreTrainedTokenizerFast`` or,
    as transformers 5 writes it, ``TokenizersBackend``: our character tokenizer) is
    loaded with that class directly: ``AutoTokenizer`` would pick the tokenizer class of the model type in
    ``config.json`` (Qwen2 for the tiny model), which re-processes the vocabulary and silently mangles it.
    """
    folder = Path(path)
    cfg_file = folder / "tokenizer_config.json"
    tokenizer_class = None
    if cfg_file.is_file():
        try:
            tokenizer_class = json.loads(cfg_file.read_text()).get("tokenizer_class")
        except (json.JSONDecodeError, AttributeError):
            tokenizer_class = None
    if tokenizer_class in GENERIC_FAST_CLASSES:
        tok = PreTrainedTokenizerFast.from_pretrained(str(folder))
    else:
        tok = AutoTokenizer.from_pretrained(str(folder))
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token  # batches need a pad id; it is always masked out
    return tok
