"""Engine-free pieces shared by the rollout backends (the ``hf`` engine here and the vLLM / SGLang plugins).

No inference-engine import: only torch, and transformers inside ``special_ids``. What is here:

* the model's EOS / pad ids, read from its configs (``as_id_list``, ``eos_and_pad``, ``special_ids``);
* which ranks of a pool form one engine replica (``ReplicaLayout``);
* seeds that differ per (step seed, replica, row) (``mix_seed``, ``request_seeds``, ``engine_seed``);
* between hybridrl's padded tensors and per-request token lists (``unpad_prompts``, ``row_caps``,
  ``check_context``, ``pack_responses``), and per-request routing (``pack_routing``);
* when a ``generate_until`` may stop, and which groups decode meanwhile: groups whose rows have all finished,
  counted as rows finish, each letting a waiting group start (``GroupCompletion``, ``running_groups``);
* reading the rollout role's free-form options (``read_options``, ``read_choices``, ``check_engine_options``,
  ``check_choice``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hybridrl.data_parallel import DataParallelInfo
from hybridrl.engines.batch import (
    MAX_NEW_TOKENS,
    PROMPT_ROUTED_EXPERTS,
    RESPONSE_IDS,
    RESPONSE_MASK,
    ROLLOUT_LOG_PROBS,
    ROUTED_EXPERTS,
    Batch,
    groups_to_complete,
)


# --- special token ids --------------------------------------------------------------------------------------
def as_id_list(value: Any) -> list[int]:
    """A config's token id field (``None``, one id or a list of ids) as a list of ints."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def eos_and_pad(gen: Any, cfg: Any, model_path: str) -> tuple[list[int], int]:
    """The EOS ids and pad id of a model from its generation config ``gen`` (first; may be ``None``) and its model
    config ``cfg``. No pad id: the first EOS. No EOS id in either: ``ValueError`` naming ``model_path``."""
    eos = as_id_list(getattr(gen, "eos_token_id", None)) or as_id_list(getattr(cfg, "eos_token_id", None))
    if not eos:
        raise ValueError(f"model at '{model_path}' names no eos_token_id (config or generation config)")
    pad = as_id_list(getattr(gen, "pad_token_id", None)) or as_id_list(getattr(cfg, "pad_token_id", None))
    return eos, (pad[0] if pad else eos[0])


def special_ids(model_path: str, cfg: Any = None) -> tuple[list[int], int]:
    """The model's EOS ids and pad id (generation config first, then model config), read without loading
    weights. ``cfg``: the model config when already loaded (else read here). An engine without a tokenizer
    uses these to stop a row and pad a response."""
    from transformers import AutoConfig, GenerationConfig

    if cfg is None:
        cfg = AutoConfig.from_pretrained(model_path)
    try:
        gen = GenerationConfig.from_pretrained(model_path)
    except OSError:
        gen = None
    return eos_and_pad(gen, cfg, model_path)


# --- replicas -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReplicaLayout:
    """Which ranks of a pool form one engine replica.

    A pool of ``world_size`` ranks hosts ``world_size // tp`` replicas of ``tp`` consecutive ranks (one
    tensor-parallel group each). The peers of one replica get the same prompts and sample the same tokens;
    only the first rank of a replica (its *leader*) returns them."""

    rank: int
    world_size: int
    tp: int

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"tensor_parallel must be >= 1, got {self.tp}")
        if self.world_size % self.tp:
            raise ValueError(f"the rollout pool has {self.world_size} device(s), not a multiple of "
                             f"tensor_parallel={self.tp}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside a pool of {self.world_size}")

    @property
    def replica(self) -> int:
        """Index of this rank's engine replica (its data-parallel rank)."""
        return self.rank // self.tp

    @property
    def replicas(self) -> int:
        return self.world_size // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def leader(self) -> bool:
        """Whether this rank is the first of its replica (the one that returns the replica's output)."""
        return self.tp_rank == 0

    @property
    def peers(self) -> list[int]:
        """Pool ranks of this replica, leader first."""
        first = self.replica * self.tp
        return list(range(first, first + self.tp))

    def data_parallel(self) -> DataParallelInfo:
        return DataParallelInfo(dp_rank=self.replica, dp_size=self.replicas, returns_output=self.leader)


# --- seeds --------------------------------------------------------------------------------------------------
_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix_seed(*parts: int) -> int:
    """A well-spread non-negative 63-bit seed from integers (order matters; fits int64 seeds): nearby inputs
    such as consecutive rows or replicas give unrelated seeds."""
    h = 0
    for p in parts:
        h = _splitmix64(h ^ (int(p) & _MASK64))
    return h >> 1


def request_seeds(seed: int | None, replica: int, rows: int) -> list[int] | None:
    """One seed per row, different for every (step seed, replica, row): identical prompts (a GRPO group)
    draw different responses, and the peers of one tensor-parallel replica (same replica index) draw the
    same ones. ``None`` when the caller gave no seed."""
    if seed is None:
        return None
    return [mix_seed(seed, replica, row) for row in range(rows)]


def engine_seed(base_seed: int, replica: int) -> int:
    """The engine-level seed of a replica: the same for the tensor-parallel peers of a replica, different
    between replicas, so replicas sampling from the engine's own stream draw distinct streams."""
    return mix_seed(base_seed, replica) % (2**31 - 1)


# --- padded tensors <-> per-request token lists -------------------------------------------------------------
def unpad_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[list[int]]:
    """The real tokens of each row (where the mask is 1), in order. A row with no token raises
    ``ValueError`` naming it: an engine cannot generate from an empty prompt."""
    if prompt_ids.shape != prompt_mask.shape:
        raise ValueError(f"prompt_ids {tuple(prompt_ids.shape)} and prompt_mask {tuple(prompt_mask.shape)} differ")
    ids = prompt_ids.to(torch.long).tolist()
    keep = prompt_mask.to(torch.bool).tolist()
    rows = []
    for i, (row, m) in enumerate(zip(ids, keep)):
        tokens = [t for t, k in zip(row, m) if k]
        if not tokens:
            raise ValueError(f"row {i}: empty prompt (its prompt_mask has no token)")
        rows.append(tokens)
    return rows


def row_caps(batch: Batch, width: int) -> list[int] | None:
    """Each row's token budget: its ``max_new_tokens`` cap, clamped to ``[0, width]`` (``width``: the call's
    ``params.max_new_tokens``, which stays the packed width); None when the batch carries no caps."""
    if MAX_NEW_TOKENS not in batch:
        return None
    return [min(max(int(c), 0), width) for c in batch[MAX_NEW_TOKENS].reshape(-1).tolist()]


def check_context(prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
                  context_length: int | None) -> None:
    """Refuse a row whose prompt plus ``max_new_tokens`` (one for all rows, or each row's cap) exceeds the
    engine's context, before any row starts (an engine would reject it with a less specific message, after the
    other rows started). A resumed row (prompt + its tokens so far) fits with the rest of its budget."""
    if context_length is None:
        return
    caps = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    for i, (p, cap) in enumerate(zip(prompts, caps)):
        if len(p) + cap > context_length:
            raise ValueError(f"row {i}: prompt of {len(p)} tokens + max_new_tokens={cap} exceeds the "
                             f"engine's context length {context_length}")


def running_groups(group_index: torch.Tensor, running: float) -> int | None:
    """How many of the distinct groups in ``group_index`` a ``generate_until(running=...)`` call decodes at once:
    ``ceil(running * groups)``, at least one; None (every group at once) for ``running`` 1 or more."""
    return None if running >= 1 else max(1, groups_to_complete(group_index, running))


class GroupCompletion:
    """Which rows of a ``generate_until`` call have finished, how many groups (rows sharing a ``group_index``)
    have all theirs, and which rows decode: an engine calls ``finish`` as its requests end and stops once
    ``done``. Constant work per finished row (the decode loop calls it every step).

    ``running`` (None: every group at once) caps the groups decoding at once: the others wait in batch order
    (of their first row), and each starts as soon as a running group completes, so the engine keeps
    ``running`` groups decoding instead of a batch that empties into a tail of a few long rows
    (capability ``refill``). ``begin`` names the rows to start, ``finish`` the rows it lets start."""

    def __init__(self, group_index: Sequence[int], groups_needed: int, running: int | None = None) -> None:
        self.group_of = [int(g) for g in group_index]
        self.left: dict[int, int] = {}
        self.rows_of: dict[int, list[int]] = {}
        for row, g in enumerate(self.group_of):
            self.left[g] = self.left.get(g, 0) + 1
            self.rows_of.setdefault(g, []).append(row)
        self.finished = [False] * len(self.group_of)
        self.complete = 0
        self.needed = groups_needed
        order = list(self.rows_of)  # groups in the order of their first row (dicts keep insertion order)
        cut = len(order) if running is None else max(1, running)
        self.waiting = order[cut:]
        self.started = False

    def begin(self) -> list[int]:
        """The rows to start now: the unfinished rows of the first ``running`` groups, and of as many waiting
        groups as the groups already complete (rows with no budget, finished before the call) let start."""
        self.started = True
        waiting = set(self.waiting)
        rows = [r for g, rows in self.rows_of.items() if g not in waiting for r in rows if not self.finished[r]]
        for _ in range(sum(1 for g, left in self.left.items() if left == 0 and g not in waiting)):
            rows += self._admit()
        return rows

    def finish(self, row: int) -> list[int]:
        """Row ``row`` ended (a stop token or its cap); a repeated call changes nothing. Returns the rows that
        start now (a waiting group's, when ``row`` completed its group and the call is not yet ``done``)."""
        if self.finished[row]:
            return []
        self.finished[row] = True
        group = self.group_of[row]
        self.left[group] -= 1
        if self.left[group] != 0:
            return []
        self.complete += 1
        return self._admit() if self.started else []

    def _admit(self) -> list[int]:
        """The next waiting group's unfinished rows (one whose rows all finished already completes at once and
        lets the next one start)."""
        while self.waiting and not self.done:
            group = self.waiting.pop(0)
            rows = [r for r in self.rows_of[group] if not self.finished[r]]
            if rows:
                return rows
            # a group with every row finished before it started: complete already, counted when finished
        return []

    @property
    def done(self) -> bool:
        """Enough groups are complete for the call to stop (every group, when as many are needed)."""
        return self.complete >= self.needed


def pack_responses(token_lists: Sequence[Sequence[int]], logprob_lists: Sequence[Sequence[float]] | None, width: int,
                   pad_id: int) -> Batch:
    """``response_ids`` (pad after the last token), ``response_mask`` (1 on every returned token, the stop
    token included) and ``rollout_log_probs`` (float32, 0 where masked; left out when ``logprob_lists`` is
    None), each ``(B, width)`` on CPU. A response longer than ``width`` raises (the engine was asked for at
    most ``width`` tokens)."""
    n = len(token_lists)
    lengths = [len(toks) for toks in token_lists]
    for i, k in enumerate(lengths):
        if k > width:
            raise ValueError(f"row {i}: {k} tokens returned, at most {width} asked for")
    if logprob_lists is not None:
        if len(logprob_lists) != n:
            raise ValueError(f"{n} responses but {len(logprob_lists)} log-prob lists")
        for i, (k, lps) in enumerate(zip(lengths, logprob_lists)):
            if len(lps) != k:
                raise ValueError(f"row {i}: {k} tokens but {len(lps)} log-probs")
    # one flat fill instead of three small copies per row: row-major masked assignment keeps the rows' order
    mask = (torch.arange(width).unsqueeze(0) < torch.tensor(lengths, dtype=torch.long).reshape(n, 1)).long()
    ids = torch.full((n, width), int(pad_id), dtype=torch.long)
    filled = mask.bool()
    ids[filled] = torch.tensor([t for toks in token_lists for t in toks], dtype=torch.long)
    tensors = {RESPONSE_IDS: ids, RESPONSE_MASK: mask}
    if logprob_lists is not None:
        logps = torch.zeros((n, width), dtype=torch.float32)
        logps[filled] = torch.tensor([v for lps in logprob_lists for v in lps], dtype=torch.float32)
        tensors[ROLLOUT_LOG_PROBS] = logps
    return Batch.from_tensors(tensors)



def pack_routing(routes: Sequence[Any], prompt_mask: torch.Tensor, response_lengths: Sequence[int], width: int
                 ) -> dict[str, torch.Tensor]:
    """``routed_experts`` ``(B, width, layers, top_k)`` and ``prompt_routed_experts`` ``(B, P, layers, top_k)``
    (int64, -1 where nothing was routed) from one array per request, ``(tokens fed, layers, top_k)``: an engine
    records the experts of every token it fed, the prompt's first and then each response token but the last (it
    is never fed). The prompt's rows land where ``prompt_mask`` is 1 (left padding or not), response token t's
    at column t. A request fed fewer tokens than its prompt and response imply raises (routing was lost)."""
    n, width_p = prompt_mask.shape
    if len(routes) != n or len(response_lengths) != n:
        raise ValueError(f"{n} prompts but {len(routes)} routing arrays and {len(response_lengths)} responses")
    arrays = [torch.as_tensor(r, dtype=torch.long) for r in routes]
    layers, top_k = next((tuple(a.shape[1:]) for a in arrays if a.ndim == 3 and a.shape[0]), (0, 0))
    routed = torch.full((n, width, layers, top_k), -1, dtype=torch.long)
    prompt_routed = torch.full((n, width_p, layers, top_k), -1, dtype=torch.long)
    prompt_lengths = prompt_mask.sum(dim=1).tolist()
    for i, (arr, p, r) in enumerate(zip(arrays, prompt_lengths, response_lengths)):
        if arr.numel() == 0 and int(r) == 0:  # a row given no budget: never sent
            continue
        fed = int(p) + max(int(r) - 1, 0)
        if arr.shape[0] < fed or (arr.shape[0] and tuple(arr.shape[1:]) != (layers, top_k)):
            raise ValueError(f"row {i}: routing of {tuple(arr.shape)} for a prompt of {int(p)} and a response of "
                             f"{int(r)} tokens ({fed} fed, each (layers={layers}, top_k={top_k}))")
        prompt_routed[i, prompt_mask[i].bool()] = arr[:int(p)]
        routed[i, :fed - int(p)] = arr[int(p):fed]
    return {ROUTED_EXPERTS: routed, PROMPT_ROUTED_EXPERTS: prompt_routed}

def attach_routing(packed: Batch, prompt_mask: torch.Tensor, routes: Sequence[Any]) -> Batch:
    """``packed`` (``pack_responses``' batch) with ``routed_experts`` and ``prompt_routed_experts`` from one
    routing array per request (``pack_routing``), each row's response length read from its mask."""
    mask = packed[RESPONSE_MASK]
    for key, value in pack_routing(routes, prompt_mask, mask.sum(dim=1).tolist(), mask.shape[1]).items():
        packed.set(key, value)
    return packed

# --- options ------------------------------------------------------------------------------------------------
#: how the options that mean the same to every engine backend are read (each backend adds its own).
ENGINE_OPTION_CASTS: dict[str, Callable[[Any], Any]] = {
    "tensor_parallel": int,
    "gpu_memory_utilization": float,
    "max_model_len": int,
    "max_num_seqs": int,
    "max_num_batched_tokens": int,
    "enforce_eager": bool,
    "enable_prefix_caching": bool,
    "sleep_mode": bool,
}


def read_options(options: Mapping[str, Any], casts: Mapping[str, Callable[[Any], Any]]) -> dict[str, Any]:
    """``{key: cast(value)}`` for each key of ``casts`` that ``options`` sets to something other than ``None``;
    an unset key is left out (the options dataclass's default applies)."""
    return {key: cast(options[key]) for key, cast in casts.items() if options.get(key) is not None}


def read_choices(options: Mapping[str, Any], keys: Iterable[str]) -> dict[str, str]:
    """``{key: str(value)}`` for each of ``keys`` that ``options`` sets to a true value (``None``, ``""`` ...:
    left out, the default applies); checked later against the allowed values (``check_choice``)."""
    return {key: str(options[key]) for key in keys if options.get(key)}


def check_engine_options(tensor_parallel: int, gpu_memory_utilization: float) -> None:
    if tensor_parallel < 1:
        raise ValueError(f"tensor_parallel must be >= 1, got {tensor_parallel}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")


def check_choice(key: str, value: Any, allowed: Sequence[Any]) -> None:
    if value not in allowed:
        raise ValueError(f"{key} must be one of {tuple(allowed)}, got '{value}'")


def parse_check(parse: Callable[[Mapping[str, Any]], Any]) -> Callable[..., list[tuple[str, str]]]:
    """A backend's ``check_options`` made from the parser its engine runs at start (``VLLMOptions.from_options``
    ...): what it would refuse then is reported in the pre-flight instead, before any process starts."""
    def option_problems(role: str, options: Mapping[str, Any], training: Any = None) -> list[tuple[str, str]]:
        try:
            parse(options)
        except (ValueError, TypeError) as exc:
            return [("", str(exc))]
        return []
    return option_problems
