import json
import string

import pytest

from hybridrl.model import tokenizer as tk
from hybridrl.model.tokenizer import build_char_tokenizer, load_tokenizer


def test_special_tokens_come_first():
    tok = build_char_tokenizer()
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<pad>", "<eos>", "<bos>"]
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (0, 1, 2)


def test_vocabulary_has_the_characters():
    tok = build_char_tokenizer()
    vocab = tok.get_vocab()
    for ch in string.digits + string.ascii_lowercase + " :=?,.+-":
        assert ch in vocab, ch
    assert len(tok) == len(vocab) == 3 + len(set(tk.CHARACTERS))
    assert sorted(vocab.values()) == list(range(len(vocab)))


@pytest.mark.parametrize("text", ["rev 47=", "rev 0012=", "a b  c", "1+2=3, ok?", " x:-y."])
def test_one_token_per_character_and_exact_roundtrip(text):
    tok = build_char_tokenizer()
    ids = tok.encode(text)
    assert len(ids) == len(text)
    assert tok.convert_ids_to_tokens(ids) == list(text)
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.eos_token_id, tok.pad_token_id], skip_special_tokens=True) == text


def test_no_special_tokens_added_on_encode():
    tok = build_char_tokenizer()
    assert tok.encode("47") == [tok.convert_tokens_to_ids("4"), tok.convert_tokens_to_ids("7")]


def test_save_and_load_keeps_vocab_and_special_ids(tmp_path):
    tok = build_char_tokenizer()
    tok.save_pretrained(tmp_path)
    # A qwen2 config.json next to it must not make the loader pick the Qwen2 tokenizer class.
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": len(tok)}))
    loaded = load_tokenizer(tmp_path)
    text = "rev 47= a,b c"
    assert loaded.encode(text) == tok.encode(text)
    assert loaded.decode(loaded.encode(text)) == text
    assert loaded.get_vocab() == tok.get_vocab()
    assert (loaded.pad_token_id, loaded.eos_token_id, loaded.bos_token_id) == (0, 1, 2)


def test_other_tokenizer_classes_go_through_autotokenizer(tmp_path, monkeypatch):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "Qwen2Tokenizer"}))
    calls = []

    class Fake:
        pad_token = "<p>"
        eos_token = "<e>"

    def fake_from_pretrained(path, *args, **kwargs):
        calls.append(path)
        return Fake()

    monkeypatch.setattr(tk.AutoTokenizer, "from_pretrained", fake_from_pretrained)
    assert isinstance(load_tokenizer(tmp_path), Fake)
    assert calls == [str(tmp_path)]


def test_unknown_characters_encode_as_question_mark():
    tok = build_char_tokenizer()
    assert tok.decode(tok.encode("A7")) == "?7"
