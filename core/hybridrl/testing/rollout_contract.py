"""``RolloutEngineContract``: the battery every rollout backend must pass (subclass it with ``backend = "name"``).

Every test builds its engine through the registry, from the kit's tiny model, and compares with a
transformers forward pass (``hybridrl.testing.reference``). A failure names the broken contract.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import pytest
import torch

from hybridrl.batch import RESPONSE_IDS, RESPONSE_MASK, ROLLOUT_LOG_PROBS, Batch
from hybridrl.engines import SamplingParams
from hybridrl.testing import backends
from hybridrl.testing.batches import prompt_batch
from hybridrl.testing.checks import check, layout_problems, reference_problems, stop_problems, violated
from hybridrl.testing.fixtures import EngineSlot, KitBase, cli_device, engine_factory
from hybridrl.testing.models import KIT_WIDTH, KitModels
from hybridrl.testing.reference import ReferenceModel

# The contracts, as the failure messages state them.
LAYOUT = ("generate must return response_ids and response_mask (int64, 0/1, right-padded) and rollout_log_probs "
          "(float32, finite), on CPU, each exactly (rows, max_new_tokens)")
STOPPING = "a row must end at its first EOS, kept inside the mask (and hold none before min_new_tokens)"
IGNORE_EOS = "with ignore_eos every row must run to max_new_tokens"
GREEDY = "greedy (temperature 0) outputs must be the step-by-step argmax of a transformers forward"
LOG_PROBS = "rollout_log_probs must agree with a transformers forward pass of the same tokens"
SAMPLING = "sampled tokens must come from the sampling distribution (temperature, top-k, top-p)"
MIN_NEW = "min_new_tokens must forbid EOS before that many tokens"
IMPORT = "greedy outputs differ from the reference model after import_weights"
IMPORT_COPIES = "import_weights must copy: outputs changed when the imported bucket's tensors were overwritten"
SLEEP = "sleep/wake must keep outputs unchanged"
IMPORT_ASLEEP = "weights imported while asleep must be in effect after wake (the trainer syncs a sleeping rollout)"
EMPTY_PROMPT = "an empty prompt must raise ValueError naming the row"
LONG_PROMPT = "a prompt longer than the context must raise ValueError naming the row"

SAMPLED_SETTINGS = {
    "t1.0": SamplingParams(temperature=1.0, max_new_tokens=KIT_WIDTH, seed=7),
    "t0.7": SamplingParams(temperature=0.7, max_new_tokens=KIT_WIDTH, seed=8),
    "t0.7-topk5": SamplingParams(temperature=0.7, top_k=5, max_new_tokens=KIT_WIDTH, seed=9),
    "t0.7-topp0.8": SamplingParams(temperature=0.7, top_p=0.8, max_new_tokens=KIT_WIDTH, seed=10),
}
GREEDY_PARAMS = SamplingParams(temperature=0.0, max_new_tokens=KIT_WIDTH)


def buckets_of(weights: dict[str, torch.Tensor], parts: int = 3) -> list[list[tuple[str, torch.Tensor]]]:
    """The weights in ``parts`` buckets of fresh copies, like a trainer's export."""
    items = [(name, tensor.clone()) for name, tensor in weights.items()]
    size = -(-len(items) // parts)
    return [items[i:i + size] for i in range(0, len(items), size)]


class RolloutEngineContract(KitBase):
    """The rollout-engine battery. Subclass with ``backend = "<registered rollout name>"``; optional class
    attributes: ``device``, ``dtype``, ``engine_options``, ``logprob_atol``, ``greedy_tie_tolerance``."""

    #: a greedy token may differ from the reference argmax when their log-probs are closer than this (a
    #: near-tie that numerical noise may break either way); a sampled token may be the first past a
    #: top-k/top-p edge by as little (``hybridrl.testing.reference.near_support_edge``).
    greedy_tie_tolerance: float = 1e-4
    #: both tolerances widened by this fraction of a row's largest reference logit (16-bit engines; see
    #: ``hybridrl.testing.checks.reference_problems``).
    logit_rtol: float = 0.0

    # --- fixtures -------------------------------------------------------------------------------------
    @pytest.fixture(scope="class")
    def kit_device(self, request: pytest.FixtureRequest, backend_name: str) -> str:
        return backends.pick_device("rollout", backend_name, self.device or cli_device(request.config))

    @pytest.fixture(scope="class")
    def make_rollout(self, request: pytest.FixtureRequest, backend_name: str, kit_device: str,
                     kit_models: KitModels) -> Callable[..., Any]:
        return engine_factory("rollout", backend_name, kit_models.policy, kit_device, self.dtype,
                              lambda role, **o: self._options(request.config, role, **o))

    @pytest.fixture(scope="class")
    def engine_slot(self, make_rollout: Callable[..., Any]) -> Iterator[EngineSlot]:
        slot = EngineSlot(make_rollout)
        yield slot
        slot.drop()

    @pytest.fixture
    def rollout(self, engine_slot: EngineSlot) -> Any:
        """The engine shared by the tests that do not change its state."""
        return engine_slot.shared()

    @pytest.fixture
    def fresh_rollout(self, engine_slot: EngineSlot) -> Iterator[Any]:
        """An engine of its own for a test that imports weights or sleeps (the shared one is dropped first)."""
        yield engine_slot.fresh()
        engine_slot.drop()

    @pytest.fixture(scope="class")
    def policy_ref(self, kit_models: KitModels) -> ReferenceModel:
        return ReferenceModel(kit_models.policy)

    @pytest.fixture(scope="class")
    def other_ref(self, kit_models: KitModels) -> ReferenceModel:
        return ReferenceModel(kit_models.other)

    @pytest.fixture(scope="class")
    def prompts(self, kit_models: KitModels) -> Batch:
        """The kit's prompts, left-padded two columns wider than the longest one (as a data-parallel chunk
        of a wider batch is)."""
        width = max(len(p) for p in kit_models.prompts) + 2
        return prompt_batch(kit_models.prompts, kit_models.pad_id, width)

    @pytest.fixture
    def greedy_out(self, engine_slot: EngineSlot, rollout: Any, prompts: Batch) -> Batch:
        return engine_slot.cached("greedy", lambda: rollout.generate(prompts, GREEDY_PARAMS))

    @pytest.fixture
    def greedy_vs_reference(self, engine_slot: EngineSlot, greedy_out: Batch, kit_models: KitModels,
                            policy_ref: ReferenceModel) -> tuple[list[str], list[str]]:
        return engine_slot.cached("greedy_vs_reference",
                                  lambda: self._reference(greedy_out, kit_models, policy_ref, GREEDY_PARAMS))

    # --- helpers --------------------------------------------------------------------------------------
    def _reference(self, out: Batch, kit: KitModels, ref: ReferenceModel, params: SamplingParams,
                   prompts: tuple[tuple[int, ...], ...] | None = None) -> tuple[list[str], list[str]]:
        """(token problems, log-prob problems) against ``ref``."""
        return reference_problems(out, prompts or kit.prompts, ref, params, kit.eos_ids, self.logprob_atol,
                                  self.greedy_tie_tolerance, self.logit_rtol)

    def _matches(self, out: Batch, kit: KitModels, ref: ReferenceModel, params: SamplingParams) -> list[str]:
        tokens, log_probs = self._reference(out, kit, ref, params)
        return tokens + log_probs

    def _same_outputs(self, a: Batch, b: Batch) -> list[str]:
        problems = []
        for key in (RESPONSE_IDS, RESPONSE_MASK):
            if not torch.equal(a[key], b[key]):
                problems.append(f"{key} before: {a[key].tolist()}\n  {key} after:  {b[key].tolist()}")
        diff = float((a[ROLLOUT_LOG_PROBS] - b[ROLLOUT_LOG_PROBS]).abs().max()) if not problems else 0.0
        if diff > self.logprob_atol:
            problems.append(f"rollout_log_probs moved by up to {diff:.2e}")
        return problems

    # --- output layout and stopping -----------------------------------------------------------------
    def test_output_layout(self, backend_name: str, rollout: Any, prompts: Batch, kit_models: KitModels,
                           greedy_out: Batch) -> None:
        sampled = rollout.generate(prompts, SAMPLED_SETTINGS["t1.0"])
        for what, out in (("greedy", greedy_out), ("sampled", sampled)):
            problems = layout_problems(out, len(prompts), KIT_WIDTH, kit_models.vocab_size)
            check(backend_name, LAYOUT, [f"{what}: {p}" for p in problems])

    def test_rows_end_at_eos_inside_the_mask(self, backend_name: str, greedy_out: Batch, kit_models: KitModels
                                             ) -> None:
        check(backend_name, LAYOUT, layout_problems(greedy_out, len(kit_models.prompts), KIT_WIDTH,
                                                    kit_models.vocab_size))
        check(backend_name, STOPPING, stop_problems(greedy_out, kit_models.eos_ids, GREEDY_PARAMS))

    def test_ignore_eos_fills_every_row(self, backend_name: str, rollout: Any, prompts: Batch,
                                        kit_models: KitModels, policy_ref: ReferenceModel) -> None:
        params = SamplingParams(temperature=0.0, max_new_tokens=KIT_WIDTH, ignore_eos=True)
        out = rollout.generate(prompts, params)
        check(backend_name, LAYOUT, layout_problems(out, len(prompts), KIT_WIDTH, kit_models.vocab_size))
        check(backend_name, IGNORE_EOS, stop_problems(out, kit_models.eos_ids, params))
        check(backend_name, GREEDY, self._reference(out, kit_models, policy_ref, params)[0])

    def test_min_new_tokens_holds_back_eos(self, backend_name: str, rollout: Any, prompts: Batch,
                                           kit_models: KitModels, policy_ref: ReferenceModel) -> None:
        params = SamplingParams(temperature=0.0, max_new_tokens=KIT_WIDTH, min_new_tokens=KIT_WIDTH - 1)
        out = rollout.generate(prompts, params)
        check(backend_name, LAYOUT, layout_problems(out, len(prompts), KIT_WIDTH, kit_models.vocab_size))
        check(backend_name, MIN_NEW, stop_problems(out, kit_models.eos_ids, params))
        tokens, log_probs = self._reference(out, kit_models, policy_ref, params)
        check(backend_name, MIN_NEW, tokens)
        check(backend_name, LOG_PROBS, log_probs)

    # --- agreement with transformers ----------------------------------------------------------------
    def test_greedy_is_the_reference_argmax(self, backend_name: str,
                                            greedy_vs_reference: tuple[list[str], list[str]]) -> None:
        check(backend_name, GREEDY, greedy_vs_reference[0])

    def test_greedy_log_probs_match_the_reference(self, backend_name: str,
                                                  greedy_vs_reference: tuple[list[str], list[str]]) -> None:
        check(backend_name, LOG_PROBS, greedy_vs_reference[1])

    @pytest.mark.parametrize("setting", list(SAMPLED_SETTINGS))
    def test_sampled_log_probs_match_the_reference(self, backend_name: str, rollout: Any, kit_models: KitModels,
                                                   policy_ref: ReferenceModel, setting: str) -> None:
        params = SAMPLED_SETTINGS[setting]
        prompts = kit_models.prompts * 2  # more sampled tokens per call
        out = rollout.generate(prompt_batch(prompts, kit_models.pad_id), params)
        check(backend_name, LAYOUT, layout_problems(out, len(prompts), KIT_WIDTH, kit_models.vocab_size))
        check(backend_name, STOPPING, stop_problems(out, kit_models.eos_ids, params))
        tokens, log_probs = self._reference(out, kit_models, policy_ref, params, prompts)
        check(backend_name, SAMPLING, tokens)
        check(backend_name, LOG_PROBS, log_probs)

    # --- bad inputs -----------------------------------------------------------------------------------
    def _expect_row_error(self, backend_name: str, contract: str, engine: Any, batch: Batch, row: int) -> None:
        try:
            engine.generate(batch, SamplingParams(temperature=0.0, max_new_tokens=4))
        except ValueError as exc:
            if f"row {row}" not in str(exc):
                violated(backend_name, contract, [f"ValueError raised but its message does not name 'row {row}': "
                                                  f"{exc}"])
            return
        except Exception as exc:  # noqa: BLE001 - the wrong error type is the finding
            violated(backend_name, contract, [f"raised {type(exc).__name__} instead of ValueError: {exc}"])
        violated(backend_name, contract, [f"generate accepted the batch (bad row {row})"])

    def test_empty_prompt_is_refused(self, backend_name: str, rollout: Any, kit_models: KitModels) -> None:
        p = kit_models.prompts
        with_empty = prompt_batch([p[0], [], p[1]], kit_models.pad_id)
        self._expect_row_error(backend_name, EMPTY_PROMPT, rollout, with_empty, 1)

    def test_prompt_over_the_context_is_refused(self, backend_name: str, rollout: Any, kit_models: KitModels
                                                ) -> None:
        p = kit_models.prompts
        too_long = [p[1][i % len(p[1])] for i in range(kit_models.context_length + 1)]
        self._expect_row_error(backend_name, LONG_PROMPT, rollout,
                               prompt_batch([p[0], p[1], too_long], kit_models.pad_id), 2)

    # --- weights and memory -------------------------------------------------------------------------
    def test_import_weights_gives_the_reference_model(self, backend_name: str, fresh_rollout: Any, prompts: Batch,
                                                      kit_models: KitModels, other_ref: ReferenceModel) -> None:
        for bucket in buckets_of(other_ref.named_weights()):
            fresh_rollout.import_weights(bucket)
        fresh_rollout.finish_weight_import()
        out = fresh_rollout.generate(prompts, GREEDY_PARAMS)
        check(backend_name, LAYOUT, layout_problems(out, len(prompts), KIT_WIDTH, kit_models.vocab_size))
        check(backend_name, IMPORT, self._matches(out, kit_models, other_ref, GREEDY_PARAMS))

    def test_import_weights_copies_the_bucket(self, backend_name: str, fresh_rollout: Any, prompts: Batch,
                                              kit_models: KitModels, other_ref: ReferenceModel) -> None:
        buckets = buckets_of(other_ref.named_weights())
        for bucket in buckets:
            fresh_rollout.import_weights(bucket)
        fresh_rollout.finish_weight_import()
        with torch.no_grad():
            for bucket in buckets:  # the broadcast bridge reuses its receive buffer for the next bucket
                for _, tensor in bucket:
                    tensor.normal_()
        out = fresh_rollout.generate(prompts, GREEDY_PARAMS)
        check(backend_name, IMPORT_COPIES, self._matches(out, kit_models, other_ref, GREEDY_PARAMS))

    def test_sleep_and_wake_keep_outputs(self, backend_name: str, fresh_rollout: Any, prompts: Batch) -> None:
        before = fresh_rollout.generate(prompts, GREEDY_PARAMS)
        fresh_rollout.sleep()
        fresh_rollout.wake()
        check(backend_name, SLEEP, self._same_outputs(before, fresh_rollout.generate(prompts, GREEDY_PARAMS)))

    def test_import_weights_while_asleep(self, backend_name: str, fresh_rollout: Any, prompts: Batch,
                                         kit_models: KitModels, other_ref: ReferenceModel) -> None:
        fresh_rollout.generate(prompts, GREEDY_PARAMS)
        fresh_rollout.sleep()
        for bucket in buckets_of(other_ref.named_weights()):
            fresh_rollout.import_weights(bucket)
        fresh_rollout.finish_weight_import()
        fresh_rollout.wake()
        out = fresh_rollout.generate(prompts, GREEDY_PARAMS)
        check(backend_name, IMPORT_ASLEEP, self._matches(out, kit_models, other_ref, GREEDY_PARAMS))
