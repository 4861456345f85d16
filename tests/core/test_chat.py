"""Chat prompts: message lists, ``data.chat_template`` / ``data.system_prompt``, the bundled chat tokenizer and
real (Qwen2, Llama 3 style) tokenizer folders built in code."""

import json

import pytest

from hybridrl.config import DataConfig, TinyModelConfig
from hybridrl.data.fixtures import build_chat_tokenizer
from hybridrl.data.loading import DataError, load_rows, tokenize_rows
from hybridrl.model.tokenizer import CHAR_CHAT_TEMPLATE, CHAT_ROLE_TOKENS, build_char_tokenizer, load_tokenizer

CHAT = [{"role": "user", "content": "2+3="}]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _prompts(tmp_path, rows, tokenizer, **cfg):
    cfg = DataConfig(train=str(_jsonl(tmp_path / "d.jsonl", rows)), **cfg)
    return tokenize_rows(load_rows(cfg), tokenizer, cfg)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return load_tokenizer(build_chat_tokenizer("qwen2", tmp_path_factory.mktemp("qwen2")))


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    return load_tokenizer(build_chat_tokenizer("llama3", tmp_path_factory.mktemp("llama3")))


# --- the bundled chat tokenizer -----------------------------------------------------------------------

def test_char_chat_keeps_every_character_id_and_adds_one_token_per_role():
    plain, chat = build_char_tokenizer(), build_char_tokenizer(chat=True)
    assert {k: v for k, v in chat.get_vocab().items() if k in plain.get_vocab()} == plain.get_vocab()
    assert len(chat) == len(plain) + len(CHAT_ROLE_TOKENS)
    for token in CHAT_ROLE_TOKENS.values():
        assert len(chat.encode(token)) == 1 and chat.convert_ids_to_tokens(chat.encode(token)) == [token]
    assert plain.chat_template is None  # the reverse quick start's tokenizer is unchanged


def test_char_chat_template_renders_turns_closed_by_eos():
    tok = build_char_tokenizer(chat=True)
    text = tok.apply_chat_template([{"role": "system", "content": "be brief"}, *CHAT], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|system|>be brief<eos><|user|>2+3=<eos><|assistant|>"
    ids = tok.encode(text)
    assert tok.convert_ids_to_tokens(ids)[-1] == "<|assistant|>" and ids.count(tok.eos_token_id) == 2
    assert tok.decode(ids, skip_special_tokens=True) == "be brief2+3="
    with pytest.raises(Exception, match="unknown role"):
        tok.apply_chat_template([{"role": "narrator", "content": "x"}], tokenize=False)


def test_char_chat_template_survives_save_and_load(tmp_path):
    build_char_tokenizer(chat=True).save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded.chat_template == CHAR_CHAT_TEMPLATE
    assert loaded.encode("<|user|>7") == build_char_tokenizer(chat=True).encode("<|user|>7")


# --- real tokenizer folders --------------------------------------------------------------------------

def test_qwen2_folder_loads_with_its_class_and_template(qwen2):
    assert type(qwen2).__name__ == "Qwen2Tokenizer"
    assert qwen2.eos_token == "<|im_end|>" and qwen2.pad_token == "<|endoftext|>"
    text = "Natalia sold 48 clips.\nHow many?"
    assert qwen2.decode(qwen2(text)["input_ids"]) == text


def test_qwen2_messages_get_the_template_and_generation_prompt(tmp_path, qwen2):
    [row] = _prompts(tmp_path, [{"prompt": CHAT, "answer": "5"}], qwen2)
    assert row.prompt.endswith("<|im_start|>user\n2+3=<|im_end|>\n<|im_start|>assistant\n")
    assert row.prompt.startswith("<|im_start|>system\nYou are Qwen")  # the template's default system prompt
    assert row.token_ids == qwen2(row.prompt, add_special_tokens=False)["input_ids"]
    assert row.messages == CHAT and row.meta == {"answer": "5", "ground_truth": "5"}


def test_llama3_bos_is_not_doubled(tmp_path, llama3):
    [row] = _prompts(tmp_path, [{"prompt": CHAT}], llama3)
    assert row.token_ids.count(llama3.bos_token_id) == 1 and row.token_ids[0] == llama3.bos_token_id
    assert llama3("2+3=")["input_ids"][0] == llama3.bos_token_id  # its text prompts still get the BOS
    [text_row] = _prompts(tmp_path, [{"prompt": "2+3="}], llama3)
    assert text_row.token_ids == llama3("2+3=")["input_ids"] and text_row.messages is None


def test_system_prompt_is_prepended_and_turns_text_into_a_chat(tmp_path, qwen2):
    rows = [{"prompt": CHAT}, {"prompt": "7*6="},
            {"prompt": [{"role": "system", "content": "mine"}, {"role": "user", "content": "x"}]}]
    chat, text, own = _prompts(tmp_path, rows, qwen2, system_prompt="Be exact.")
    assert chat.messages == [{"role": "system", "content": "Be exact."}, *CHAT]
    assert chat.prompt.startswith("<|im_start|>system\nBe exact.<|im_end|>\n")
    assert text.messages == [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "7*6="}]
    assert own.messages[0] == {"role": "system", "content": "mine"}  # a chat's own system message wins


def test_template_file_replaces_the_tokenizers(tmp_path, qwen2):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}[assistant] {% endif %}")
    [row] = _prompts(tmp_path, [{"prompt": CHAT}], qwen2, chat_template=str(template))
    assert row.prompt == "[user] 2+3=\n[assistant] "


def test_max_prompt_len_counts_the_rendered_chat(tmp_path):
    tok = build_char_tokenizer(chat=True)  # <|user|> 2 + 3 = <eos> <|assistant|>: 7 tokens
    assert len(_prompts(tmp_path, [{"prompt": CHAT}], tok, max_prompt_len=7)[0].token_ids) == 7
    with pytest.raises(DataError, match="longer than data.max_prompt_len=6"):
        _prompts(tmp_path, [{"prompt": CHAT}], tok, max_prompt_len=6)


@pytest.mark.parametrize("prompt, match", [
    ([], "line 2: 'prompt' is an empty message list"),
    ([{"content": "x"}], r"line 2: 'prompt' message 0 has no 'role' string \(fields: \['content'\]\)"),
    ([{"role": "user", "content": 3}], r"line 2: 'prompt' message 0 \(user\) must have a 'content' string, got int"),
    (["hi"], "line 2: 'prompt' message 0 must be a {role, content} object, got str"),
])
def test_bad_messages_name_the_line_and_message(tmp_path, prompt, match):
    f = _jsonl(tmp_path / "d.jsonl", [{"prompt": CHAT}, {"prompt": prompt}])
    with pytest.raises(DataError, match=match):
        load_rows(DataConfig(train=str(f)))


def test_messages_without_a_template_name_the_row(tmp_path):
    with pytest.raises(DataError, match=r"line 2: 'prompt' is a chat but the tokenizer .* has no chat template"):
        _prompts(tmp_path, [{"prompt": "rev 12="}, {"prompt": CHAT}], build_char_tokenizer())
    with pytest.raises(DataError, match=r"line 1: 'prompt' is a message list but data.chat_template is none"):
        _prompts(tmp_path, [{"prompt": CHAT}], build_char_tokenizer(chat=True), chat_template="none")


def test_a_missing_template_file_is_reported_under_its_key(tmp_path):
    with pytest.raises(DataError) as info:
        _prompts(tmp_path, [{"prompt": CHAT}], build_char_tokenizer(chat=True),
                 chat_template=str(tmp_path / "no.jinja"))
    assert info.value.key == "data.chat_template" and "is not a file" in str(info.value)


def test_a_system_prompt_without_a_template_is_a_config_error():
    with pytest.raises(ValueError, match="data.system_prompt needs a chat template"):
        DataConfig(train="x.jsonl", chat_template="none", system_prompt="hi")


# --- tiny models on other tokenizers -----------------------------------------------------------------

def test_tiny_model_on_a_real_tokenizer_takes_its_vocabulary(tmp_path):
    from hybridrl.model.tiny import build_tiny_model

    folder = build_chat_tokenizer("qwen2", tmp_path / "tok")
    cfg = TinyModelConfig(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32,
                          tokenizer=str(folder))
    out = build_tiny_model(cfg, tmp_path / "m")
    tok = load_tokenizer(out)
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == len(tok) == 600
    assert config["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.chat_template is not None and type(tok).__name__ == "Qwen2Tokenizer"


def test_tiny_model_tokenizer_problems_are_named():
    from hybridrl.model.tiny import tokenizer_problem

    assert tokenizer_problem(TinyModelConfig(tokenizer="char_chat")) is None
    assert "neither char nor char_chat nor a folder" in tokenizer_problem(TinyModelConfig(tokenizer="/no/such"))
