"""``hf``: the embedded default rollout engine, a sampling loop over a plain transformers model.

No inference engine needed: it runs wherever transformers runs (CPU included), which makes it the backend of
the tests and tiny examples. It is not fast (no continuous batching, no paged attention): for real runs use a
vLLM or SGLang backend plugin.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any

import torch

from hybridrl.engines import EngineContext, NamedTensor, RolloutEngine, SamplingParams, WeightBucket
from hybridrl.engines.batch import (
    FINISHED,
    GROUP_INDEX,
    MAX_NEW_TOKENS,
    PROMPT_IDS,
    PROMPT_MASK,
    PROMPT_ROUTED_EXPERTS,
    RESPONSE_IDS,
    RESPONSE_MASK,
    ROLLOUT_LOG_PROBS,
    ROUTED_EXPERTS,
    Batch,
    distinct_prompts,
    groups_to_complete,
)
from hybridrl.engines.rollout_kit import GroupCompletion, eos_and_pad, running_groups
from hybridrl.lora import MergedAdapters, is_adapter_name
from hybridrl.rollout.routing import RoutingCapture, router_modules
from hybridrl.weights.experts import expert_views, to_checkpoint_layout

log = logging.getLogger(__name__)


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set to ``-inf`` the logits outside the ``top_k`` largest and outside the smallest set of tokens whose
    probability reaches ``top_p`` (the most likely token is always kept). ``logits``: (B, V), already divided
    by the temperature."""
    if top_k and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        remove_sorted = mass_before >= top_p
        remove_sorted[:, 0] = False
        remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


def check_prompt_lengths(prompt_mask: torch.Tensor, max_new_tokens: int | list[int], context_length: int | None
                         ) -> None:
    """Refuse rows that cannot be generated: an empty prompt (nothing to condition on) or one that, with
    ``max_new_tokens`` more tokens (one number, or each row's own cap), would not fit the context.
    ``ValueError`` names the first bad row."""
    lengths = prompt_mask.to(torch.long).sum(dim=1).tolist()
    caps = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(lengths)
    for row, (n, cap) in enumerate(zip(lengths, caps)):
        if n == 0:
            raise ValueError(f"row {row}: empty prompt (its prompt_mask has no token)")
        if context_length is not None and n + cap > context_length:
            raise ValueError(f"row {row}: prompt of {n} tokens + max_new_tokens={cap} exceeds the "
                             f"model's context length {context_length} (max_position_embeddings)")


class HFRollout(RolloutEngine):
    """Token-in/token-out sampling with a KV cache on a transformers causal LM.

    ``ctx.options``: ``attn_implementation`` (passed to ``from_pretrained``, default: transformers' choice).
    """

    def __init__(self, ctx: EngineContext) -> None:
        super().__init__(ctx)
        from transformers import AutoModelForCausalLM

        self.device = self._resolve_device(ctx.device)
        kwargs: dict[str, Any] = {"dtype": ctx.torch_dtype}
        if ctx.options.get("attn_implementation"):
            kwargs["attn_implementation"] = ctx.options["attn_implementation"]
        from transformers.utils import logging as hf_logging

        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # no "Loading weights" bar in every worker's log
        try:
            self.model = AutoModelForCausalLM.from_pretrained(ctx.model_path, **kwargs).to(self.device).eval()
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        for p in self.model.parameters():
            p.requires_grad_(False)
        gen_cfg = getattr(self.model, "generation_config", None)
        cfg = self.model.config
        self.eos_ids, self.pad_id = eos_and_pad(gen_cfg, cfg, ctx.model_path)
        self._sleeping = False
        self.weight_version = 0
        #: prompt + response tokens the model supports (None: no limit stated in its config).
        self.context_length: int | None = getattr(cfg, "max_position_embeddings", None)
        #: LoRA with ``sync: adapter``: the adapters each sync sends are merged into a copy of the base, on the CPU
        self.adapters = (MergedAdapters(self._targets, ctx.lora.scaling)
                         if ctx.lora is not None and ctx.lora.sends_adapters else None)
        #: an MoE model's routers, read when ``params.return_routing`` asks for ``routed_experts``
        self.routing = RoutingCapture(self.model) if router_modules(self.model) else None

    @staticmethod
    def _resolve_device(device: str) -> torch.device:
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return dev

    # --- generation -------------------------------------------------------------------------------
    def _forward(self, ids: torch.Tensor, attn: torch.Tensor, pos: torch.Tensor, cache: Any) -> torch.Tensor:
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, past_key_values=cache,
                         use_cache=True, logits_to_keep=1)
        return out.logits[:, -1, :].float()

    @torch.inference_mode()
    def generate(self, batch: Batch, params: SamplingParams) -> Batch:
        """Sample (or, at temperature 0, pick greedily) up to ``params.max_new_tokens`` tokens per row (fewer
        for a row whose ``max_new_tokens`` cap is lower).

        Returns CPU tensors of width exactly ``max_new_tokens``: ``response_ids`` (the EOS token included when
        a row stops; pad id after it), ``response_mask`` (1 up to and including the EOS), and
        ``rollout_log_probs`` (float32, 0 where masked): the log-probability of each token under the
        distribution it was drawn from, i.e. the logits divided by the temperature, EOS forbidden before
        ``min_new_tokens``, outside-top-k/top-p tokens removed and the rest renormalised; for greedy
        decoding the log-softmax of the (EOS-masked) logits without temperature.
        ``return_routing`` (an MoE model): also ``routed_experts`` ``(B, R, layers, top_k)`` int64, the experts
        each response token was routed to when it was fed back (-1 where it never was: padding, a row's last
        token, which predicts nothing), and ``prompt_routed_experts`` ``(B, P, layers, top_k)``, the prompt tokens'
        at prefill (-1 at padding).
        ``ignore_eos``: an EOS does not end the row (it may still be sampled), every row gets
        ``max_new_tokens`` tokens.

        Raises ``ValueError`` naming the first bad row (``row 3: ...``) when a row's prompt is empty (no 1 in
        its ``prompt_mask``) or when its tokens plus ``max_new_tokens`` exceed the model's context length
        (``max_position_embeddings``): generating past it would silently run out of distribution.
        """
        out, _ = self._decode(batch, params, None)
        return out

    @torch.inference_mode()
    def generate_until(self, batch: Batch, params: SamplingParams, share: float, running: float = 1.0) -> Batch:
        """See ``RolloutEngine.generate_until``: the decode loop checks after every token whether enough
        groups have all their rows finished, and stops there. With ``running`` below 1 the rows of waiting
        groups are prefilled with the others but held (fed padding the attention skips) until a running group
        completes; an admitted row then samples from its prompt's logits and decodes at its own positions."""
        index = batch[GROUP_INDEX]
        schedule = GroupCompletion(index.tolist(), groups_to_complete(index, share), running_groups(index, running))
        out, finished = self._decode(batch, params, schedule)
        out.set(FINISHED, finished.cpu())
        return out

    def _decode(self, batch: Batch, params: SamplingParams, schedule: GroupCompletion | None
                ) -> tuple[Batch, torch.Tensor]:
        """The sampling loop of ``generate`` (``schedule`` None: every row to its end) and ``generate_until``
        (``schedule`` says which rows decode and when to stop): the responses and which rows finished."""
        if self._sleeping:
            raise RuntimeError("HFRollout.generate called while asleep; call wake() first")
        from transformers import DynamicCache

        caps_given = batch[MAX_NEW_TOKENS].clamp(max=int(params.max_new_tokens)).tolist() \
            if MAX_NEW_TOKENS in batch else int(params.max_new_tokens)
        check_prompt_lengths(batch[PROMPT_MASK], caps_given, self.context_length)
        dev = self.device
        prompt_ids = batch[PROMPT_IDS].to(dev, torch.long)
        prompt_mask = batch[PROMPT_MASK].to(dev).long()
        n, width = prompt_ids.shape[0], int(params.max_new_tokens)
        response_ids = torch.full((n, width), self.pad_id, dtype=torch.long, device=dev)
        response_mask = torch.zeros((n, width), dtype=torch.long, device=dev)
        log_probs = torch.zeros((n, width), dtype=torch.float32, device=dev)
        caps = (batch[MAX_NEW_TOKENS].to(dev, torch.long).clamp(max=width) if MAX_NEW_TOKENS in batch
                else torch.full((n,), width, dtype=torch.long, device=dev))
        routed = self._routing_buffer(n, width, params)
        finished = caps <= 0
        held = torch.zeros(n, dtype=torch.bool, device=dev)  # rows of groups waiting for a running one to complete
        if schedule is not None:
            for row in finished.nonzero().flatten().tolist():
                schedule.finish(row)
            held[:] = True
            held[schedule.begin()] = False
            held &= ~finished
            if routed is not None and bool(held.any()):
                raise ValueError("return_routing with waiting groups (generate_until's running below 1) is not "
                                 "supported")
        if n == 0 or width == 0 or bool(finished.all()) or (schedule is not None and schedule.done):
            unrouted = (None if routed is None else
                        routed.new_full((n, prompt_ids.shape[1], *routed.shape[2:]), -1))
            return self._result(response_ids, response_mask, log_probs, routed, unrouted), finished

        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=dev)
            # Each data-parallel rank draws its own stream: the driver sends one seed to all of them.
            generator.manual_seed(int(params.seed) * 1_000_003 + self.ctx.rank)
        eos = torch.tensor(self.eos_ids, dtype=torch.long, device=dev)

        cache = DynamicCache(config=self.model.config)
        attn = prompt_mask
        positions = (prompt_mask.cumsum(dim=1) - 1).clamp(min=0)
        next_pos = prompt_mask.sum(dim=1, keepdim=True)  # (B, 1): position of the first response token
        last_pos = next_pos + (caps.clamp(min=1) - 1)[:, None]  # (B, 1): position of a row's last token
        with self.routing.capturing() if routed is not None and self.routing is not None else nullcontext():
            logits = self._prefill(prompt_ids, attn, positions, cache)
        prompt_routed = None
        if routed is not None and self.routing is not None:  # the prompts' routing, copied to the rows sharing one
            first = distinct_prompts(prompt_ids, attn)[1] if self._shares_prefill(prompt_ids, attn) else None
            taken = self.routing.take().view(n if first is None else len(first), prompt_ids.shape[1],
                                             *routed.shape[2:])
            taken = taken if first is None else taken[distinct_prompts(prompt_ids, attn)[0]]
            prompt_routed = torch.where(attn.bool()[:, :, None, None], taken, -1)

        first_logits = logits.clone() if bool(held.any()) else None  # what an admitted row samples first
        count = torch.zeros(n, dtype=torch.long, device=dev)  # tokens each row has so far
        rows = torch.arange(n, device=dev)
        t = 0
        while True:
            live = ~finished & ~held
            logits[live & (count < params.min_new_tokens)] = logits[live & (count < params.min_new_tokens)] \
                .index_fill(1, eos, float("-inf"))
            token, token_logp = self._sample(logits, params, generator)

            at = count.clamp(max=width - 1)[:, None]  # a row's next column (rows not live write what is there)
            response_ids.scatter_(1, at, torch.where(live, token, response_ids.gather(1, at)[:, 0])[:, None])
            response_mask.scatter_(1, at, torch.where(live, 1, response_mask.gather(1, at)[:, 0])[:, None])
            log_probs.scatter_(1, at, torch.where(live, token_logp, log_probs.gather(1, at)[:, 0])[:, None])
            count = count + live.long()
            was_finished = finished
            if not params.ignore_eos:
                finished = finished | (live & torch.isin(token, eos))
            finished = finished | (live & (caps <= count))
            admitted = torch.zeros(n, dtype=torch.bool, device=dev)
            if schedule is not None:
                for row in (finished & ~was_finished).nonzero().flatten().tolist():
                    admitted[schedule.finish(row)] = True
                if schedule.done:
                    break
            held &= ~admitted
            if bool((finished | held).all()):
                break
            # Feed the new token (finished and held rows feed a pad the attention skips, output unused).
            fed = live & ~finished
            fed_ids = torch.where(fed, response_ids[rows, (count - 1).clamp(min=0)], self.pad_id)
            attn = torch.cat([attn, fed.to(attn.dtype)[:, None]], dim=1)
            # a finished or held row's pad goes to its last position: past its cap it might run off the context
            with self.routing.capturing() if routed is not None else nullcontext():
                logits = self._forward(fed_ids[:, None], attn, torch.where(fed[:, None], next_pos, last_pos), cache)
            if routed is not None and self.routing is not None:
                # token t's experts where it was fed at its own position: a row's last token (a stop token, fed
                # at another position only to keep the batch going) is never followed, its routing unused
                routed[:, t] = torch.where(fed[:, None, None], self.routing.take().view(n, *routed.shape[2:]), -1)
            if first_logits is not None and bool(admitted.any()):
                logits[admitted] = first_logits[admitted]
            next_pos = next_pos + fed.long()[:, None]
            t += 1

        return self._result(response_ids, response_mask, log_probs, routed, prompt_routed), finished

    @staticmethod
    def _shares_prefill(prompt_ids: torch.Tensor, attn: torch.Tensor) -> bool:
        """Whether ``_prefill`` runs each distinct prompt once (rows repeat one)."""
        group, first = distinct_prompts(prompt_ids, attn)
        return len(first) != len(group)

    def _routing_buffer(self, n: int, width: int, params: SamplingParams) -> torch.Tensor | None:
        """``(n, width, layers, top_k)`` of -1 to fill when ``params.return_routing`` (None otherwise)."""
        if not params.return_routing:
            return None
        if self.routing is None:
            raise ValueError("return_routing: the model has no MoE router (a dense model routes nothing)")
        top_k = int(getattr(self.routing.routers[0], "top_k", 0) or self.model.config.num_experts_per_tok)
        return torch.full((n, width, self.routing.layers, top_k), -1, dtype=torch.long, device=self.device)

    @staticmethod
    def _sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """One step's tokens ``(B,)`` and their log-probs under the distribution they were drawn from: the
        argmax and the raw log-softmax when greedy, else a draw from the temperature-scaled, top-k/top-p
        filtered distribution (one generator for the batch: every row draws its own numbers)."""
        if params.greedy:
            step_logp = torch.log_softmax(logits, dim=-1)
            token = logits.argmax(dim=-1)
        else:
            scaled = filter_logits(logits / float(params.temperature), params.top_k, params.top_p)
            step_logp = torch.log_softmax(scaled, dim=-1)
            token = torch.multinomial(step_logp.exp(), 1, generator=generator).squeeze(1)
        return token, step_logp.gather(1, token[:, None]).squeeze(1)

    def _prefill(self, prompt_ids: torch.Tensor, attn: torch.Tensor, positions: torch.Tensor, cache: Any
                 ) -> torch.Tensor:
        """The prompts' forward, once per distinct prompt: rows that repeat one (a GRPO group's samples) get a
        copy of its KV cache and its last logits. The first response token's ``(B, V)`` logits."""
        group, first = distinct_prompts(prompt_ids, attn)
        if len(first) == len(group):
            return self._forward(prompt_ids, attn, positions, cache)
        logits = self._forward(prompt_ids[first], attn[first], positions[first], cache)
        cache.reorder_cache(group)
        return logits[group]

    @staticmethod
    def _result(ids: torch.Tensor, mask: torch.Tensor, log_probs: torch.Tensor, routed: torch.Tensor | None = None,
                prompt_routed: torch.Tensor | None = None) -> Batch:
        tensors = {RESPONSE_IDS: ids.cpu(), RESPONSE_MASK: mask.cpu(), ROLLOUT_LOG_PROBS: log_probs.cpu()}
        if routed is not None and prompt_routed is not None:
            tensors[ROUTED_EXPERTS] = routed.cpu()
            tensors[PROMPT_ROUTED_EXPERTS] = prompt_routed.cpu()
        return Batch.from_tensors(tensors)

    # --- weights ----------------------------------------------------------------------------------
    def _targets(self) -> dict[str, torch.Tensor]:
        # remove_duplicate=False lists tied weights under every name (lm_head.weight and
        # model.embed_tokens.weight are then the same tensor).
        targets = dict(self.model.named_parameters(remove_duplicate=False))
        for name, buf in self.model.named_buffers(remove_duplicate=False):
            targets.setdefault(name, buf)
        # fused MoE experts also answer to their checkpoint names, one expert's projection each (a view)
        targets.update(expert_views(targets))
        return targets

    def import_weights(self, bucket: WeightBucket) -> None:
        """Copy each ``(name, tensor)`` into the model's tensor of that HF name (cast to its dtype/device).
        With tied embeddings ``lm_head.weight`` and ``model.embed_tokens.weight`` are one tensor: either name
        (or both) may be sent. MoE experts arrive under their checkpoint names (``hybridrl.weights.experts``)
        and land in their slice of the model's fused experts tensors (the fused names are accepted too). With
        LoRA's ``sync: adapter`` the buckets hold adapters (``hybridrl.lora``), kept
        until ``finish_weight_import`` merges them. An unknown name raises ``KeyError``; a shape mismatch
        ``ValueError``."""
        targets = self._targets()
        with torch.no_grad():
            for name, tensor in bucket:
                if self.adapters is not None and is_adapter_name(name):
                    self.adapters.stage(name, tensor)  # merged once the sync's last bucket is in
                    continue
                target = targets.get(name)
                if target is None:
                    raise KeyError(f"HFRollout.import_weights: the model has no weight named '{name}'")
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ValueError(f"HFRollout.import_weights: '{name}' has shape {tuple(tensor.shape)}, "
                                     f"the model's is {tuple(target.shape)}")
                target.copy_(tensor.detach())

    def finish_weight_import(self) -> None:
        """Merge the adapters of a LoRA sync; nothing to reset (the KV cache lives only inside one ``generate``
        call); counts the updates."""
        if self.adapters is not None and self.adapters.pending:
            self.adapters.apply()
        self.weight_version += 1

    def sleep(self) -> None:
        """On CUDA, move the weights to host memory and release the cached device memory. On CPU a no-op:
        the weights already live in host memory, there is no device memory to hand to the trainer, and the
        KV cache is freed at the end of every ``generate`` call anyway."""
        if self.device.type == "cuda" and not self._sleeping:
            self.model.to("cpu")
            torch.cuda.empty_cache()
        self._sleeping = self.device.type == "cuda"

    def wake(self) -> None:
        """Undo ``sleep``: move the weights back to the device (a no-op on CPU)."""
        if self._sleeping:
            self.model.to(self.device)
            self._sleeping = False

    def named_weights(self) -> Iterator[NamedTensor]:
        """The model's parameters under their HF names (tied weights once, as ``named_parameters`` gives), MoE
        experts under the checkpoint's per-expert names."""
        yield from to_checkpoint_layout(self.model.named_parameters())
