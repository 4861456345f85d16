"""``RolloutEngineContract``: the battery every rollout backend must pass (subclass it with ``backend = "name"``).

Every test builds its engine through the registry, from the kit's tiny model, and compares with a
transformers forward pass (``hybridrl.testing.reference``). A failure names the broken contract.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridrl.engines import SamplingParams
from hybridrl.engines.batch import (
    FINISHED,
    PROMPT_IDS,
    PROMPT_MASK,
    PROMPT_ROUTED_EXPERTS,
    RESPONSE_IDS,
    RESPONSE_MASK,
    ROLLOUT_LOG_PROBS,
    ROUTED_EXPERTS,
    Batch,
    complete_groups,
)
from hybridrl.testing import backends
from hybridrl.testing import lora as kit_lora
from hybridrl.testing import partial as cut
from hybridrl.testing.batches import FIRST_PLAIN_ID, prompt_batch
from hybridrl.testing.checks import check, layout_problems, reference_problems, stop_problems, violated
from hybridrl.testing.distribution import frequency_problems, reported_problems
from hybridrl.testing.fixtures import EngineSlot, KitBase, cli_device, engine_factory, free_device_memory
from hybridrl.testing.models import KIT_WIDTH, KitModels, set_eos
from hybridrl.testing.reference import ReferenceModel, sampling_log_probs
from hybridrl.testing.requests import request_problems
from hybridrl.testing.routing import KIT_MOE

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
DRAWS = ("sampled tokens must be drawn from the sampling distribution (logits / temperature, top-k, top-p): the "
         "frequencies of many draws of one next token must fit the reference probabilities")
REPORTED = ("rollout_log_probs must be the log-probs of the distribution the tokens were drawn from (the temperature, "
            "top-k and top-p actually used): the frequencies of the draws must fit exp(rollout_log_probs)")
ROWS_DIFFER = ("identical prompts must give different samples: every row draws its own random numbers (a GRPO "
               "group repeats one prompt; params.seed is one seed for the whole call)")
SLEEP_RELEASES = "sleep must release device memory (the colocated trainer needs it)"
POSITIONS = ("a left-padded row must decode as its prompt alone: position ids count from the row's first real token "
             "(checked on an absolute-position model, GPT-2)")
REQUESTS = ("generate_request (capability 'requests') must follow generate's contract: tokens up to and including "
            "the stop token, the log-probs of the sampling distribution, concurrent requests independent")
NAMED_WEIGHTS = "named_weights (capability 'named_weights') must give the engine's weights under their HF names"
LORA_ADAPTERS = ("import_weights of LoRA adapters (capability 'lora_adapters', ctx.lora.sync 'adapter') must serve "
                 "them on the base: greedy outputs those of the merged weights W0 + alpha/rank * B @ A, at every sync "
                 "(each sync's adapters replace the last: merged onto the base, not onto the previous merge)")
PARTIAL_CAPS = ("with the 'partial' capability every row must honour its max_new_tokens cap, in generate and "
                "generate_until: the first cap tokens of an uncapped run (all of it when shorter), at the width of "
                "params.max_new_tokens, finished")
PARTIAL_STOP = ("generate_until (capability 'partial') must stop once its share of groups is complete: every row a "
                "prefix of an uninterrupted run, the rows still running cut short, finished=True exactly on the rows "
                "that ended (an EOS or the cap)")
REFILL = ("generate_until with running below 1 (capability 'refill') must decode at most ceil(running x groups) "
          "groups at once and start a waiting group (in batch order) only when a running one completes: a group that "
          "never started returns no token and finished=False, the started rows an uninterrupted run's tokens")
PARTIAL_RESUME = ("a row cut short by generate_until, resubmitted as prompt + its tokens with the rest of its budget, "
                  "must continue (greedy, same weights) to the tokens of an uninterrupted run")
#: the share of fed (token, layer) pairs whose returned experts may differ from the reference's (near ties).
ROUTING_TIES = 0.02
RETURN_ROUTING = ("generate with params.return_routing (capability 'return_routing', the engine started with the "
                  "option return_routing=True) must return the experts the model routes each fed token to: "
                  "prompt_routed_experts (B, P, layers, top_k) and routed_experts (B, R, layers, top_k), int64, -1 "
                  "exactly where nothing was fed (prompt padding, a row's last response token and what follows), "
                  "elsewhere top_k distinct ids in [0, num_experts): the top-k of a transformers forward of prompt + "
                  f"response[:-1] at all but {ROUTING_TIES:.0%} of the fed (token, layer) pairs (near ties)")

SAMPLED_SETTINGS = {
    "t1.0": SamplingParams(temperature=1.0, max_new_tokens=KIT_WIDTH, seed=7),
    "t0.7": SamplingParams(temperature=0.7, max_new_tokens=KIT_WIDTH, seed=8),
    "t0.7-topk5": SamplingParams(temperature=0.7, top_k=5, max_new_tokens=KIT_WIDTH, seed=9),
    "t0.7-topp0.8": SamplingParams(temperature=0.7, top_p=0.8, max_new_tokens=KIT_WIDTH, seed=10),
}
GREEDY_PARAMS = SamplingParams(temperature=0.0, max_new_tokens=KIT_WIDTH)
#: the largest chance that a correct engine fails a statistical check of the kit.
P_FALSE = 1e-7


def buckets_of(weights: dict[str, torch.Tensor], parts: int = 3) -> list[list[tuple[str, torch.Tensor]]]:
    """The weights in ``parts`` buckets of fresh copies, like a trainer's export."""
    items = [(name, tensor.clone()) for name, tensor in weights.items()]
    size = -(-len(items) // parts)
    return [items[i:i + size] for i in range(0, len(items), size)]


def early_stop_token(paths: Sequence[Sequence[int]], width: int) -> int | None:
    """A plain token that some greedy ``paths`` reach before their last step and others never: made the EOS, it
    ends the rows of one call at different columns (a greedy row's tokens before its first EOS do not depend on
    which id the EOS is). The token ending rows at the most distinct columns; None when none does."""
    best, spread = None, 0
    for token in dict.fromkeys(t for path in paths for t in path):
        if token < FIRST_PLAIN_ID:
            continue
        firsts = [list(path).index(token) if token in path else None for path in paths]
        ends = {f for f in firsts if f is not None and f <= width - 2}
        if None in firsts and len(ends) > spread:
            best, spread = token, len(ends)
    return best


def _spots(where: torch.Tensor, limit: int = 6) -> str:
    """The first (row, column) pairs where ``where`` (B, T) holds, and how many in all."""
    spots = [tuple(p) for p in where.nonzero().tolist()]
    return f"{spots[:limit]}{' ...' if len(spots) > limit else ''} ({len(spots)} in all)"


def routing_problems(got: torch.Tensor, want: torch.Tensor, experts: int, share: float, what: str) -> list[str]:
    """``got`` against ``want``, both ``(B, T, layers, top_k)``, ``want`` -1 where nothing was fed: -1 exactly
    there; elsewhere ``top_k`` distinct ids in ``[0, experts)``, the set ``want`` holds (their order is free) at
    all but ``share`` of the fed (token, layer) pairs."""
    fed = (want >= 0).flatten(2).all(-1)  # (B, T)
    problems = []
    stray = ~fed & (got != -1).flatten(2).any(-1)
    if stray.any():
        problems.append(f"{what}: not -1 where nothing was fed, at (row, column) {_spots(stray)}")
    pairs = fed[..., None].expand(got.shape[:3])  # (B, T, layers): the fed (token, layer) pairs
    mine, theirs = got.sort(dim=-1).values, want.sort(dim=-1).values
    outside = pairs & ((got < 0) | (got >= experts)).any(-1)
    if outside.any():
        problems.append(f"{what}: expert ids outside [0, {experts}) at (row, column) {_spots(outside.any(-1))}")
    repeated = pairs & (mine[..., 1:] == mine[..., :-1]).any(-1)
    if repeated.any():
        problems.append(f"{what}: one expert twice in a token's top_k at (row, column) {_spots(repeated.any(-1))}")
    differ = pairs & (mine != theirs).any(-1)
    total = int(pairs.sum())
    if int(differ.sum()) > share * total:
        where = differ.any(-1)
        row, column = (int(v) for v in where.nonzero()[0])
        problems.append(f"{what}: {int(differ.sum())} of {total} fed (token, layer) pairs differ from the "
                        f"transformers forward's top-k (at most {share:.0%} may), at (row, column) {_spots(where)}; "
                        f"row {row} column {column}: {got[row, column].tolist()}, the forward's "
                        f"{want[row, column].tolist()}")
    return problems


class RolloutEngineContract(KitBase):
    """The rollout-engine battery. Subclass with ``backend = "<registered rollout name>"``; optional class
    attributes: ``device``, ``dtype``, ``engine_options``, ``logprob_atol``, ``greedy_tie_tolerance``,
    ``cuda_only``."""

    #: capabilities the backend declares but offers on CUDA only (e.g. vLLM records routing in its GPU model
    #: runner): their checks skip on another device, saying so.
    cuda_only: frozenset[str] = frozenset()

    #: a greedy token may differ from the reference argmax when their log-probs are closer than this (a
    #: near-tie that numerical noise may break either way); a sampled token may be the first past a
    #: top-k/top-p edge by as little (``hybridrl.testing.reference.near_support_edge``).
    greedy_tie_tolerance: float = 1e-4
    #: both tolerances widened by this fraction of a row's largest reference logit (16-bit engines; see
    #: ``hybridrl.testing.checks.reference_problems``).
    logit_rtol: float = 0.0
    #: draws of one next token per sampling setting in the distribution check: enough that sampling at
    #: temperature 1.0 instead of 0.7 fails far beyond chance on the kit's model (its chi-square grows ~0.1
    #: per draw; the bound at p < 1e-7 is ~60).
    distribution_draws: int = 2000

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

    @pytest.fixture(scope="class")
    def spread_prompt(self, kit_models: KitModels, policy_ref: ReferenceModel) -> tuple[tuple[int, ...], torch.Tensor]:
        """The kit prompt whose next token is least certain at temperature 1, and its next-token logits (V,):
        the draws of the distribution checks say the most about it."""
        best: tuple[float, tuple[int, ...], torch.Tensor] | None = None
        for prompt in kit_models.prompts:
            logits = policy_ref.step_logits(prompt, [kit_models.pad_id])[0]
            logp = torch.log_softmax(logits, -1)
            spread = float(-(logp.exp() * logp).sum())
            if best is None or spread > best[0]:
                best = (spread, prompt, logits)
        assert best is not None
        return best[1], best[2]

    @pytest.fixture(scope="class")
    def moe_model(self, tmp_path_factory: pytest.TempPathFactory, backend_name: str, kit_device: str,
                  kit_models: KitModels) -> Path:
        """The kit's tiny MoE (``hybridrl.testing.routing.KIT_MOE``) with an EOS that the greedy continuations of
        some kit prompts reach early and of others never, so that its rows end at different columns (built only
        for a backend that declares ``return_routing``)."""
        from hybridrl.model.tiny import build_tiny_model

        self._declares(backend_name, "return_routing", kit_device)
        path = build_tiny_model(KIT_MOE, tmp_path_factory.mktemp("kit-moe") / "model")
        ref = ReferenceModel(path)
        eos = early_stop_token([ref.greedy(p, KIT_WIDTH) for p in kit_models.prompts], KIT_WIDTH)
        if eos is not None:
            set_eos(path, eos)
        return path

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

    # --- the sampling distribution, row by row -----------------------------------------------------------
    @pytest.mark.parametrize("setting", list(SAMPLED_SETTINGS))
    def test_draws_follow_the_sampling_distribution(self, backend_name: str, rollout: Any, kit_models: KitModels,
                                                    spread_prompt: tuple[tuple[int, ...], torch.Tensor],
                                                    setting: str) -> None:
        """Many draws of one next token from one prompt: frequencies against the reference probabilities at
        the setting, and against the engine's own reported probabilities (chi-square, p < ``P_FALSE``)."""
        params = replace(SAMPLED_SETTINGS[setting], max_new_tokens=1)
        prompt, logits = spread_prompt
        n = self.distribution_draws
        out = rollout.generate(prompt_batch([prompt] * n, kit_models.pad_id), params)
        check(backend_name, LAYOUT, layout_problems(out, n, 1, kit_models.vocab_size))
        tokens, log_probs = out[RESPONSE_IDS][:, 0], out[ROLLOUT_LOG_PROBS][:, 0]
        probs = sampling_log_probs(logits[None], params, kit_models.eos_ids)[0].exp()
        counts = torch.bincount(tokens, minlength=probs.numel()).double()
        what = (f"the reference distribution of prompt {list(prompt)} at temperature={params.temperature}, "
                f"top_k={params.top_k}, top_p={params.top_p}")
        drawn = frequency_problems(counts, probs, P_FALSE, what)
        reported = reported_problems(tokens, log_probs, P_FALSE, self.logprob_atol)
        if drawn:  # both lists: an engine that samples at one temperature and reports another fails both
            violated(backend_name, DRAWS, drawn + [f"and {REPORTED}: {p}" for p in reported])
        check(backend_name, REPORTED, reported)

    def test_identical_prompts_give_different_samples(self, backend_name: str, rollout: Any, kit_models: KitModels,
                                                      spread_prompt: tuple[tuple[int, ...], torch.Tensor]) -> None:
        """One prompt in every row at temperature 1, with a seed and without: the rows must not all agree.
        Rows enough that a correct engine gives one response to all with probability below 1e-12: all rows
        agree only if their first tokens do, at most ``p_max ** (rows - 1)``."""
        prompt, logits = spread_prompt
        p_max = float(torch.softmax(logits.double(), -1).max())
        rows = max(4, math.ceil(math.log(1e-12) / math.log(p_max)) + 1)
        problems = []
        for seed in (11, None):
            params = SamplingParams(temperature=1.0, max_new_tokens=KIT_WIDTH, ignore_eos=True, seed=seed)
            out = rollout.generate(prompt_batch([prompt] * rows, kit_models.pad_id), params)
            check(backend_name, LAYOUT, layout_problems(out, rows, KIT_WIDTH, kit_models.vocab_size))
            distinct = {tuple(r) for r in out[RESPONSE_IDS].tolist()}
            if len(distinct) == 1:
                problems.append(f"seed={seed}: all {rows} rows of prompt {list(prompt)} gave {list(distinct.pop())} "
                                f"(a correct engine: probability < {p_max:.3f}**{rows - 1} = "
                                f"{p_max ** (rows - 1):.1e})")
        check(backend_name, ROWS_DIFFER, problems)

    # --- positions --------------------------------------------------------------------------------------
    def test_left_padding_keeps_positions(self, backend_name: str, engine_slot: EngineSlot, kit_models: KitModels,
                                          position_model: Path) -> None:
        """The kit's prompts, left-padded two columns past the longest, greedily decoded on a GPT-2 (learned
        absolute positions): each row as the reference decodes its prompt alone, and as the engine does."""
        engine = engine_slot.fresh(path=position_model)
        try:
            ref = ReferenceModel(position_model)
            prompts = kit_models.prompts
            width = max(len(p) for p in prompts) + 2
            params = replace(GREEDY_PARAMS, ignore_eos=True)
            batch = engine.generate(prompt_batch(prompts, kit_models.pad_id, width), params)
            check(backend_name, LAYOUT, layout_problems(batch, len(prompts), KIT_WIDTH, kit_models.vocab_size))
            tokens, log_probs = reference_problems(batch, prompts, ref, params, kit_models.eos_ids, self.logprob_atol,
                                                   self.greedy_tie_tolerance, self.logit_rtol)
            problems = [f"left-padded batch: {p}" for p in tokens + log_probs]
            for i, prompt in enumerate(prompts):
                alone = engine.generate(prompt_batch([prompt], kit_models.pad_id), params)
                if alone[RESPONSE_IDS][0].tolist() != batch[RESPONSE_IDS][i].tolist():
                    problems.append(f"row {i} ({width - len(prompt)} pads): {batch[RESPONSE_IDS][i].tolist()} in the "
                                    f"batch, {alone[RESPONSE_IDS][0].tolist()} alone")
            check(backend_name, POSITIONS, problems)
        finally:
            del engine
            engine_slot.drop()

    # --- declared capabilities ----------------------------------------------------------------------
    def _declares(self, backend_name: str, capability: str, device: str | None = None) -> None:
        if not backends.entry("rollout", backend_name).can(capability):
            pytest.skip(f"'{backend_name}' does not declare the '{capability}' capability (supports=...)")
        if device is not None and capability in self.cuda_only and not str(device).startswith("cuda"):
            pytest.skip(f"'{backend_name}' offers '{capability}' on CUDA only (cuda_only); the kit runs on {device}")

    def test_requests_follow_the_generate_contract(self, backend_name: str, rollout: Any, kit_models: KitModels,
                                                   policy_ref: ReferenceModel,
                                                   spread_prompt: tuple[tuple[int, ...], torch.Tensor]) -> None:
        """Capability ``requests``: greedy requests for every kit prompt, sampled ones repeating one prompt
        with a seed each (as the episode runner sends them), and one without log-probs, all in flight at
        once; each checked as a row of ``generate``, and the sampled ones must not all agree."""
        from hybridrl.testing.requests import Request, run_all, shape_problems

        self._declares(backend_name, "requests")
        prompt, logits = spread_prompt
        p_max = float(torch.softmax(logits.double(), -1).max())
        n = max(4, math.ceil(math.log(1e-12) / math.log(p_max)) + 1)
        sampled = SamplingParams(temperature=1.0, max_new_tokens=KIT_WIDTH, ignore_eos=True)
        groups = {
            "greedy": [Request(p, GREEDY_PARAMS) for p in kit_models.prompts],
            "sampled": [Request(prompt, replace(sampled, seed=1000 + i)) for i in range(n)],
            "top-k": [Request(p, replace(SAMPLED_SETTINGS["t0.7-topk5"], seed=2000 + i))
                      for i, p in enumerate(kit_models.prompts)],
            "no log-probs": [Request(kit_models.prompts[0], replace(GREEDY_PARAMS, logprobs=False))],
        }
        flat = [r for group in groups.values() for r in group]
        results = run_all(rollout, flat)
        if not isinstance(results, list) or len(results) != len(flat):
            violated(backend_name, REQUESTS, [f"{len(flat)} requests awaited through run_requests gave {results!r}"])
        problems, start = [], 0
        for name, group in groups.items():
            mine = results[start:start + len(group)]
            start += len(group)
            shape = shape_problems(mine, group, kit_models.vocab_size)
            problems += [f"{name}: {p}" for p in shape or request_problems(
                mine, group, policy_ref, kit_models.eos_ids, kit_models.pad_id, self.logprob_atol,
                self.greedy_tie_tolerance, self.logit_rtol)]
            if name == "sampled" and len({tuple(r.token_ids) for r in mine}) == 1:
                problems.append(f"sampled: all {n} requests of prompt {list(prompt)}, each with a seed of its own, "
                                f"gave {list(mine[0].token_ids)} (a correct engine: probability < "
                                f"{p_max ** (n - 1):.1e})")
        check(backend_name, REQUESTS, problems)

    def test_named_weights_are_the_checkpoint(self, backend_name: str, rollout: Any, policy_ref: ReferenceModel
                                              ) -> None:
        """Capability ``named_weights``: every weight of the checkpoint, under its HF name, unchanged."""
        self._declares(backend_name, "named_weights")
        have = {n: t.detach().to("cpu", torch.float32) for n, t in rollout.named_weights()}
        problems = []
        for name, want in policy_ref.named_weights().items():
            got = have.get(name)
            if got is None:
                problems.append(f"no weight named '{name}' (has: {sorted(have)[:8]} ...)")
            elif tuple(got.shape) != tuple(want.shape):
                problems.append(f"'{name}' has shape {tuple(got.shape)}, the checkpoint's is {tuple(want.shape)}")
            elif not torch.allclose(got, want, atol=self.logprob_atol, rtol=0):
                problems.append(f"'{name}' differs from the checkpoint by up to {float((got - want).abs().max()):.3g}")
        check(backend_name, NAMED_WEIGHTS, problems)

    # --- capability 'partial': per-row caps, stopping at a share of groups, resuming -----------------------
    #: the caps of the kit's prompts in the caps check (some below, some above each row's greedy length)
    PARTIAL_CAPS: tuple[int, ...] = (1, 3, KIT_WIDTH, 2, 5, KIT_WIDTH - 1)

    @pytest.mark.parametrize("ignore_eos", [False, True])
    def test_partial_rows_honour_their_caps(self, backend_name: str, rollout: Any, kit_models: KitModels,
                                            policy_ref: ReferenceModel, ignore_eos: bool) -> None:
        """Capability ``partial``: the kit's prompts with caps below and at the width, greedy; ``generate`` and
        ``generate_until`` (each row a group of its own, share 1) must give each row the first ``cap`` tokens
        of the uncapped run, at the full width, all finished."""
        self._declares(backend_name, "partial")
        prompts = kit_models.prompts
        caps = [self.PARTIAL_CAPS[i % len(self.PARTIAL_CAPS)] for i in range(len(prompts))]
        params = replace(GREEDY_PARAMS, ignore_eos=ignore_eos)
        full = rollout.generate(prompt_batch(prompts, kit_models.pad_id), params)
        batch = cut.requests(prompts, kit_models.pad_id, caps, range(len(prompts)))
        problems = []
        for name, out in (("generate", rollout.generate(batch, params)),
                          ("generate_until", rollout.generate_until(batch, params, 1.0))):
            shape = cut.layout_problems(out, len(prompts), KIT_WIDTH)
            if name == "generate_until":
                shape += cut.finished_problems(out, len(prompts))
                if not shape and not bool(out[FINISHED].all()):
                    shape.append(f"share 1.0: every row must finish, finished={out[FINISHED].tolist()}")
            problems += [f"{name}: {p}" for p in shape or cut.capped_problems(
                out, prompts, caps, full, policy_ref, self.logprob_atol, self.greedy_tie_tolerance, self.logit_rtol)]
        check(backend_name, PARTIAL_CAPS, problems)

    def _cut_rows(self, kit_models: KitModels) -> tuple[list[tuple[int, ...]], list[int], list[int]]:
        """(prompts, caps, groups) of the stopping check: group 0, one row capped at one token, completes at the
        first step; group 1, every kit prompt with the full width, has rows running to the full width (the kit's
        model is tuned so that some do). A share of 1/2 needs one group."""
        prompts = [kit_models.prompts[0], *kit_models.prompts]
        return prompts, [1] + [KIT_WIDTH] * len(kit_models.prompts), [0] + [1] * len(kit_models.prompts)

    def _cut(self, engine_slot: EngineSlot, rollout: Any, kit_models: KitModels) -> tuple[Batch, Batch]:
        """(generate_until at share 1/2, the uninterrupted greedy run of the same rows), cached."""
        prompts, caps, groups = self._cut_rows(kit_models)
        return engine_slot.cached("partial_cut", lambda: (
            rollout.generate_until(cut.requests(prompts, kit_models.pad_id, caps, groups), GREEDY_PARAMS, 0.5),
            rollout.generate(prompt_batch(prompts, kit_models.pad_id), GREEDY_PARAMS)))

    def test_generate_until_stops_at_its_share(self, backend_name: str, engine_slot: EngineSlot, rollout: Any,
                                               kit_models: KitModels, policy_ref: ReferenceModel) -> None:
        """Capability ``partial``: two groups, one done after a token, one of rows running eight; share 1/2.
        The call must return with the first group complete and rows of the second cut short, each a prefix of
        an uninterrupted run with its log-probs, and ``finished`` true exactly where a row ended."""
        self._declares(backend_name, "partial")
        prompts, caps, groups = self._cut_rows(kit_models)
        out, full = self._cut(engine_slot, rollout, kit_models)
        problems = cut.layout_problems(out, len(prompts), KIT_WIDTH) + cut.finished_problems(out, len(prompts))
        check(backend_name, PARTIAL_STOP, problems)
        problems = cut.cut_problems(out, prompts, caps, full, kit_models.eos_ids, policy_ref, self.logprob_atol,
                                    self.greedy_tie_tolerance, self.logit_rtol)
        done = complete_groups(torch.tensor(groups), out[FINISHED])
        if done < 1:
            problems.append(f"no group complete (finished={out[FINISHED].tolist()}): share 0.5 of 2 groups needs one")
        lengths = out[RESPONSE_MASK].sum(1).tolist()
        whole = full[RESPONSE_MASK].sum(1).tolist()
        if not any(n < w for n, w in zip(lengths[1:], whole[1:])):
            problems.append(f"no row was cut short: lengths {lengths[1:]} of group 1, uninterrupted {whole[1:]} (group "
                            "0 completes after one token; an engine that stops early stops before eight)")
        check(backend_name, PARTIAL_STOP, problems)

    def test_resumed_greedy_rows_continue_as_uninterrupted(self, backend_name: str, engine_slot: EngineSlot,
                                                           rollout: Any, kit_models: KitModels,
                                                           policy_ref: ReferenceModel) -> None:
        """Capability ``partial``: the rows ``generate_until`` cut short, resubmitted as prompt + their tokens
        with the rest of their budget (as the driver resumes them), run to the end; each cut row's tokens
        then the resumed ones must be the uninterrupted greedy run."""
        self._declares(backend_name, "partial")
        prompts, caps, _ = self._cut_rows(kit_models)
        out, full = self._cut(engine_slot, rollout, kit_models)
        heads = cut.responses(out)
        open_rows = [i for i, f in enumerate(out[FINISHED].tolist()) if not f]
        if not open_rows:
            pytest.skip("generate_until cut no row short (test_generate_until_stops_at_its_share says why)")
        batch = cut.requests([list(prompts[i]) + heads[i] for i in open_rows], kit_models.pad_id,
                             [caps[i] - len(heads[i]) for i in open_rows], range(len(open_rows)))
        resumed = rollout.generate_until(batch, GREEDY_PARAMS, 1.0)
        problems = cut.layout_problems(resumed, len(open_rows), KIT_WIDTH)
        check(backend_name, PARTIAL_RESUME, problems)
        check(backend_name, PARTIAL_RESUME, cut.resumed_problems(
            [prompts[i] for i in open_rows], [heads[i] for i in open_rows], resumed, full.index(open_rows), policy_ref,
            self.greedy_tie_tolerance, self.logit_rtol))

    def test_refill_starts_a_waiting_group_as_a_running_one_completes(
            self, backend_name: str, rollout: Any, kit_models: KitModels, policy_ref: ReferenceModel) -> None:
        """Capability ``refill``: three groups, one decoding at a time (running 1/3), two needed (share 2/3).
        Group 0 (one row capped at one token) completes first and lets group 1 (every kit prompt, capped at two
        tokens) start; once group 1 completes the call is done, and group 2 (full width) never started."""
        self._declares(backend_name, "refill")
        kit_prompts = list(kit_models.prompts)
        prompts = [kit_prompts[0], *kit_prompts, *kit_prompts]
        caps = [1] + [2] * len(kit_prompts) + [KIT_WIDTH] * len(kit_prompts)
        groups = [0] + [1] * len(kit_prompts) + [2] * len(kit_prompts)
        out = rollout.generate_until(cut.requests(prompts, kit_models.pad_id, caps, groups), GREEDY_PARAMS, 2 / 3,
                                     1 / 3)
        full = rollout.generate(prompt_batch(prompts, kit_models.pad_id), GREEDY_PARAMS)
        problems = cut.layout_problems(out, len(prompts), KIT_WIDTH) + cut.finished_problems(out, len(prompts))
        check(backend_name, REFILL, problems)
        started = 1 + len(kit_prompts)
        problems = cut.cut_problems(out.index(list(range(started))), prompts[:started], caps[:started],
                                    full.index(list(range(started))), kit_models.eos_ids, policy_ref,
                                    self.logprob_atol, self.greedy_tie_tolerance, self.logit_rtol)
        finished = out[FINISHED].tolist()
        if not all(finished[:started]):
            problems.append(f"groups 0 and 1 must both complete (finished={finished[:started]})")
        waited = out[RESPONSE_MASK][started:].sum(1).tolist()
        if any(waited) or any(finished[started:]):
            problems.append(f"group 2 must never start (two groups complete first, one decoding at a time): its rows "
                            f"returned {waited} tokens, finished={finished[started:]}")
        check(backend_name, REFILL, problems)

    def test_lora_adapters_serve_the_merged_weights(self, backend_name: str, engine_slot: EngineSlot,
                                                    prompts: Batch, kit_models: KitModels,
                                                    policy_ref: ReferenceModel) -> None:
        """Capability ``lora_adapters``: two syncs of random adapters on every projection, in buckets of three
        tensors (a pair may span buckets, as in a bridge's stream); after each, greedy outputs must be those
        of the checkpoint with that sync's adapters merged in."""
        self._declares(backend_name, "lora_adapters")
        spec = kit_lora.ROLLOUT_LORA
        base = policy_ref.named_weights()
        engine = engine_slot.fresh(lora=spec)
        try:
            problems = []
            for sync, seed in enumerate((11, 12), start=1):
                adapters = list(kit_lora.random_adapters(base, spec.rank, seed).items())
                for i in range(0, len(adapters), 3):
                    engine.import_weights([(name, tensor.clone()) for name, tensor in adapters[i:i + 3]])
                engine.finish_weight_import()
                want = ReferenceModel(kit_models.policy, kit_lora.merged(base, adapters, spec.scaling).items())
                out = engine.generate(prompts, GREEDY_PARAMS)
                problems += [f"sync {sync}: {p}" for p in
                             layout_problems(out, len(prompts), KIT_WIDTH, kit_models.vocab_size)
                             or self._matches(out, kit_models, want, GREEDY_PARAMS)]
            check(backend_name, LORA_ADAPTERS, problems)
        finally:
            del engine
            engine_slot.drop()

    def test_returned_routing_is_the_models_own(self, backend_name: str, engine_slot: EngineSlot, prompts: Batch,
                                                kit_models: KitModels, moe_model: Path) -> None:
        """Capability ``return_routing``: the kit's prompts (left-padded) greedily on the kit's MoE, the engine
        started with ``return_routing=True``; the experts returned for every fed token (the prompt's, and each
        response token's but the last) must be those a transformers forward of prompt + response[:-1] routes it
        to, and -1 where nothing was fed."""
        self._declares(backend_name, "return_routing")
        engine = engine_slot.fresh(path=moe_model, return_routing=True)
        try:
            out = engine.generate(prompts, replace(GREEDY_PARAMS, return_routing=True))
        finally:
            del engine
            engine_slot.drop()
        check(backend_name, LAYOUT, layout_problems(out, len(prompts), KIT_WIDTH, kit_models.vocab_size))
        check(backend_name, RETURN_ROUTING, self._routing_problems(out, prompts, moe_model))

    def _routing_problems(self, out: Batch, prompts: Batch, moe_model: Path) -> list[str]:
        """The returned routing against the reference's, built ``(B, T, layers, top_k)`` with -1 where nothing
        was fed: prompt padding, and a response's last token (it predicts nothing) and the columns after it."""
        from hybridrl.rollout.routing import RoutingCapture

        prompt_fed = prompts[PROMPT_MASK].bool()
        lengths = out[RESPONSE_MASK].sum(dim=1).tolist()
        per_token = (KIT_MOE.num_layers, KIT_MOE.experts_per_token)
        want = {PROMPT_ROUTED_EXPERTS: torch.full((*prompt_fed.shape, *per_token), -1, dtype=torch.long),
                ROUTED_EXPERTS: torch.full((*out[RESPONSE_MASK].shape, *per_token), -1, dtype=torch.long)}
        problems = []
        for key, wanted in want.items():
            got = out[key] if key in out else None
            if got is None or got.shape != wanted.shape or got.dtype != torch.int64:
                found = None if got is None else (tuple(got.shape), got.dtype)
                problems.append(f"'{key}': {found}, expected {tuple(wanted.shape)} int64")
        if problems:
            return problems
        model = ReferenceModel(moe_model).model
        capture = RoutingCapture(model)
        for i, length in enumerate(lengths):
            prompt = prompts[PROMPT_IDS][i][prompt_fed[i]].tolist()
            response = out[RESPONSE_IDS][i][:length].tolist()
            with torch.no_grad(), capture.capturing():
                model(input_ids=torch.tensor([prompt + response[:-1]]))
            routed = capture.take()
            want[PROMPT_ROUTED_EXPERTS][i, prompt_fed[i]] = routed[:len(prompt)]
            want[ROUTED_EXPERTS][i, :max(length - 1, 0)] = routed[len(prompt):]
        for key, wanted in want.items():
            problems += routing_problems(out[key].cpu(), wanted, KIT_MOE.num_experts, ROUTING_TIES, key)
        return problems

    @pytest.mark.gpu
    def test_sleep_releases_device_memory(self, backend_name: str, kit_device: str, engine_slot: EngineSlot,
                                          prompts: Batch, kit_models: KitModels) -> None:
        """Capability ``sleep`` on CUDA: after a generate, sleep frees at least half the weights' bytes of
        device memory (as ``torch.cuda.mem_get_info`` sees it: any allocator); wake gives a working engine."""
        self._declares(backend_name, "sleep")
        if kit_device != "cuda":
            pytest.skip(f"sleep releases device memory only on CUDA; the kit runs '{backend_name}' on {kit_device}")
        weights = sum(t.numel() for t in ReferenceModel(kit_models.policy).named_weights().values())
        weight_bytes = weights * torch.finfo(getattr(torch, self.dtype)).bits // 8
        engine = engine_slot.fresh()
        try:
            engine.generate(prompts, GREEDY_PARAMS)
            free_device_memory()
            torch.cuda.synchronize()
            before = torch.cuda.mem_get_info()[0]
            engine.sleep()
            torch.cuda.synchronize()
            released = torch.cuda.mem_get_info()[0] - before
            problems = []
            if released < weight_bytes // 2:
                problems.append(f"sleep released {released / 2**20:.2f} MiB of device memory; the model's weights "
                                f"alone take {weight_bytes / 2**20:.2f} MiB ({weights} parameters in {self.dtype})")
            engine.wake()
            out = engine.generate(prompts, GREEDY_PARAMS)
            problems += [f"after wake: {p}" for p in layout_problems(out, len(prompts), KIT_WIDTH,
                                                                     kit_models.vocab_size)]
            check(backend_name, SLEEP_RELEASES, problems)
        finally:
            del engine
            engine_slot.drop()

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
