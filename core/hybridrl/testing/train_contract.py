"""``TrainEngineContract``: the battery every train backend must pass (subclass it with ``backend = "name"``).

The engine is built as the worker builds it (``EngineContext`` for rank 0 of 1, in a one-rank process
group, with the options a real run gives the role) from the kit's HF checkpoint, and compared with that
checkpoint and with a transformers forward pass.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridrl.engines.batch import (
    ADVANTAGES,
    ENTROPY,
    LOG_PROBS,
    PROMPT_IDS,
    PROMPT_MASK,
    RESPONSE_IDS,
    RESPONSE_MASK,
    ROUTED_EXPERTS,
    ROUTING_MISMATCH,
    SCORES,
    VALUES,
    Batch,
    left_pad,
    right_pad,
)
from hybridrl.lora import LoraSpec
from hybridrl.testing import backends
from hybridrl.testing.batches import FIRST_PLAIN_ID, PolicyGradientLoss, policy_gradient_loss, rows, sequence_batch
from hybridrl.testing.checks import check, violated
from hybridrl.testing.fixtures import KitBase, cli_device, engine_factory, free_device_memory
from hybridrl.testing.lora import TRAIN_LORA, adapter_name_problems, merged
from hybridrl.testing.models import KitModels
from hybridrl.testing.reference import ReferenceModel, entropy
from hybridrl.testing.routing import KIT_MOE, ForcedRouting, random_routing
from hybridrl.weights.sync_check import GREEDY_MARGIN

REPLAY = ("routing_replay: compute_log_probs given routed_experts and info['routing_replay'] must route each "
          "response token to those experts (weights from the router's own logits) and return routing_mismatch")
EXPORT = "export_weights must give back the HF checkpoint it was built from, exactly, each name once"
LAYOUT = "compute_log_probs must return log_probs (and entropy when asked) as float32 (rows, response width) on CPU"
LOG_PROBS_AGREE = "log-probs must agree with a transformers forward pass (logits divided by info['temperature'])"
ZERO_LR = "an update with lr=0 must leave the weights unchanged"
DESCENT = "an update with lr>0 must lower the loss on its batch"
METRICS = "update must return its metrics as a dict of str -> float"
OFFLOAD = "offload/onload must keep the weights"
CHECKPOINT = "save_checkpoint/load_checkpoint must round-trip weights and optimiser state"
INDEPENDENT = ("each update must start from zero gradients: after an update, an update whose loss has no gradient "
               "(advantages all 0; betas=(0, 0), weight_decay=0: no momentum, no decay) must leave the weights "
               "unchanged (an engine that never zeroes its gradients applies the previous update's again)")

POSITIONS = ("log-probs of a left-padded row must be those of its tokens alone: position ids count from the row's "
             "first real token (checked on an absolute-position model, GPT-2)")

MARGINS = ("compute_greedy_margins (capability 'greedy_margins') must give max(logits) - logits[token] of a "
           "transformers forward at each response token, float32 (rows, response width) on CPU, 0 at padding")
VALUES_HEAD = ("compute_values (capability 'value_head') must give float32 (rows, response width) values on CPU, 0 at "
               "padding, each the value of the tokens before it: the same for a row alone as in its padded batch, and "
               "unchanged at every position when the row's last response token changes")
REWARD_HEAD = ("compute_scores (capability 'reward_head') must give one float32 score per row on CPU, read at the "
               "row's last real token: the same for a row alone as in its padded batch, changed when that token "
               "changes")

LORA_ONLY_ADAPTERS = ("with LoRA (capability 'lora') an update must train the adapters alone: export_adapter "
                      "changes, the base (reference_view's export_weights) stays the checkpoint")
LORA_NAMES = ("export_adapter (capability 'lora') must give every adapter once under peft's saved names "
              "(base_model.model.<module>.lora_A/B.weight), A (rank, in) and B (out, rank), for layers of the "
              "checkpoint")
LORA_MERGED = ("export_weights of a LoRA engine (capability 'lora') must be the policy: the checkpoint with "
               "alpha/rank * B @ A added to each adapted weight, under HF names, and the engine's log-probs those of "
               "a transformers forward of these weights")
LORA_REFERENCE = ("reference_view of a LoRA engine (capability 'lora') must compute the base's log-probs (the "
                  "checkpoint's: adapters disabled) after the adapters trained")
FUSED_CPU = ("options.fused_kernels (capability 'fused_layer_kernels') off CUDA must be refused with a ValueError "
             "naming fused_kernels, or fall back to log-probs that agree with a transformers forward")
FUSED_AGREE = ("options.fused_kernels: true (capability 'fused_layer_kernels') must give the log-probs and entropies "
               "of the unfused engine, within fused_atol")

SEQUENCE_KEYS = (PROMPT_IDS, PROMPT_MASK, RESPONSE_IDS, RESPONSE_MASK)


def exported(engine: Any, bucket_bytes: int = 1 << 30) -> dict[str, torch.Tensor]:
    """The engine's full weights as fp32 CPU copies."""
    return {n: t.detach().to("cpu", torch.float32).clone() for b in engine.export_weights(bucket_bytes) for n, t in b}


def weight_problems(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], atol: float = 0.0) -> list[str]:
    problems = [f"'{n}' missing" for n in before if n not in after]
    for name, tensor in before.items():
        if name in after:
            diff = float((after[name] - tensor).abs().max()) if tensor.numel() else 0.0
            if diff > atol:
                problems.append(f"'{name}' differs by up to {diff:.3g}")
    return problems


def checkpoint_weights(kit: KitModels) -> dict[str, torch.Tensor]:
    """The kit policy's saved tensors in fp32."""
    from safetensors.torch import load_file

    return {n: t.float() for n, t in load_file(str(kit.policy / "model.safetensors")).items()}


def export_problems(saved: dict[str, torch.Tensor], got: dict[str, torch.Tensor], tied: bool, atol: float
                    ) -> list[str]:
    """``got`` (an export) against ``saved``: the same names (a tied output head may be left out) and values."""
    saved = dict(saved)
    if tied and "lm_head.weight" in got and "model.embed_tokens.weight" in saved:
        saved.setdefault("lm_head.weight", saved["model.embed_tokens.weight"])
    problems = [f"'{n}' not exported" for n in saved if n not in got and not (tied and n == "lm_head.weight")]
    problems += [f"'{n}' is not a name of the checkpoint" for n in got if n not in saved]
    return problems + weight_problems({n: saved[n] for n in got if n in saved}, got, atol)


def adapters_of(engine: Any, bucket_bytes: int = 1 << 30) -> tuple[list[str], dict[str, torch.Tensor]]:
    """``export_adapter``'s names in order (repeats kept) and fp32 CPU copies."""
    items = [(n, t.detach().to("cpu", torch.float32).clone())
             for b in engine.export_adapter(bucket_bytes) for n, t in b]
    return [n for n, _ in items], dict(items)


class TrainEngineContract(KitBase):
    """The train-engine battery. Subclass with ``backend = "<registered train name>"``; optional class
    attributes: ``device``, ``dtype``, ``engine_options``, ``logprob_atol``, ``lr``, ``export_atol``."""

    #: the positive learning rate of the descent check (``ctx.training.lr``).
    lr: float = 1e-3
    #: |exported - checkpoint| allowed (0: the master weights are the checkpoint's fp32 values).
    export_atol: float = 0.0
    #: sequences per micro-batch (``ctx.training.micro_batch``): the kit's batches need several.
    micro_batch: int = 2
    #: the adapters of the LoRA checks (capability ``lora``) and the learning rate that trains them.
    lora_spec: LoraSpec = TRAIN_LORA
    lora_lr: float = 1e-2
    #: |export_weights - (checkpoint + alpha/rank * B A)| allowed (the merge in fp32 on both sides).
    lora_atol: float = 1e-5
    #: |fused - unfused| allowed between log-probs and entropies on CUDA (``fused_layer_kernels``).
    fused_atol: float = 1e-3

    @pytest.fixture(scope="class")
    def kit_device(self, request: pytest.FixtureRequest, backend_name: str) -> str:
        return backends.pick_device("train", backend_name, self.device or cli_device(request.config))

    @pytest.fixture(scope="class")
    def make_trainer(self, request: pytest.FixtureRequest, backend_name: str, kit_device: str,
                     kit_models: KitModels) -> Callable[..., Any]:
        return engine_factory("train", backend_name, kit_models.policy, kit_device, self.dtype,
                              lambda role, **o: self._options(request.config, role,
                                                              **{"micro_batch": self.micro_batch, **o}))

    @pytest.fixture(scope="class")
    def policy_ref(self, kit_models: KitModels) -> ReferenceModel:
        return ReferenceModel(kit_models.policy)

    @pytest.fixture(scope="class")
    def batch(self, kit_models: KitModels) -> Batch:
        return sequence_batch(6, seed=1, vocab_size=kit_models.vocab_size, pad_id=kit_models.pad_id)

    # --- helpers ----------------------------------------------------------------------------------------
    def _log_prob_problems(self, engine: Any, batch: Batch, ref: ReferenceModel, temperature: float | None,
                           with_entropy: bool) -> tuple[list[str], list[str]]:
        """(layout problems, agreement problems) of ``compute_log_probs`` on ``batch``."""
        sent = batch.select(*SEQUENCE_KEYS)
        if temperature is not None:
            sent.info["temperature"] = temperature
        out = engine.compute_log_probs(sent, with_entropy=with_entropy)
        shape = tuple(batch[RESPONSE_IDS].shape)
        layout: list[str] = []
        for key in (LOG_PROBS, ENTROPY) if with_entropy else (LOG_PROBS,):
            if key not in out:
                layout.append(f"'{key}' missing")
                continue
            t = out[key]
            if tuple(t.shape) != shape or t.dtype != torch.float32 or t.device.type != "cpu":
                layout.append(f"'{key}': {tuple(t.shape)} {t.dtype} on {t.device}, expected {shape} float32 on cpu")
            elif not torch.isfinite(t).all():
                layout.append(f"'{key}' holds non-finite values")
        if layout:
            return layout, []
        agree = []
        mask = batch[RESPONSE_MASK].bool()
        for i, (prompt, response) in enumerate(rows(batch)):
            logits = ref.step_logits(prompt, response)
            if temperature is not None:
                logits = logits / temperature
            expected = {LOG_PROBS: torch.log_softmax(logits, -1)[torch.arange(len(response)), torch.tensor(response)]}
            if with_entropy:
                expected[ENTROPY] = entropy(logits)
            for key, want in expected.items():
                got = out[key][i][mask[i]]
                diff = float((got - want).abs().max())
                if diff > self.logprob_atol:
                    agree.append(f"row {i} '{key}' (temperature {temperature}): |engine - transformers| up to "
                                 f"{diff:.2e} > atol {self.logprob_atol:g}"
                                 + (shifted_by_one(got, prompt, response, ref, temperature, self.logprob_atol)
                                    if key == LOG_PROBS else ""))
        return layout, agree

    def _loss(self, engine: Any, batch: Batch) -> float:
        return policy_gradient_loss(engine.compute_log_probs(batch.select(*SEQUENCE_KEYS))[LOG_PROBS], batch)

    def _update(self, backend_name: str, engine: Any, batch: Batch) -> dict[str, Any]:
        metrics = engine.update(batch, PolicyGradientLoss())
        bad = [] if isinstance(metrics, dict) else [f"got {type(metrics).__name__}"]
        if not bad:
            for key, value in metrics.items():
                try:
                    float(value)
                except (TypeError, ValueError):
                    bad.append(f"'{key}' is {type(value).__name__}")
        check(backend_name, METRICS, bad)
        return metrics

    # --- weights ----------------------------------------------------------------------------------------
    def test_export_is_the_checkpoint(self, backend_name: str, make_trainer: Callable[..., Any],
                                      kit_models: KitModels) -> None:
        saved = checkpoint_weights(kit_models)
        tied = kit_models_tied(kit_models)
        engine = make_trainer()
        for bucket_bytes in (1 << 30, 4096):
            buckets = list(engine.export_weights(bucket_bytes))
            names = [n for b in buckets for n, _ in b]
            problems = [f"bucket_bytes={bucket_bytes}: '{n}' exported {names.count(n)} times"
                        for n in sorted(set(names)) if names.count(n) > 1]
            got = {n: t.detach().to("cpu", torch.float32) for b in buckets for n, t in b}
            problems += [f"bucket_bytes={bucket_bytes}: {p}" for p in export_problems(saved, got, tied,
                                                                                      self.export_atol)]
            check(backend_name, EXPORT, problems)

    def test_log_probs_match_transformers(self, backend_name: str, make_trainer: Callable[..., Any], batch: Batch,
                                          policy_ref: ReferenceModel) -> None:
        engine = make_trainer()
        for temperature, with_entropy in ((None, False), (None, True), (0.7, True)):
            layout, agree = self._log_prob_problems(engine, batch, policy_ref, temperature, with_entropy)
            check(backend_name, LAYOUT, layout)
            check(backend_name, LOG_PROBS_AGREE, agree)

    def test_frozen_engine_log_probs_match_transformers(self, backend_name: str, make_trainer: Callable[..., Any],
                                                        batch: Batch, policy_ref: ReferenceModel) -> None:
        engine = make_trainer(role="ref")  # trainable=False, as the reference policy is built
        layout, agree = self._log_prob_problems(engine, batch, policy_ref, None, False)
        check(backend_name, LAYOUT, layout)
        check(backend_name, LOG_PROBS_AGREE, agree)

    def test_left_padding_keeps_positions(self, backend_name: str, make_trainer: Callable[..., Any], batch: Batch,
                                          position_model: Path) -> None:
        """The kit's left-padded batch scored by a GPT-2 (learned absolute positions), against each row alone."""
        engine = make_trainer(path=position_model)
        layout, agree = self._log_prob_problems(engine, batch, ReferenceModel(position_model), None, False)
        check(backend_name, LAYOUT, layout)
        check(backend_name, POSITIONS, agree)

    # --- declared capabilities: the heads ---------------------------------------------------------------
    def _declares(self, backend_name: str, capability: str) -> None:
        if not backends.entry("train", backend_name).can(capability):
            pytest.skip(f"'{backend_name}' does not declare the '{capability}' capability (supports=...)")

    @pytest.fixture(scope="class")
    def moe_model(self, tmp_path_factory: pytest.TempPathFactory) -> Path:
        from hybridrl.model.tiny import build_tiny_model

        return build_tiny_model(KIT_MOE, tmp_path_factory.mktemp("kit-moe") / "model")

    def test_routing_replay_routes_by_the_given_experts(self, backend_name: str, make_trainer: Callable[..., Any],
                                                        moe_model: Path) -> None:
        """Given random experts for every response token, the log-probs are those of a transformers forward
        routed by them, and ``routing_mismatch`` marks where the engine's own top-k differs (0 at padding)."""
        self._declares(backend_name, "routing_replay")
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(moe_model))
        batch = sequence_batch(4, seed=7, vocab_size=config.vocab_size, pad_id=config.pad_token_id)
        mask = batch[RESPONSE_MASK]
        given = random_routing(mask, KIT_MOE.num_layers, KIT_MOE.num_experts, KIT_MOE.experts_per_token, seed=7)
        sent = batch.select(*SEQUENCE_KEYS)
        sent.set(ROUTED_EXPERTS, given)
        sent.info["routing_replay"] = True
        out = make_trainer(path=moe_model).compute_log_probs(sent)
        shape = tuple(mask.shape)
        got = out[ROUTING_MISMATCH] if ROUTING_MISMATCH in out else None
        if got is None or tuple(got.shape) != shape:
            violated(backend_name, REPLAY, [f"'{ROUTING_MISMATCH}': {None if got is None else tuple(got.shape)}, "
                                            f"expected {shape}"])
        problems = [] if bool((got[~mask.bool()] == 0).all()) else ["routing_mismatch is not 0 at padding"]
        if float(got.sum()) == 0:
            problems.append("routing_mismatch is 0 everywhere although the experts given are random")
        reference = ForcedRouting(moe_model)
        for i, (prompt, response) in enumerate(rows(batch)):
            want = reference.log_probs(prompt, response, given[i, :len(response)])
            diff = float((out[LOG_PROBS][i, :len(response)] - want).abs().max())
            if diff > self.logprob_atol:
                problems.append(f"row {i}: log-probs differ from the forward routed by the given experts by {diff:.3g}")
        check(backend_name, REPLAY, problems)

    def test_greedy_margins_match_transformers(self, backend_name: str, make_trainer: Callable[..., Any],
                                               batch: Batch, policy_ref: ReferenceModel) -> None:
        self._declares(backend_name, "greedy_margins")
        out = make_trainer(role="ref").compute_greedy_margins(batch.select(*SEQUENCE_KEYS))
        got = out[GREEDY_MARGIN] if GREEDY_MARGIN in out else None
        shape = tuple(batch[RESPONSE_IDS].shape)
        if got is None or tuple(got.shape) != shape or got.dtype != torch.float32 or got.device.type != "cpu":
            found = None if got is None else (tuple(got.shape), got.dtype, got.device)
            violated(backend_name, MARGINS, [f"'{GREEDY_MARGIN}': {found}, expected {shape} float32 on cpu"])
        mask = batch[RESPONSE_MASK].bool()
        problems = [f"row {i}: {float(got[i][~mask[i]].abs().max()):.3g} at padding" for i in range(len(batch))
                    if (~mask[i]).any() and bool(got[i][~mask[i]].ne(0).any())]
        for i, (prompt, response) in enumerate(rows(batch)):
            logits = policy_ref.step_logits(prompt, response)
            want = logits.max(-1).values - logits[torch.arange(len(response)), torch.tensor(response)]
            diff = float((got[i][mask[i]] - want).abs().max())
            if diff > self.logprob_atol:
                problems.append(f"row {i}: |engine - transformers| up to {diff:.2e} > atol {self.logprob_atol:g}")
        check(backend_name, MARGINS, problems)

    def _row_alone_problems(self, compute: Callable[[Batch], torch.Tensor], batch: Batch, atol: float
                            ) -> list[str]:
        """A row scored alone (no padding) against the same row in the padded batch."""
        together = compute(batch)
        problems = []
        for i, (prompt, response) in enumerate(rows(batch)):
            ids, mask = left_pad([prompt], 0)
            response_ids, response_mask = right_pad([response], 0)
            alone = compute(Batch.from_tensors({PROMPT_IDS: ids, PROMPT_MASK: mask, RESPONSE_IDS: response_ids,
                                                RESPONSE_MASK: response_mask}))[0]
            alone = torch.nn.functional.pad(alone, (0, together.shape[1] - alone.shape[0])) if alone.dim() else alone
            diff = float((alone - together[i]).abs().max())
            if diff > atol:
                problems.append(f"row {i}: alone and in the batch differ by up to {diff:.2e} > atol {atol:g}")
        return problems

    def _last_token_changed(self, batch: Batch, vocab_size: int) -> tuple[Batch, int]:
        """The batch with row 0's last response token replaced (row 0 fills the width); its position."""
        changed = batch.select(*SEQUENCE_KEYS).index(list(range(len(batch))))
        last = int(changed[RESPONSE_MASK][0].sum()) - 1
        ids = changed[RESPONSE_IDS].clone()
        ids[0, last] = FIRST_PLAIN_ID + (int(ids[0, last]) - FIRST_PLAIN_ID + 1) % (vocab_size - FIRST_PLAIN_ID)
        changed.set(RESPONSE_IDS, ids)
        return changed, last

    def test_value_head_reads_the_tokens_before(self, backend_name: str, make_trainer: Callable[..., Any],
                                                batch: Batch, kit_models: KitModels) -> None:
        self._declares(backend_name, "value_head")
        engine = make_trainer(role="critic")
        sent = batch.select(*SEQUENCE_KEYS)
        values = engine.compute_values(sent)[VALUES]
        shape = tuple(batch[RESPONSE_IDS].shape)
        if tuple(values.shape) != shape or values.dtype != torch.float32 or values.device.type != "cpu":
            violated(backend_name, VALUES_HEAD, [f"'{VALUES}': {tuple(values.shape)} {values.dtype} on "
                                                 f"{values.device}, expected {shape} float32 on cpu"])
        mask = batch[RESPONSE_MASK].bool()
        problems = [] if torch.isfinite(values).all() else ["values not finite"]
        problems += [f"row {i}: non-zero values at padding" for i in range(len(batch))
                     if values[i][~mask[i]].ne(0).any()]
        problems += self._row_alone_problems(lambda b: engine.compute_values(b)[VALUES], sent, self.logprob_atol)
        changed, last = self._last_token_changed(batch, kit_models.vocab_size)
        moved = float((engine.compute_values(changed)[VALUES][0] - values[0]).abs().max())
        if moved > self.logprob_atol:
            problems.append(f"row 0: changing response token {last} (its last) moved its values by up to {moved:.2e}: "
                            f"a value must see only the tokens before its position")
        check(backend_name, VALUES_HEAD, problems)

    def test_reward_head_scores_each_row(self, backend_name: str, make_trainer: Callable[..., Any], batch: Batch,
                                         kit_models: KitModels) -> None:
        self._declares(backend_name, "reward_head")
        engine = make_trainer(role="reward")
        sent = batch.select(*SEQUENCE_KEYS)
        scores = engine.compute_scores(sent)[SCORES]
        if tuple(scores.shape) != (len(batch),) or scores.dtype != torch.float32 or scores.device.type != "cpu":
            violated(backend_name, REWARD_HEAD, [f"'{SCORES}': {tuple(scores.shape)} {scores.dtype} on "
                                                 f"{scores.device}, expected ({len(batch)},) float32 on cpu"])
        problems = [] if torch.isfinite(scores).all() else [f"scores not finite: {scores.tolist()}"]
        problems += self._row_alone_problems(lambda b: engine.compute_scores(b)[SCORES][:, None], sent,
                                             self.logprob_atol)
        changed, last = self._last_token_changed(batch, kit_models.vocab_size)
        if float((engine.compute_scores(changed)[SCORES][0] - scores[0]).abs()) == 0.0:
            problems.append(f"row 0: changing its last response token ({last}) left its score as it was")
        check(backend_name, REWARD_HEAD, problems)

    # --- declared capabilities: LoRA ------------------------------------------------------------------------
    @pytest.fixture(scope="class")
    def lora_trained(self, backend_name: str, make_trainer: Callable[..., Any], batch: Batch
                     ) -> tuple[Any, dict[str, torch.Tensor]]:
        """A LoRA engine after one update (lr ``lora_lr``), and its adapters before it."""
        self._declares(backend_name, "lora")
        engine = make_trainer(lora=self.lora_spec, lr=self.lora_lr)
        _, before = adapters_of(engine)
        self._update(backend_name, engine, batch)
        return engine, before

    def _reference_view(self, request: pytest.FixtureRequest, backend_name: str, engine: Any, kit_device: str,
                        kit_models: KitModels) -> Any:
        """The reference role's view of ``engine``, its context made as the worker makes it."""
        ctx = backends.engine_context("train", backend_name, str(kit_models.policy), kit_device, self.dtype, "ref",
                                      self._options(request.config, "ref", micro_batch=self.micro_batch))
        return engine.reference_view(ctx)

    def test_lora_update_trains_only_the_adapters(self, request: pytest.FixtureRequest, backend_name: str,
                                                  lora_trained: tuple[Any, dict[str, torch.Tensor]], kit_device: str,
                                                  kit_models: KitModels) -> None:
        engine, before = lora_trained
        _, after = adapters_of(engine)
        problems = [] if weight_problems(before, after) else [
            f"an update with lr={self.lora_lr} left every adapter unchanged"]
        base = exported(self._reference_view(request, backend_name, engine, kit_device, kit_models))
        problems += [f"the base after the update: {p}" for p in export_problems(
            checkpoint_weights(kit_models), base, kit_models_tied(kit_models), self.export_atol)]
        check(backend_name, LORA_ONLY_ADAPTERS, problems)

    def test_lora_export_adapter_has_peft_names(self, backend_name: str,
                                                lora_trained: tuple[Any, dict[str, torch.Tensor]],
                                                kit_models: KitModels) -> None:
        engine, _ = lora_trained
        saved = checkpoint_weights(kit_models)
        for bucket_bytes in (1 << 30, 4096):
            names, tensors = adapters_of(engine, bucket_bytes)
            check(backend_name, LORA_NAMES, [f"bucket_bytes={bucket_bytes}: {p}" for p in
                                             adapter_name_problems(names, tensors, saved, self.lora_spec.rank)])

    def test_lora_export_is_the_merged_policy(self, backend_name: str,
                                              lora_trained: tuple[Any, dict[str, torch.Tensor]], batch: Batch,
                                              kit_models: KitModels) -> None:
        engine, _ = lora_trained
        saved = checkpoint_weights(kit_models)
        _, adapters = adapters_of(engine)
        try:
            want = merged(saved, adapters.items(), self.lora_spec.scaling)
        except (KeyError, ValueError) as exc:
            violated(backend_name, LORA_MERGED, [f"the adapters cannot be merged into the checkpoint: {exc}"])
        got = exported(engine)
        check(backend_name, LORA_MERGED, export_problems(want, got, kit_models_tied(kit_models), self.lora_atol))
        layout, agree = self._log_prob_problems(engine, batch, ReferenceModel(kit_models.policy, got.items()), None,
                                                False)
        check(backend_name, LAYOUT, layout)
        check(backend_name, LORA_MERGED, [f"against export_weights: {p}" for p in agree])

    def test_lora_reference_view_is_the_base(self, request: pytest.FixtureRequest, backend_name: str,
                                             lora_trained: tuple[Any, dict[str, torch.Tensor]], kit_device: str,
                                             batch: Batch, kit_models: KitModels, policy_ref: ReferenceModel) -> None:
        engine, _ = lora_trained
        view = self._reference_view(request, backend_name, engine, kit_device, kit_models)
        layout, agree = self._log_prob_problems(view, batch, policy_ref, None, False)
        check(backend_name, LAYOUT, layout)
        check(backend_name, LORA_REFERENCE, agree)

    # --- declared capabilities: fused layer kernels ------------------------------------------------------
    def test_fused_kernels_off_cuda_refuse_or_fall_back(self, backend_name: str, make_trainer: Callable[..., Any],
                                                        kit_device: str, batch: Batch,
                                                        policy_ref: ReferenceModel) -> None:
        self._declares(backend_name, "fused_layer_kernels")
        if kit_device == "cuda":
            pytest.skip("the kit runs on CUDA: test_fused_kernels_match_the_unfused_path checks the fused path")
        problems = []
        for choice in (True, "auto"):
            try:
                engine = make_trainer(fused_kernels=choice)
            except ValueError as exc:
                if "fused_kernels" not in str(exc):
                    problems.append(f"fused_kernels={choice!r}: ValueError without the option's name: {exc}")
                continue
            except Exception as exc:  # noqa: BLE001 - the wrong error type is the finding
                problems.append(f"fused_kernels={choice!r}: {type(exc).__name__} instead of ValueError: {exc}")
                continue
            layout, agree = self._log_prob_problems(engine, batch, policy_ref, None, True)
            problems += [f"fused_kernels={choice!r} on {kit_device}: {p}" for p in layout + agree]
            del engine
        check(backend_name, FUSED_CPU, problems)

    @pytest.mark.gpu
    def test_fused_kernels_match_the_unfused_path(self, backend_name: str, make_trainer: Callable[..., Any],
                                                  kit_device: str, batch: Batch) -> None:
        self._declares(backend_name, "fused_layer_kernels")
        if kit_device != "cuda":
            pytest.skip(f"the fused layer kernels run on CUDA only; the kit runs '{backend_name}' on {kit_device}")
        sent = batch.select(*SEQUENCE_KEYS)
        outs = []
        for choice in (False, True):
            engine = make_trainer(fused_kernels=choice)
            outs.append(engine.compute_log_probs(sent, with_entropy=True))
            del engine
            free_device_memory()
        mask = batch[RESPONSE_MASK].bool()
        problems = []
        for key in (LOG_PROBS, ENTROPY):
            missing = [name for name, out in zip(("unfused", "fused"), outs) if key not in out]
            if missing:
                problems.append(f"'{key}' missing from the {' and '.join(missing)} result")
                continue
            diff = float((outs[1][key].float()[mask] - outs[0][key].float()[mask]).abs().max())
            if not diff <= self.fused_atol:
                problems.append(f"'{key}': |fused - unfused| up to {diff:.2e} > fused_atol {self.fused_atol:g}")
        check(backend_name, FUSED_AGREE, problems)

    # --- updates ----------------------------------------------------------------------------------------
    def test_zero_lr_update_changes_nothing(self, backend_name: str, make_trainer: Callable[..., Any],
                                            batch: Batch) -> None:
        engine = make_trainer(lr=0.0)
        before = exported(engine)
        self._update(backend_name, engine, batch)
        check(backend_name, ZERO_LR, weight_problems(before, exported(engine)))

    def test_update_lowers_the_loss(self, backend_name: str, make_trainer: Callable[..., Any], batch: Batch) -> None:
        engine = make_trainer(lr=self.lr)
        before = self._loss(engine, batch)
        self._update(backend_name, engine, batch)
        after = self._loss(engine, batch)
        if not (math.isfinite(after) and after < before):
            violated(backend_name, DESCENT, [f"loss {before:.6f} before the update, {after:.6f} after (lr={self.lr})"])

    def test_consecutive_updates_are_independent(self, backend_name: str, make_trainer: Callable[..., Any],
                                                 batch: Batch) -> None:
        engine = make_trainer(lr=self.lr, betas=(0.0, 0.0), weight_decay=0.0)
        start = exported(engine)
        self._update(backend_name, engine, batch)
        moved = exported(engine)
        if not weight_problems(start, moved):
            violated(backend_name, DESCENT, [f"an update with lr={self.lr} left every weight unchanged"])
        no_gradient = batch.select(*SEQUENCE_KEYS)
        no_gradient.set(ADVANTAGES, torch.zeros_like(batch[ADVANTAGES]))
        self._update(backend_name, engine, no_gradient)
        check(backend_name, INDEPENDENT, [f"after the zero-gradient update: {p}"
                                          for p in weight_problems(moved, exported(engine))])

    def test_offload_and_onload_keep_weights(self, backend_name: str, make_trainer: Callable[..., Any],
                                             batch: Batch, policy_ref: ReferenceModel) -> None:
        engine = make_trainer()
        before = exported(engine)
        engine.offload()
        engine.onload()
        check(backend_name, OFFLOAD, weight_problems(before, exported(engine)))
        _, agree = self._log_prob_problems(engine, batch, policy_ref, None, False)
        check(backend_name, OFFLOAD, agree)

    def test_checkpoint_round_trip(self, backend_name: str, make_trainer: Callable[..., Any], batch: Batch,
                                   kit_models: KitModels, tmp_path: Path) -> None:
        if not backends.entry("train", backend_name).can("checkpoint"):
            pytest.skip(f"'{backend_name}' does not declare the 'checkpoint' capability (supports=...)")
        engine = make_trainer(lr=1e-2)
        other = sequence_batch(6, seed=2, vocab_size=kit_models.vocab_size, pad_id=kit_models.pad_id)
        self._update(backend_name, engine, batch)  # optimiser state that the checkpoint must carry
        path = tmp_path / "checkpoint"
        engine.save_checkpoint(str(path))
        saved = exported(engine)
        self._update(backend_name, engine, other)
        continued = exported(engine)
        if not weight_problems(saved, continued):
            violated(backend_name, DESCENT, ["an update with lr=1e-2 left every weight unchanged"])
        engine.load_checkpoint(str(path))
        check(backend_name, CHECKPOINT, [f"after load_checkpoint into the same engine: {p}"
                                         for p in weight_problems(saved, exported(engine))])
        del engine  # one engine at a time, as in a restarted job
        free_device_memory()
        resumed = make_trainer(lr=1e-2)
        resumed.load_checkpoint(str(path))
        check(backend_name, CHECKPOINT, [f"after load_checkpoint into a new engine: {p}"
                                         for p in weight_problems(saved, exported(resumed))])
        self._update(backend_name, resumed, other)
        check(backend_name, CHECKPOINT, [f"the step after resuming differs from the step without a restart "
                                         f"(optimiser state lost?): {p}"
                                         for p in weight_problems(continued, exported(resumed), atol=1e-6)])


def shifted_by_one(got: torch.Tensor, prompt: list[int], response: list[int], ref: ReferenceModel,
                   temperature: float | None, atol: float) -> str:
    """A note when ``got`` (one row's log-probs at its real response tokens) are the reference's read one position
    off: token ``t`` of the response scored with the logits of the position after (or before) the one that
    predicts it. Empty otherwise."""
    ids = torch.tensor([list(prompt) + list(response)], dtype=torch.long)
    with torch.no_grad():
        logits = ref.model(input_ids=ids).logits[0].float()
    if temperature is not None:
        logits = logits / temperature
    log_probs = torch.log_softmax(logits, -1)
    first = len(prompt)  # the first response token's position; the logits at first - 1 predict it
    for shift, where in ((1, "of the position after the one that predicts it"),
                         (-1, "of the position before the one that predicts it")):
        steps = [t for t in range(len(response)) if 0 <= first + t - 1 + shift < ids.shape[1]]
        if not steps:
            continue
        want = torch.stack([log_probs[first + t - 1 + shift, response[t]] for t in steps])
        if float((got[steps] - want).abs().max()) <= atol:
            return (f"; they are shifted by one position: token t scored with the logits {where} (the logits at "
                    f"position P+t-1 predict response token t, P the prompt's length)")
    return ""


def kit_models_tied(kit: KitModels) -> bool:
    import json

    return bool(json.loads((kit.policy / "config.json").read_text()).get("tie_word_embeddings", False))
