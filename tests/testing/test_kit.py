"""The kit itself, run as a user runs it (``pytest --hybridrl-backend=NAME`` in a fresh process, through
pytester): deliberately broken backends fail with the name of the contract they break, backends whose
engine is missing are skipped with the registry's reason, unknown names are a usage error."""

from __future__ import annotations

import importlib.util
import os
import re

import pytest
import torch

from hybridrl.plugins.discovery import build_registry, plugin_manager
from hybridrl.testing import bridge_contract as bridge
from hybridrl.testing import rollout_contract as rollout
from hybridrl.testing import train_contract as train

pytest_plugins = ["pytester"]

BROKEN_BACKENDS = '''
"""Backends that each break one contract of the kit (registered through HYBRIDRL_PLUGINS)."""
import dataclasses

import torch

from hybridrl import hookimpl
from hybridrl.engines.batch import PROMPT_IDS, PROMPT_MASK, RESPONSE_IDS, RESPONSE_MASK, ROLLOUT_LOG_PROBS, Batch
from hybridrl.engines import GeneratedTokens
from hybridrl.rollout.hf import HFRollout, filter_logits
from hybridrl_fsdp.engine import FSDPEngine


def _result(ids, mask, logp):
    return Batch.from_tensors({RESPONSE_IDS: ids, RESPONSE_MASK: mask, ROLLOUT_LOG_PROBS: logp})


class IgnoresImport(HFRollout):
    def import_weights(self, bucket):
        pass


class NarrowOutput(HFRollout):
    def generate(self, batch, params):
        out = super().generate(batch, params)
        return _result(out[RESPONSE_IDS][:, :-1], out[RESPONSE_MASK][:, :-1], out[ROLLOUT_LOG_PROBS][:, :-1])


class KeepsReferences(HFRollout):
    def import_weights(self, bucket):
        targets = dict(self.model.named_parameters())
        for name, tensor in bucket:
            targets[name].data = tensor  # aliases the sender's buffer


class EosOutsideMask(HFRollout):
    def generate(self, batch, params):
        out = super().generate(batch, params)
        mask = out[RESPONSE_MASK].clone()
        mask[torch.isin(out[RESPONSE_IDS], torch.tensor(self.eos_ids)) & mask.bool()] = 0
        return _result(out[RESPONSE_IDS], mask, out[ROLLOUT_LOG_PROBS] * mask)


class ShiftedLogProbs(HFRollout):
    def generate(self, batch, params):
        out = super().generate(batch, params)
        return _result(out[RESPONSE_IDS], out[RESPONSE_MASK], out[ROLLOUT_LOG_PROBS] - 0.01 * out[RESPONSE_MASK])


class NoContextLimit(HFRollout):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.context_length = None


class ForgetfulSleep(HFRollout):
    def sleep(self):
        with torch.no_grad():
            for p in self.model.parameters():
                p.mul_(0.5)


class NoisyExport(FSDPEngine):
    def export_weights(self, bucket_bytes):
        for bucket in super().export_weights(bucket_bytes):
            yield [(name, tensor + 1e-3) for name, tensor in bucket]


class IgnoresZeroLr(FSDPEngine):
    def __init__(self, ctx):
        lr = ctx.training.lr or 1e-3
        super().__init__(dataclasses.replace(ctx, training=dataclasses.replace(ctx.training, lr=lr)))


class Ascends(FSDPEngine):
    def update(self, batch, objective):
        class Negated:
            needs = objective.needs

            def __call__(self, outputs, micro_batch, scale):
                loss, metrics = objective(outputs, micro_batch, scale)
                return -loss, metrics

        return super().update(batch, Negated())


class KeepsGradients(FSDPEngine):
    def __init__(self, ctx):
        super().__init__(ctx)
        if self.optimizer is not None:
            self.optimizer.zero_grad = lambda set_to_none=True: None  # gradients pile up from update to update


class LateLogProbs(FSDPEngine):
    def __init__(self, ctx):
        from dataclasses import replace
        super().__init__(replace(ctx, options={**ctx.options, "packing": False}))  # the padded path, overridden below
        self._log_prob_head = None  # the plain logits path, read one position late below

    def _response_logits(self, input_ids, attention_mask, position_ids, response_len):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=False)
        return out.logits[:, input_ids.shape[1] - response_len:, :]  # token t scored by the logits after it


def _sampled_log_probs(logits, params):
    return torch.log_softmax(filter_logits(logits / params.temperature, params.top_k, params.top_p), dim=-1)


class SamplesAtOne(HFRollout):
    """Draws at temperature 1 whatever is asked, reports the log-probs of the temperature asked for."""

    @staticmethod
    def _sample(logits, params, generator):
        if params.greedy:
            return HFRollout._sample(logits, params, generator)
        token, _ = HFRollout._sample(logits, dataclasses.replace(params, temperature=1.0, top_p=1.0), generator)
        return token, _sampled_log_probs(logits, params).gather(1, token[:, None]).squeeze(1)


class OneStream(HFRollout):
    """One random number per step for the whole batch: every row with the same prompt draws the same tokens."""

    @staticmethod
    def _sample(logits, params, generator):
        if params.greedy:
            return HFRollout._sample(logits, params, generator)
        logp = _sampled_log_probs(logits, params)
        u = torch.rand(1, generator=generator, device=logits.device)
        token = (logp.exp().cumsum(-1) < u).sum(-1).clamp(max=logits.shape[-1] - 1)
        return token, logp.gather(1, token[:, None]).squeeze(1)


class CountsPadding(HFRollout):
    """Leaves the position ids to the model: they count the left padding."""

    def _forward(self, ids, attn, pos, cache):
        return super()._forward(ids, attn, None, cache)


class ServesRequests(HFRollout):
    """Single requests through ``generate`` on a batch of one (correct, not concurrent)."""

    def _one(self, prompt_ids, params):
        prompt = torch.tensor([prompt_ids], dtype=torch.long)
        return self.generate(Batch.from_tensors({PROMPT_IDS: prompt, PROMPT_MASK: torch.ones_like(prompt)}), params)

    async def generate_request(self, prompt_ids, params):
        out = self._one(prompt_ids, params)
        n = int(out[RESPONSE_MASK][0].sum())
        return GeneratedTokens(out[RESPONSE_IDS][0, :n].tolist(),
                               out[ROLLOUT_LOG_PROBS][0, :n].tolist() if params.logprobs else None)


class PadsRequests(ServesRequests):
    """Returns every request at the full width: the padding after a stop token comes back as tokens."""

    async def generate_request(self, prompt_ids, params):
        out = self._one(prompt_ids, params)
        return GeneratedTokens(out[RESPONSE_IDS][0].tolist(), out[ROLLOUT_LOG_PROBS][0].tolist())


class KeepsMemory(HFRollout):
    """Sleeps without releasing anything (the weights and caches stay on the device)."""

    def sleep(self):
        pass

    def wake(self):
        pass


class CopiesInPlace(HFRollout):
    """Declares, truthfully, that import_weights copies straight into the weights: syncs come in large buckets."""

    def imports_without_staging(self):
        return True


class OneBucket(FSDPEngine):
    """Sends the whole model in one bucket, whatever bucket_bytes asks for."""

    def export_weights_transient(self, bucket_bytes):
        yield [item for bucket in super().export_weights_transient(bucket_bytes) for item in bucket]


class LeavesPositions(FSDPEngine):
    """Scores without position ids: they count the left padding."""

    def __init__(self, ctx):
        super().__init__(dataclasses.replace(ctx, options={**ctx.options, "packing": False}))
        self._log_prob_head = None

    def _response_logits(self, input_ids, attention_mask, position_ids, response_len):
        return super()._response_logits(input_ids, attention_mask, None, response_len)


@hookimpl
def hybridrl_register_backends(registry):
    for name, cls in [("broken_import", IgnoresImport), ("broken_width", NarrowOutput),
                      ("broken_refs", KeepsReferences), ("broken_eos", EosOutsideMask),
                      ("broken_logp", ShiftedLogProbs), ("broken_limit", NoContextLimit),
                      ("broken_sleep", ForgetfulSleep), ("broken_temperature", SamplesAtOne),
                      ("broken_seed", OneStream), ("broken_positions", CountsPadding),
                      ("no_staging", CopiesInPlace), ("keeps_memory", KeepsMemory)]:
        registry.add_rollout(name, cls, supports={"sleep", "named_weights"})  # as the hf rollout they extend
    registry.add_rollout("requests_ok", ServesRequests, supports={"sleep", "named_weights", "requests"})
    registry.add_rollout("broken_requests", PadsRequests, supports={"sleep", "named_weights", "requests"})
    for name, cls in [("broken_export", NoisyExport), ("broken_zero_lr", IgnoresZeroLr), ("broken_ascent", Ascends),
                      ("broken_grads", KeepsGradients), ("broken_shift", LateLogProbs),
                      ("one_bucket", OneBucket), ("broken_positions_train", LeavesPositions)]:
        registry.add_train_engine(name, cls, supports={"checkpoint", "greedy_margins", "offload"})
    registry.add_rollout("needs_missing", "kit_nowhere.engine:Engine", requires=["not_a_real_engine>=1.0"],
                         install_hint="pip install not-a-real-engine")
    registry.add_train_engine("unwritten", "kit_nowhere_either.engine:Engine")
'''

# (backend, test that must fail, the contract its failure must name)
CASES = [
    ("broken_import", "test_import_weights_gives_the_reference_model", rollout.IMPORT),
    ("broken_width", "test_output_layout", rollout.LAYOUT),
    ("broken_refs", "test_import_weights_copies_the_bucket", rollout.IMPORT_COPIES),
    ("broken_eos", "test_rows_end_at_eos_inside_the_mask", rollout.STOPPING),
    ("broken_logp", "test_greedy_log_probs_match_the_reference", rollout.LOG_PROBS),
    ("broken_limit", "test_prompt_over_the_context_is_refused", rollout.LONG_PROMPT),
    ("broken_sleep", "test_sleep_and_wake_keep_outputs", rollout.SLEEP),
    ("broken_export", "test_export_is_the_checkpoint", train.EXPORT),
    ("broken_zero_lr", "test_zero_lr_update_changes_nothing", train.ZERO_LR),
    ("broken_ascent", "test_update_lowers_the_loss", train.DESCENT),
    ("broken_grads", "test_consecutive_updates_are_independent", train.INDEPENDENT),
    ("broken_shift", "test_log_probs_match_transformers", train.LOG_PROBS_AGREE),
    ("broken_zero_lr-to-broken_import", "test_sync_gives_the_rollout_the_trainer_weights", bridge.SYNC),
    ("broken_temperature", "test_draws_follow_the_sampling_distribution", rollout.DRAWS),
    ("broken_seed", "test_identical_prompts_give_different_samples", rollout.ROWS_DIFFER),
    ("broken_positions", "test_left_padding_keeps_positions", rollout.POSITIONS),
    ("broken_positions_train", "test_left_padding_keeps_positions", train.POSITIONS),
    ("broken_requests", "test_requests_follow_the_generate_contract", rollout.REQUESTS),
    ("one_bucket-to-hf", "test_sync_gives_the_rollout_the_trainer_weights", bridge.BUCKETS),
]
#: the parameter a case's test runs with (its id reads ``[backend-setting]``)
SETTING = {"broken_temperature": "t0.7"}
# healthy selections in the same run: the built-in rollout and a working pair must pass
PASSING = [("hf", "test_output_layout"), ("hf", "test_import_weights_gives_the_reference_model"),
           ("broken_zero_lr-to-hf", "test_sync_gives_the_rollout_the_trainer_weights"),
           ("requests_ok", "test_requests_follow_the_generate_contract"),
           ("broken_zero_lr-to-no_staging", "test_sync_gives_the_rollout_the_trainer_weights")]


@pytest.fixture
def kit_env(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    pytester.makepyfile(broken_backends=BROKEN_BACKENDS)
    monkeypatch.setenv("HYBRIDRL_PLUGINS", "broken_backends")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(pytester.path), os.environ.get("PYTHONPATH")])))
    return pytester


def _backend_args(names: list[str]) -> list[str]:
    return [f"--hybridrl-backend={n}" for n in names]


def _selected(backend: str, test: str) -> str:
    """The -k term of one case (one setting of a parametrized test: "t0.7" alone, not "t0.7-topk5")."""
    setting = SETTING.get(backend)
    return f"({backend} and {test}" + (f" and {setting} and not topk5 and not topp0.8)" if setting else ")")


def test_broken_backends_fail_naming_the_broken_contract(kit_env: pytest.Pytester) -> None:
    pairs = [b for b, *_ in CASES + PASSING]
    names = sorted({name for pair in pairs for name in pair.split("-to-")})
    select = " or ".join(_selected(backend, test) for backend, test, _ in CASES)
    select += " or " + " or ".join(_selected(backend, test) for backend, test in PASSING)
    result = kit_env.runpytest_subprocess(*_backend_args(names), "-k", select, "-p", "no:cacheprovider",
                                          timeout=540)
    out = result.stdout.str()
    for backend, test, contract in CASES:
        test_id = f"{backend}-{SETTING[backend]}" if backend in SETTING else backend
        assert re.search(rf"FAILED \S*::{test}\[{re.escape(test_id)}\]", out), f"{backend} {test} did not fail"
        named = f"backend '{backend.replace('-to-', ' -> ')}': {contract}"
        assert named in out, f"{backend}: the failure does not name '{contract}'"
    assert "backend 'broken_import': greedy outputs differ from the reference model after import_weights" in out
    assert "they are shifted by one position: token t scored with the logits of the position after" in out
    export_failure = out.split(f"backend 'broken_export': {train.EXPORT}")[1].split("\n_")[0]
    assert export_failure.count("differs by up to") > 8 and "... and" not in export_failure  # none hidden
    result.assert_outcomes(failed=len(CASES), passed=len(PASSING))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sleep_that_releases_nothing_fails_on_cuda(kit_env: pytest.Pytester) -> None:
    result = kit_env.runpytest_subprocess(*_backend_args(["keeps_memory", "hf"]), "--hybridrl-device=cuda", "-k",
                                          "test_sleep_releases_device_memory", "-p", "no:cacheprovider", timeout=300)
    out = result.stdout.str()
    assert re.search(r"FAILED \S*::test_sleep_releases_device_memory\[keeps_memory\]", out), out[-3000:]
    assert f"backend 'keeps_memory': {rollout.SLEEP_RELEASES}" in out and "sleep released " in out
    result.assert_outcomes(failed=1, passed=1)


def _unusable(name: str) -> bool:
    """Registered here, but its engine package or engine module is missing."""
    with pytest.MonkeyPatch.context() as mp:  # the installed plugins only, not the test's broken ones
        mp.delenv("HYBRIDRL_PLUGINS", raising=False)
        backends = build_registry(plugin_manager()).backends
    entry = backends.get(("rollout", name)) or backends.get(("train", name))
    if entry is None:
        return False
    module = entry.target.partition(":")[0]
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    return entry.engine_problem() is not None or not found


def test_missing_engines_are_skipped_with_the_reason(kit_env: pytest.Pytester) -> None:
    optional = [n for n in ("vllm", "sglang", "megatron") if _unusable(n)]
    result = kit_env.runpytest_subprocess(*_backend_args(["needs_missing", "unwritten", *optional]), "-rs",
                                          "-p", "no:cacheprovider", timeout=300)
    out = result.stdout.str()
    outcomes = result.parseoutcomes()
    assert outcomes.get("skipped", 0) > 0 and "passed" not in outcomes and "failed" not in outcomes, out
    assert "rollout backend 'needs_missing'" in out and "pip install not-a-real-engine" in out
    assert "train backend 'unwritten'" in out and "does not exist yet" in out
    for name in optional:  # the backends others are building: pointed at by name, skipped with the reason
        assert re.search(rf"(rollout|train) backend '{name}' \(plugin {name}\) is", out), name


def test_unknown_backend_is_a_usage_error(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_inprocess("--hybridrl-backend=no_such_backend")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "no plugin registers 'no_such_backend'" in result.stderr.str()
    assert "rollout: " in result.stderr.str() and "hf" in result.stderr.str()
