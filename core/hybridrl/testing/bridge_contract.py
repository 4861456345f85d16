"""``BridgeContract``: a (trainer, rollout) backend pair joined by ``hybridrl.weights.bridges.sync_in_process``.

After one real update the trainer holds weights that neither engine started from; after a sync the rollout
must hold exactly those (by name where it exposes ``named_weights``, and by behaviour always: its greedy
outputs and log-probs are those of a transformers model given the trainer's exported weights).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hybridrl.engines import SamplingParams
from hybridrl.testing import backends
from hybridrl.testing.batches import PolicyGradientLoss, prompt_batch, sequence_batch
from hybridrl.testing.checks import check, layout_problems, reference_problems, violated
from hybridrl.testing.fixtures import KitBase, cli_device, free_device_memory
from hybridrl.testing.models import KIT_WIDTH, KitModels
from hybridrl.testing.reference import ReferenceModel
from hybridrl.testing.train_contract import exported, weight_problems
from hybridrl.weights.bridges import VIEW_BUCKET_BYTES, sync_in_process

SYNC = "rollout weights after sync_in_process differ from the trainer's"
BUCKETS = ("sync_in_process must stream the weights in buckets of about bucket_bytes (one at a time in memory), "
           "unless both sides declare that no memory is at stake (trainer.transient_export_holds_views() and "
           "rollout.imports_without_staging()): then in buckets of at least VIEW_BUCKET_BYTES")
SYNC_ASLEEP = "a sync into a sleeping rollout (as the colocated trainer does) must be in effect after wake"
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=KIT_WIDTH)
#: small buckets: a sync of the kit's model takes several (the bridge streams them one at a time).
BUCKET_BYTES = 64 * 1024


def bucket_problems(stats: dict[str, float], trainer: Any, rollout: Any, sent: dict[str, torch.Tensor]) -> list[str]:
    """The bucket count the sync reported against what the two engines declare (asked after the sync: an
    importer may learn only during its first import that it copies in place). ``sent``: the weights synced,
    for the largest tensor (a bucket may run past its size by one tensor)."""
    total, count = float(stats.get("bytes", 0.0)), int(stats.get("buckets", 0))
    holds_views, no_staging = bool(trainer.transient_export_holds_views()), bool(rollout.imports_without_staging())
    size = max(BUCKET_BYTES, VIEW_BUCKET_BYTES) if holds_views and no_staging else BUCKET_BYTES
    per_element = total / max(1, sum(t.numel() for t in sent.values()))
    largest = per_element * max((t.numel() for t in sent.values()), default=0)
    least = max(1, int(total // (size + largest)))
    if count < least:
        return [f"{total:.0f} bytes came in {count} bucket(s): buckets of {size} bytes (each at most one tensor, "
                f"{largest:.0f} bytes, over) make at least {least}; bucket_bytes={BUCKET_BYTES}, "
                f"trainer.transient_export_holds_views()={holds_views}, rollout.imports_without_staging()={no_staging}"]
    return []


class BridgeContract(KitBase):
    """The bridge battery for one pair. Subclass with ``trainer_backend`` and ``rollout_backend`` names."""

    trainer_backend: str | None = None
    rollout_backend: str | None = None
    #: a greedy token may differ from the reference argmax within this log-prob gap (near-ties).
    greedy_tie_tolerance: float = 1e-4
    #: both tolerances widened by this fraction of a row's largest reference logit (16-bit engines; see
    #: ``hybridrl.testing.checks.reference_problems``).
    logit_rtol: float = 0.0
    #: |rollout weight - trainer export| allowed (0 when both hold fp32).
    weight_atol: float = 0.0

    @pytest.fixture(scope="class")
    def bridge_pair(self) -> tuple[str, str]:
        if not (self.trainer_backend and self.rollout_backend):
            pytest.fail(f"{type(self).__name__}: set trainer_backend and rollout_backend", pytrace=False)
        return self.trainer_backend, self.rollout_backend

    @pytest.fixture(scope="class")
    def kit_device(self, request: pytest.FixtureRequest, bridge_pair: tuple[str, str]) -> tuple[str, str]:
        """(trainer device, rollout device)."""
        requested = self.device or cli_device(request.config)
        return (backends.pick_device("train", bridge_pair[0], requested),
                backends.pick_device("rollout", bridge_pair[1], requested))

    def _engines(self, config: pytest.Config, pair: tuple[str, str], devices: tuple[str, str], kit: KitModels
                 ) -> tuple[Any, Any]:
        trainer = backends.build_engine("train", pair[0], str(kit.policy), devices[0], self.dtype,
                                        options=self._options(config, "actor", lr=1e-2, micro_batch=2))
        rollout = backends.build_engine("rollout", pair[1], str(kit.policy), devices[1], self.dtype,
                                        options=self._options(config, "rollout"))
        return trainer, rollout

    def _run(self, request: pytest.FixtureRequest, pair: tuple[str, str], devices: tuple[str, str], kit: KitModels,
             asleep: bool) -> None:
        label = f"{pair[0]} -> {pair[1]}"
        trainer, rollout = self._engines(request.config, pair, devices, kit)
        try:
            start = exported(trainer)
            trainer.update(sequence_batch(6, seed=3, vocab_size=kit.vocab_size, pad_id=kit.pad_id),
                           PolicyGradientLoss())
            want = exported(trainer)
            if not weight_problems(start, want):
                violated(label, "the trainer's update must change its weights", ["every weight is unchanged"])
            if asleep:
                rollout.sleep()
            stats = sync_in_process(trainer, rollout, BUCKET_BYTES)
            if asleep:
                rollout.wake()
            contract = SYNC_ASLEEP if asleep else SYNC
            check(label, contract, self._named_problems(rollout, pair[1], want))
            ref = ReferenceModel(kit.policy, want.items())
            prompts = prompt_batch(kit.prompts, kit.pad_id)
            out = rollout.generate(prompts, GREEDY)
            check(label, contract, layout_problems(out, len(prompts), KIT_WIDTH, kit.vocab_size))
            tokens, log_probs = reference_problems(out, kit.prompts, ref, GREEDY, kit.eos_ids, self.logprob_atol,
                                                   self.greedy_tie_tolerance, self.logit_rtol)
            check(label, contract, tokens + log_probs)
            check(label, BUCKETS, bucket_problems(stats, trainer, rollout, want))
        finally:
            del trainer, rollout
            free_device_memory()

    def _named_problems(self, rollout: Any, rollout_name: str, want: dict[str, torch.Tensor]) -> list[str]:
        """Compare by name when the rollout declares ``named_weights`` (optional capability)."""
        if not backends.entry("rollout", rollout_name).can("named_weights"):
            return []
        have = {n: t.detach().to("cpu", torch.float32) for n, t in rollout.named_weights()}
        if "lm_head.weight" not in want and "model.embed_tokens.weight" in want:
            have.pop("lm_head.weight", None)  # tied: one tensor under two names
        problems = [f"the rollout has no weight '{n}'" for n in want if n not in have]
        return problems + weight_problems({n: t for n, t in want.items() if n in have}, have, self.weight_atol)

    def test_sync_gives_the_rollout_the_trainer_weights(self, request: pytest.FixtureRequest,
                                                        bridge_pair: tuple[str, str], kit_device: tuple[str, str],
                                                        kit_models: KitModels) -> None:
        self._run(request, bridge_pair, kit_device, kit_models, asleep=False)

    def test_sync_into_a_sleeping_rollout(self, request: pytest.FixtureRequest, bridge_pair: tuple[str, str],
                                          kit_device: tuple[str, str], kit_models: KitModels) -> None:
        self._run(request, bridge_pair, kit_device, kit_models, asleep=True)
