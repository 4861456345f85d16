import json

import pytest
import torch
from safetensors.torch import load_file

from hybridrl.config import TinyModelConfig
from hybridrl.model.tiny import MARKER, build_tiny_model
from hybridrl.model.tokenizer import load_tokenizer

CFG = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                      max_position=64, seed=3)


def _weights(folder):
    return load_file(str(folder / "model.safetensors"))


def test_builds_a_loadable_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = build_tiny_model(CFG, tmp_path / "m")
    assert out == tmp_path / "m"
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", MARKER):
        assert (out / name).is_file(), name
    tok = load_tokenizer(out)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    assert config["vocab_size"] == len(tok)
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["intermediate_size"], config["max_position_embeddings"]) == \
        (32, 2, 4, 2, 64, 64)
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == \
        (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    assert GenerationConfig.from_pretrained(out).eos_token_id == tok.eos_token_id

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([tok.encode("rev 47=")])
    assert model(ids).logits.shape == (1, ids.shape[1], len(tok))


def test_same_config_gives_bit_identical_weights_and_leaves_global_rng_alone(tmp_path):
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a = _weights(build_tiny_model(CFG, tmp_path / "a"))
    assert torch.equal(torch.rand(3), expected_next)  # the global RNG was not consumed
    b = _weights(build_tiny_model(CFG, tmp_path / "b"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = _weights(build_tiny_model(CFG.model_copy(update={"seed": 4}), tmp_path / "c"))
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_reuses_a_folder_built_from_the_same_config(tmp_path):
    out = build_tiny_model(CFG, tmp_path / "m")
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    (out / "extra.txt").write_text("kept")
    assert build_tiny_model(CFG, out) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    assert (out / "extra.txt").exists()


def test_rebuilds_when_the_config_changes(tmp_path):
    out = build_tiny_model(CFG, tmp_path / "m")
    before = _weights(out)
    bigger = CFG.model_copy(update={"hidden_size": 64})
    build_tiny_model(bigger, out)
    after = _weights(out)
    assert after["model.embed_tokens.weight"].shape[1] == 64
    assert before["model.embed_tokens.weight"].shape[1] == 32
    assert json.loads((out / MARKER).read_text())["config"]["hidden_size"] == 64
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temporary folders left behind


def test_refuses_to_overwrite_a_foreign_folder(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "mine.txt").write_text("do not delete")
    with pytest.raises(FileExistsError, match="not built by build_tiny_model"):
        build_tiny_model(CFG, tmp_path / "m")
    assert (tmp_path / "m" / "mine.txt").read_text() == "do not delete"


def test_rejects_inconsistent_head_counts(tmp_path):
    with pytest.raises(ValueError, match="num_kv_heads"):
        build_tiny_model(CFG.model_copy(update={"num_kv_heads": 3}), tmp_path / "m")
    with pytest.raises(ValueError, match="num_heads"):
        build_tiny_model(CFG.model_copy(update={"num_heads": 5, "num_kv_heads": 1}), tmp_path / "m")


def test_init_std_sets_the_spread_of_the_weights_and_the_default_keeps_old_folders(tmp_path):
    """``init_std`` is the spread the weights are drawn with (the tied head's size: the largest logit a frozen
    base can give); at its default the folder's marker is the one written before the key existed."""
    default = build_tiny_model(CFG, tmp_path / "default")
    wide = build_tiny_model(CFG.model_copy(update={"init_std": 0.08}), tmp_path / "wide")
    spread = {name: float(_weights(folder)["model.embed_tokens.weight"].std()) for name, folder in
              (("default", default), ("wide", wide))}
    assert spread["default"] == pytest.approx(0.02, rel=0.15) and spread["wide"] == pytest.approx(0.08, rel=0.15)
    assert json.loads((wide / "config.json").read_text())["initializer_range"] == 0.08
    assert "init_std" not in json.loads((default / MARKER).read_text())["config"]
    assert json.loads((wide / MARKER).read_text())["config"]["init_std"] == 0.08
