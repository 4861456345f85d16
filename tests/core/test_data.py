import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridrl.config import DataConfig
from hybridrl.data.loading import DataError, PromptLoader, PromptRow, load_rows, tokenize_rows
from hybridrl.model.tokenizer import build_char_tokenizer
from hybridrl.plugins.registry import Registry
from hybridrl.tasks.reverse import make_reverse_rows


def _jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _registry():
    registry = Registry()
    registry.add_dataset("reverse", make_reverse_rows)
    registry.add_dataset("nothing", lambda: [])
    return registry


# --- loading ---------------------------------------------------------------------------------------

def test_loads_jsonl_and_skips_blank_lines(tmp_path):
    f = _jsonl(tmp_path / "d.jsonl", ['{"prompt": "rev 12=", "answer": "21"}', "", '{"prompt": "rev 34="}'])
    rows = load_rows(DataConfig(train=str(f)))
    assert rows == [{"prompt": "rev 12=", "answer": "21"}, {"prompt": "rev 34="}]


def test_loads_parquet(tmp_path):
    f = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"q": "rev 12=", "answer": "21"}, {"q": "rev 34=", "answer": "43"}]), f)
    rows = load_rows(DataConfig(train=str(f), prompt_key="q"))
    assert rows == [{"q": "rev 12=", "answer": "21"}, {"q": "rev 34=", "answer": "43"}]


def test_loads_a_registered_dataset_with_args():
    rows = load_rows(DataConfig(dataset="reverse", dataset_args={"n_digits": 1}), _registry())
    assert rows == make_reverse_rows(1)


def test_registered_dataset_through_the_plugin_registry():
    assert len(load_rows(DataConfig(dataset="reverse"))) == 100  # registry=None: the process registry


@pytest.mark.parametrize("cfg, match", [
    (dict(dataset="nope"), r"unknown dataset 'nope' \(known: nothing, reverse\)"),
    (dict(dataset="reverse", dataset_args={"bogus": 1}),
     r"dataset 'reverse' does not accept data\.dataset_args=\{'bogus': 1\}"),
    (dict(dataset="nothing"), r"dataset 'nothing': the dataset is empty"),
])
def test_registered_dataset_errors(cfg, match):
    with pytest.raises(DataError, match=match):
        load_rows(DataConfig(**cfg), _registry())


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match=r"data file '.*missing\.jsonl' not found"):
        load_rows(DataConfig(train=str(tmp_path / "missing.jsonl")))


def test_unsupported_extension(tmp_path):
    f = tmp_path / "d.csv"
    f.write_text("prompt\nx\n")
    with pytest.raises(DataError, match=r"d\.csv.*unsupported extension '\.csv'"):
        load_rows(DataConfig(train=str(f)))


def test_invalid_json_names_the_line(tmp_path):
    f = _jsonl(tmp_path / "d.jsonl", ['{"prompt": "a"}', "", '{"prompt": "b"', '{"prompt": "c"}'])
    with pytest.raises(DataError, match=r"d\.jsonl, line 3: invalid JSON"):
        load_rows(DataConfig(train=str(f)))


def test_non_object_line(tmp_path):
    f = _jsonl(tmp_path / "d.jsonl", ['{"prompt": "a"}', '["prompt"]'])
    with pytest.raises(DataError, match=r"line 2: expected a JSON object, got list"):
        load_rows(DataConfig(train=str(f)))


def test_missing_prompt_key_names_the_line(tmp_path):
    f = _jsonl(tmp_path / "d.jsonl", ['{"prompt": "a"}', '{"prompt": "b"}', '{"question": "c"}'])
    with pytest.raises(DataError, match=r"d\.jsonl, line 3: no 'prompt' field .*\['question'\]"):
        load_rows(DataConfig(train=str(f)))


def test_non_string_prompt_names_the_line(tmp_path):
    f = _jsonl(tmp_path / "d.jsonl", ['{"prompt": "a"}', '{"prompt": 12}'])
    with pytest.raises(DataError,
                       match=r"line 2: 'prompt' must be a string or a list of \{role, content\} messages, got int"):
        load_rows(DataConfig(train=str(f)))


def test_parquet_errors_name_the_row(tmp_path):
    f = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "a"}, {"prompt": None}]), f)
    with pytest.raises(DataError, match=r"d\.parquet, row 2: 'prompt' must be a string or a list of "
                                        r"\{role, content\} messages, got NoneType"):
        load_rows(DataConfig(train=str(f)))
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    with pytest.raises(DataError, match=r"cannot read parquet file '.*bad\.parquet'"):
        load_rows(DataConfig(train=str(bad)))


@pytest.mark.parametrize("content", ["", "\n\n"])
def test_empty_file(tmp_path, content):
    f = tmp_path / "d.jsonl"
    f.write_text(content)
    with pytest.raises(DataError, match=r"d\.jsonl: the dataset is empty"):
        load_rows(DataConfig(train=str(f)))


# --- tokenizing ------------------------------------------------------------------------------------

def test_tokenize_keeps_text_ids_and_other_fields(tmp_path):
    tok = build_char_tokenizer()
    f = _jsonl(tmp_path / "d.jsonl", ['{"prompt": "rev 12=", "answer": "21", "id": 7}'])
    cfg = DataConfig(train=str(f))
    rows = tokenize_rows(load_rows(cfg), tok, cfg)
    assert rows == [PromptRow("rev 12=", tok.encode("rev 12="), {"answer": "21", "id": 7, "ground_truth": "21"})]
    assert rows.dropped == 0


def _long_file(tmp_path):
    return _jsonl(tmp_path / "d.jsonl", ['{"prompt": "rev 12="}', '{"prompt": "rev 123456="}',
                                         '{"prompt": "rev 34="}', '{"prompt": "rev 1234567="}'])


def test_long_prompts_error_names_first_line_and_count(tmp_path):
    cfg = DataConfig(train=str(_long_file(tmp_path)), max_prompt_len=8)
    with pytest.raises(DataError, match=r"2 of 4 prompts are longer than data.max_prompt_len=8 tokens "
                                         r"\(first: .*d\.jsonl, line 2, 11 tokens\)"):
        tokenize_rows(load_rows(cfg), build_char_tokenizer(), cfg)


def test_long_prompts_dropped_with_count(tmp_path, caplog):
    cfg = DataConfig(train=str(_long_file(tmp_path)), max_prompt_len=8, long_prompts="drop")
    with caplog.at_level("WARNING"):
        rows = tokenize_rows(load_rows(cfg), build_char_tokenizer(), cfg)
    assert [r.prompt for r in rows] == ["rev 12=", "rev 34="]
    assert rows.dropped == 2
    assert "2 of 4 prompts" in caplog.text and "dropped" in caplog.text


def test_dropping_everything_is_an_error(tmp_path):
    cfg = DataConfig(train=str(_long_file(tmp_path)), max_prompt_len=3, long_prompts="drop")
    with pytest.raises(DataError, match="leaves no prompts"):
        tokenize_rows(load_rows(cfg), build_char_tokenizer(), cfg)


def test_exact_max_length_is_kept(tmp_path):
    cfg = DataConfig(train=str(_long_file(tmp_path)), max_prompt_len=11, long_prompts="error")
    rows = load_rows(cfg)
    tokenizer = build_char_tokenizer()
    kept = tokenize_rows(rows[:3], tokenizer, cfg)  # 11 tokens fit exactly
    assert [r.prompt for r in kept] == ["rev 12=", "rev 123456=", "rev 34="] and kept.dropped == 0
    assert len(kept[1].token_ids) == 11 and kept[1].token_ids == tokenizer.encode("rev 123456=")
    one_less = DataConfig(train=cfg.train, max_prompt_len=10, long_prompts="drop")
    assert [r.prompt for r in tokenize_rows(rows[:3], tokenizer, one_less)] == ["rev 12=", "rev 34="]


# --- feeding ---------------------------------------------------------------------------------------

def _prompt_rows(n):
    return [PromptRow(f"p{i}", [i], {"i": i}) for i in range(n)]


def _take(loader, steps):
    return [[r.meta["i"] for r in next(loader)] for _ in range(steps)]


def test_each_epoch_is_a_permutation_and_epochs_differ():
    loader = PromptLoader(_prompt_rows(10), prompts_per_step=5, seed=0)
    steps = _take(loader, 4)
    epoch0, epoch1 = steps[0] + steps[1], steps[2] + steps[3]
    assert sorted(epoch0) == sorted(epoch1) == list(range(10))
    assert epoch0 != epoch1
    assert epoch0 != list(range(10))
    assert loader.state_dict()["epoch"] == 2


def test_same_seed_same_order_other_seed_other_order():
    a = _take(PromptLoader(_prompt_rows(20), 4, seed=1), 12)
    assert a == _take(PromptLoader(_prompt_rows(20), 4, seed=1), 12)
    assert a != _take(PromptLoader(_prompt_rows(20), 4, seed=2), 12)


def test_no_shuffle_keeps_file_order_across_epoch_boundaries():
    assert _take(PromptLoader(_prompt_rows(5), 3, shuffle=False), 3) == [[0, 1, 2], [3, 4, 0], [1, 2, 3]]


def test_steps_spanning_epochs_are_deterministic_with_few_rows():
    loader = PromptLoader(_prompt_rows(3), prompts_per_step=8, seed=5)
    steps = _take(loader, 3)
    assert all(len(s) == 8 for s in steps)
    flat = [i for s in steps for i in s]
    for e in range(8):  # 24 = 8 whole epochs of 3
        assert sorted(flat[3 * e: 3 * e + 3]) == [0, 1, 2]
    assert steps == _take(PromptLoader(_prompt_rows(3), prompts_per_step=8, seed=5), 3)


@pytest.mark.parametrize("n_rows, per_step, done", [(10, 4, 3), (3, 8, 2), (12, 4, 3)])
def test_resume_continues_exactly(n_rows, per_step, done):
    full = _take(PromptLoader(_prompt_rows(n_rows), per_step, seed=9), done + 6)
    first = PromptLoader(_prompt_rows(n_rows), per_step, seed=9)
    _take(first, done)
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint round trip
    resumed = PromptLoader(_prompt_rows(n_rows), per_step, seed=9)
    resumed.load_state_dict(state)
    assert _take(resumed, 6) == full[done:]


def test_resume_with_different_data_is_refused():
    loader = PromptLoader(_prompt_rows(10), 4)
    next(loader)
    with pytest.raises(DataError, match="10 rows, the data now has 11"):
        PromptLoader(_prompt_rows(11), 4).load_state_dict(loader.state_dict())


def test_loader_is_an_iterator_of_prompt_rows():
    loader = PromptLoader(_prompt_rows(4), 2)
    assert iter(loader) is loader
    assert all(isinstance(r, PromptRow) for r in next(loader))
    with pytest.raises(DataError):
        PromptLoader([], 2)
