"""Bad config and data are all found before any process starts, each with its key path and, for data, the
file and line: missing files, bad lines, overlong prompts, a reward that cannot be imported, raises or
returns no number, a tracker without its package, a context longer than the model's, checkpoints asked of a
backend that cannot write them, a resume path that is not a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridrl.config import ConfigError, load_config
from hybridrl.placement.plan import ClusterSpec
from hybridrl.plugins.discovery import get_registry
from hybridrl.run.preflight import prepare_run

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"
CPU2 = ClusterSpec(1, 2, "cpu")
GOOD_ROW = '{"prompt": "reverse 12 ->", "answer": "21"}'
NO_PROMPT_ROW = '{"q": 1}'
CHAT_ROW = '{"prompt": [{"role": "user", "content": "reverse 12 ->"}], "answer": "21"}'


def problems(tmp_path: Path, overrides: list[str]) -> dict[str, str]:
    """key path -> reason (several reasons of one key joined) of the ConfigError the run set-up raises."""
    cfg = load_config(QUICKSTART, [f"trainer.out={tmp_path / 'run'}", *overrides])
    with pytest.raises(ConfigError) as err:
        prepare_run(cfg, get_registry(tuple(cfg.plugins)), CPU2)
    found: dict[str, str] = {}
    for key, reason in err.value.problems:
        found[key] = f"{found[key]} | {reason}" if key in found else reason
    return found


def data_file(tmp_path: Path, lines: list[str]) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


CASES = {
    "model folder missing": (lambda t: ["model.tiny=null", f"model.path={t}/no_model"], "model.path", "does not exist"),
    "model folder without config": (lambda t: ["model.tiny=null", f"model.path={t}"], "model.path", "no config.json"),
    "data file missing": (lambda t: [f"data.train={t}/nope.jsonl"], "data.train", "nope.jsonl' not found"),
    "bad JSON line": (lambda t: [f"data.train={data_file(t, [GOOD_ROW, '{oops'])}"], "data.train",
                      "prompts.jsonl, line 2: invalid JSON"),
    "row without prompt": (lambda t: [f"data.train={data_file(t, [GOOD_ROW, GOOD_ROW, NO_PROMPT_ROW])}"], "data.train",
                           "line 3: no 'prompt' field"),
    "prompts over the limit": (lambda t: ["data.max_prompt_len=4"], "data",
                               "longer than data.max_prompt_len=4 tokens (first: examples/data/reverse2.jsonl, line 1"),
    "reward not importable": (lambda t: ["roles.reward.fn=no_such_module:score"], "roles.reward.fn",
                              "cannot import reward function 'no_such_module:score'"),
    "reward returns text": (lambda t: ["roles.reward.fn=_preflight_helpers:text_reward"], "roles.reward.fn",
                            "returned str '1.0' for the first prompt; a reward must be a number"),
    "reward raises": (lambda t: ["roles.reward.fn=_preflight_helpers:raising_reward"], "roles.reward.fn",
                      "raised KeyError: 'score' when probed"),
    "context too long": (lambda t: ["roles.rollout.max_new_tokens=200"], "roles.rollout.max_new_tokens",
                         "more than the model's max_position_embeddings=128"),
    "checkpoints without support": (lambda t: ["plugins=[_preflight_helpers]", "roles.actor.backend=nockpt",
                                               "trainer.save_every=5"], "trainer.save_every",
                                    "the 'nockpt' backend of roles.actor cannot save checkpoints"),
    "resume from nowhere": (lambda t: [f"trainer.resume={t}/gone"], "trainer.resume", "gone' does not exist"),
    "resume from a non-checkpoint": (lambda t: [f"trainer.resume={t}"], "trainer.resume",
                                     "neither a complete checkpoint"),
    "TIS without rollout log-probs": (lambda t: ["algorithm.tis_cap=2.0", "roles.rollout.log_probs=false"],
                                      "roles.rollout.log_probs", "needs the rollout's log-probs"),
    "pipelined (TIS by default) without rollout log-probs": (
        lambda t: ["pools.gen={nodes: 1, devices_per_node: 1}", "roles.rollout.pool=gen",
                   "roles.ref.pool=main", "trainer.pipelined=true", "roles.rollout.log_probs=false"],
        "roles.rollout.log_probs", "needs the rollout's log-probs"),
    "tiny tokenizer folder missing": (lambda t: [f"model.tiny.tokenizer={t}/no_tok"], "model.tiny.tokenizer",
                                      "no_tok' is neither char nor char_chat nor a folder"),
    "chat prompts on a tokenizer without a template": (
        lambda t: [f"data.train={data_file(t, [GOOD_ROW, CHAT_ROW])}"], "data",
        "line 2: 'prompt' is a chat but the tokenizer"),
    "chat template file missing": (lambda t: ["model.tiny.tokenizer=char_chat", f"data.chat_template={t}/t.jinja",
                                              f"data.train={data_file(t, [CHAT_ROW])}"], "data.chat_template",
                                   "t.jinja' is not a file"),
    "resume without a critic": (lambda t: [f"trainer.resume={grpo_checkpoint(t)}", "algorithm.name=ppo"],
                                "trainer.resume", "holds no critic state"),
    "GRPO with one sample per prompt": (lambda t: ["algorithm.n_samples=1"], "algorithm.n_samples",
                                        "nothing to compare within a prompt's group"),
    "GRPO sampling greedily": (lambda t: ["roles.rollout.temperature=0", "algorithm.n_samples=16"],
                               "roles.rollout.temperature", "temperature=0 samples greedily: the 16 samples of each "
                                                            "prompt would be the same response"),
    "GRPO with top_k 1": (lambda t: ["roles.rollout.top_k=1"], "roles.rollout.top_k", "top_k=1 samples greedily"),
    "trainer.out is a file": (lambda t: [f"trainer.out={a_file(t)}"], "trainer.out", "exists and is not a folder"),
    "model folder without weights": (lambda t: ["model.tiny=null", f"model.path={model_folder(t, '*.safetensors')}"],
                                     "model.path", "holds no weights"),
    "model folder without a shard": (lambda t: ["model.tiny=null", f"model.path={sharded_model_folder(t)}"],
                                     "model.path", "lacks 1 of the 2 weight files model.safetensors.index.json lists"),
    "model folder without a tokenizer": (lambda t: ["model.tiny=null", f"model.path={model_folder(t, 'tokenizer*')}"],
                                         "model.path", "holds no tokenizer"),
    "tokenizer with an empty vocabulary": (lambda t: ["model.tiny=null", f"model.path={empty_vocab_model(t)}"],
                                           "model.path", "encodes text to no tokens"),
}


def a_file(tmp_path: Path) -> Path:
    path = tmp_path / "a_file"
    path.write_text("not a folder")
    return path


def model_folder(tmp_path: Path, drop: str) -> Path:
    """The tiny model's HF folder without the files matching ``drop``."""
    from hybridrl.config import TinyModelConfig
    from hybridrl.model.tiny import build_tiny_model

    folder = build_tiny_model(TinyModelConfig(), tmp_path / "model")
    for path in folder.glob(drop):
        path.unlink()
    return folder


def sharded_model_folder(tmp_path: Path) -> Path:
    folder = model_folder(tmp_path, "nothing")
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                                            "lm_head.weight": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def empty_vocab_model(tmp_path: Path) -> Path:
    folder = model_folder(tmp_path, "tokenizer*")
    (folder / "vocab.json").write_text("{}")  # a tokenizer file is there, but it holds nothing
    (folder / "merges.txt").write_text("")
    return folder


def grpo_checkpoint(tmp_path: Path) -> Path:
    """A checkpoint as a GRPO run with an FSDP actor leaves it (its contents are not read by the pre-flight)."""
    from hybridrl.run import checkpoint as ckpt

    def write(folder: Path) -> dict:
        (folder / "actor").mkdir()
        ckpt.save_driver_state(folder, {"step": 1})
        return {"roles": {"actor": "fsdp"}}

    return ckpt.save_checkpoint(tmp_path / "grpo", 1, write, keep=0)


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_rejected_with_its_key(tmp_path: Path, case: str) -> None:
    overrides, key, reason = CASES[case]
    found = problems(tmp_path, overrides(tmp_path))
    assert key in found, found
    assert reason in found[key]


@pytest.mark.parametrize("override, key, reason", [
    ("trainer.save_every=-1", "trainer.save_every", "greater than or equal to 0"),
    ("trainer.keep_checkpoints=x", "trainer.keep_checkpoints", "valid integer"),
    ("trainer.max_bad_steps=-2", "trainer.max_bad_steps", "greater than or equal to 0"),
    ("trainer.resume=", "trainer.resume", "string"),
])
def test_bad_checkpoint_settings_are_config_errors(override: str, key: str, reason: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(QUICKSTART, [override])
    found = dict(err.value.problems)
    assert reason in found.get(key, ""), found


def test_a_missing_tracker_package_is_found_before_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hybridrl.observe.tracking import WandbTracker

    monkeypatch.setattr(WandbTracker, "requires", {"hybridrl_no_such_package": "no-such-package"})
    found = problems(tmp_path, ["trainer.trackers=[jsonl, wandb]"])
    assert "pip install no-such-package" in found["trainer.trackers"]


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    found = problems(tmp_path, ["roles.reward.fn=_preflight_helpers:text_reward", "roles.rollout.max_new_tokens=200",
                                f"trainer.resume={tmp_path}/gone", "roles.rollout.backend=nope",
                                "trainer.trackers=[jsonl, nope]"])
    assert {"roles.reward.fn", "roles.rollout.max_new_tokens", "trainer.resume", "roles.rollout.backend",
            "trainer.trackers"} <= set(found)


def test_chat_prompts_reach_the_reward_rendered(tmp_path: Path) -> None:
    cfg = load_config(QUICKSTART, [f"trainer.out={tmp_path / 'run'}", "model.tiny.tokenizer=char_chat",
                                   f"data.train={data_file(tmp_path, [CHAT_ROW])}", "data.system_prompt=be brief",
                                   "data.max_prompt_len=40"])
    setup = prepare_run(cfg, get_registry(), CPU2)
    assert setup.prompts[0].prompt == "<|system|>be brief<eos><|user|>reverse 12 -><eos><|assistant|>"
    assert setup.tokenizer.chat_template is not None


def test_overlong_prompts_can_be_dropped_and_counted(tmp_path: Path) -> None:
    lines = [GOOD_ROW, '{"prompt": "reverse 1234567890 ->", "answer": "x"}', GOOD_ROW]
    cfg = load_config(QUICKSTART, [f"trainer.out={tmp_path / 'run'}", f"data.train={data_file(tmp_path, lines)}",
                                   "data.long_prompts=drop"])
    setup = prepare_run(cfg, get_registry(), CPU2)
    assert setup.dropped_prompts == 1 and len(setup.prompts) == 2
