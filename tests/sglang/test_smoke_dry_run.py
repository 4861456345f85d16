"""The GPU smoke script (``plugins/sglang/benchmarks/sglang_smoke.py``) dry-run on CPU: a tiny model, and SGLang
replaced by a transformers model behind ``hybridrl_sglang.compat`` that loads weights from the flattened buckets
exactly as SGLang rebuilds them and *loses its weights* when they are released without a backup. So the script's
glue (stages, sleep/sync order, the receive-buffer path, the JSON) and the plugin's import path are checked
end to end before the one GPU run; only SGLang itself is missing."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from hybridrl.rollout.hf import filter_logits
from hybridrl_sglang import compat

SMOKE = Path(__file__).resolve().parents[2] / "plugins" / "sglang" / "benchmarks" / "sglang_smoke.py"


class HFBackedSGLang:
    """What the plugin asks of ``sglang.Engine``, answered by a transformers model."""

    def __init__(self, kwargs: dict) -> None:
        from transformers import AutoModelForCausalLM

        self.kwargs = kwargs
        self.model = AutoModelForCausalLM.from_pretrained(kwargs["model_path"], dtype=torch.float32).eval()
        self.context_len = self.model.config.max_position_embeddings
        self.tokenizer_manager = type("TM", (), {"context_len": self.context_len})()
        self.released: set[str] = set()
        self.gen = torch.Generator().manual_seed(0)
        self.calls: list[str] = []

    @torch.no_grad()
    def generate(self, input_ids, sampling_params, return_logprob, top_logprobs_num=None):
        assert not self.released, f"generate with {self.released} released"
        outs = []
        for ids, sp in zip(input_ids, sampling_params):
            seq, toks, lps, tops = list(ids), [], [], []
            for _ in range(sp["max_new_tokens"]):
                logits = self.model(torch.tensor([seq])).logits[0, -1].float()
                for key, bias in (sp.get("logit_bias") or {}).items():
                    logits[int(key)] += bias
                if sp["temperature"] == 0.0:
                    logp = torch.log_softmax(logits, -1)
                    tok = int(logits.argmax())
                else:
                    scaled = logits / sp["temperature"]
                    logp = torch.log_softmax(scaled, -1)
                    k = sp.get("top_k", -1)
                    probs = torch.softmax(filter_logits(scaled[None], max(k, 0), sp.get("top_p", 1.0))[0], -1)
                    tok = int(torch.multinomial(probs, 1, generator=self.gen))
                seq.append(tok)
                toks.append(tok)
                lps.append((float(logp[tok]), tok, None))
                if top_logprobs_num:
                    v, i = logp.topk(min(top_logprobs_num, logp.numel()))
                    tops.append([(float(a), int(b), None) for a, b in zip(v, i)])
                if not sp.get("ignore_eos") and tok in (sp.get("stop_token_ids") or []):
                    break
            meta = {"output_token_logprobs": lps, **({"output_top_logprobs": tops} if top_logprobs_num else {})}
            outs.append({"output_ids": toks, "meta_info": meta})
        return outs

    def release_memory_occupation(self, tags):
        self.calls.append(f"release {tags}")
        self.released |= set(tags)
        if "weights" in tags and not self.kwargs.get("enable_weights_cpu_backup"):
            with torch.no_grad():
                for p in self.model.parameters():
                    p.normal_()  # the content is lost

    def resume_memory_occupation(self, tags):
        self.calls.append(f"resume {tags}")
        for tag in tags:
            self.released.remove(tag)  # SGLang raises (KeyError) on a tag that was not released

    def load(self, named):
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in named:
                params[name].copy_(tensor)

    def flush_cache(self):
        self.calls.append("flush")

    def shutdown(self):
        self.calls.append("shutdown")


@pytest.fixture
def smoke(monkeypatch: pytest.MonkeyPatch):
    spec = importlib.util.spec_from_file_location("sglang_smoke_dry", SMOKE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.DEVICE = "cpu"
    module.SHAPE = dict(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                        tie_word_embeddings=True, rope_theta=10000.0, rms_norm_eps=1e-6, use_sliding_window=False)
    engines: list[HFBackedSGLang] = []
    real_build = module.build_model
    monkeypatch.setattr(module, "build_model", lambda seed, std: real_build(seed, 0.3).float())  # bf16 values
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "dry-run")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: type("P", (), {"total_memory": 2**34})())
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (2**33 if (engines and engines[-1].released) else 2**32,
                                                                 2**34))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(compat, "check_version", lambda: None)
    monkeypatch.setattr(compat, "start_engine", lambda kwargs, devices=None: engines.append(HFBackedSGLang(kwargs))
                        or engines[-1])
    monkeypatch.setattr(compat, "current_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(compat, "synchronize", lambda: None)
    monkeypatch.setattr(compat, "ipc_collect", lambda: None)
    monkeypatch.setattr(compat, "supports_flattened_bucket", lambda: True)
    # SGLang's FlattenedTensorBucket.reconstruct_tensors, then load_weights
    monkeypatch.setattr(compat, "update_flat", lambda engine, flat, entries, tp: engine.load(
        [(e.name, flat[e.start:e.end].view(e.dtype).reshape(e.shape)) for e in entries]))
    return module, engines


def test_smoke_script_runs_end_to_end(smoke, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    module, engines = smoke
    out = tmp_path / "smoke.json"
    # views of a "cuda" receive buffer: on the dry run the buffer is made on CPU
    real_pack = __import__("hybridrl.weights.buckets", fromlist=["pack_bucket"]).pack_bucket
    monkeypatch.setattr("hybridrl.weights.buckets.pack_bucket", lambda b, s, device: real_pack(b, s, "cpu"))
    monkeypatch.setattr(sys, "argv", ["smoke", "--out", str(out), "--model-dir", str(tmp_path / "m"), "--prompts", "3",
                                      "--width", "6", "--batch", "4", "--tokens", "5", "--bucket-mb", "0.05",
                                      "--deadline", "600"])
    code = module.main()
    report = json.loads(out.read_text())
    stages = report["stages"]
    failed = {n: s.get("error") or s.get("skipped") for n, s in stages.items() if not s.get("ok")}
    assert code == 0 and not failed, json.dumps(failed, indent=1) + "\n" + "\n".join(
        s.get("traceback", "") for s in stages.values())
    # the plugin's engine, the transformers reference and the loads agree exactly on CPU
    for name in ("greedy_a", "sync_b", "sync_a"):
        assert stages[name]["equal_rows"] == 3, stages[name]
        assert stages[name]["logprob_max_abs_diff"] < 1e-4, stages[name]
    assert stages["sleep"]["released"] == ["kv_cache"] and stages["sleep"]["same_greedy_after_wake"]
    assert stages["sync_b"]["released_on_sleep"] == ["kv_cache"]
    assert stages["sync_a"]["released_on_sleep"] == ["kv_cache", "weights"]  # and the weights came back by import
    assert stages["sync_a"]["zero_copy_buckets"] == stages["sync_a"]["buckets"] > 1
    # packed, except buckets of a single tensor (its own storage goes as it is)
    assert stages["sync_b"]["zero_copy_buckets"] < stages["sync_b"]["buckets"]
    assert stages["sampling"]["topk_logprob_max_abs_diff"] < 1e-4
    assert stages["sampling"]["min_new_logprob_max_abs_diff"] < 1e-4 and stages["sampling"]["eos_inside_min_new"] == 0
    assert "shutdown" in engines[-1].calls and "raw" not in stages
