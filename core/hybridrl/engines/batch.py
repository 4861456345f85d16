"""The batch that flows between roles: a TensorDict of padded tensors plus per-sample Python fields.

Tensor layout (B = sequences): prompts are left-padded to P tokens, responses right-padded to R tokens, so
``input_ids = cat(prompt_ids, response_ids)`` puts every response at the same columns ``P .. P+R``.
Per-token tensors of the response (log-probs, advantages, masks) are all ``(B, R)``.

A multi-turn trajectory (``hybridrl.environments``) is one row too: ``response_ids`` holds every token after the
prompt, the model's turns and the environment's observations (tool results ...) interleaved. Two masks then
differ: ``response_mask`` is 1 on the model's own tokens only, the tokens that are trained (log-probs, KL,
advantages and losses are all taken under it), and ``response_attention_mask`` is 1 on every real token, the
observations included, which are context the model attends to. A batch without ``response_attention_mask``
(single-turn) attends to exactly its trained tokens. Use ``response_attention_mask(batch)`` and
``sequence_tensors(batch)`` rather than reading ``response_mask`` as the attention.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

# --- the keys a step's batch carries (every key the core or a plugin reads or writes is one of these) -------
# tensors, (B, P) or (B, R) unless said
PROMPT_IDS = "prompt_ids"  # left-padded prompt tokens (int64)
PROMPT_MASK = "prompt_mask"  # 1 at real prompt tokens
RESPONSE_IDS = "response_ids"  # right-padded sampled tokens, the stop token included (int64)
RESPONSE_MASK = "response_mask"  # 1 at real response tokens
ROLLOUT_LOG_PROBS = "rollout_log_probs"  # the rollout engine's log-probs of its sampled tokens
OLD_LOG_PROBS = "old_log_probs"  # the actor's log-probs before this step's update
REF_LOG_PROBS = "ref_log_probs"  # the reference policy's log-probs
LOG_PROBS = "log_probs"  # what ``compute_log_probs`` returns (and an objective's ``outputs`` key)
ENTROPY = "entropy"  # per-token entropy of the policy (``compute_log_probs(with_entropy=True)``)
VALUES = "values"  # the critic's value of the state before each response token
ADVANTAGES = "advantages"
RETURNS = "returns"  # the critic's targets
TOKEN_REWARDS = "token_rewards"  # the reward placed on tokens (the score on the last real one, KL as reward)
SCORES = "scores"  # (B,) one reward per sequence
TRUNCATED = "truncated"  # (B,) bool: the response reached max_new_tokens without stopping
GROUP_INDEX = "group_index"  # (B,) which prompt of the step a row samples (a GRPO group shares it)
MAX_NEW_TOKENS = "max_new_tokens"  # (B,) optional per-row cap on the response, at most the params' max_new_tokens
FINISHED = "finished"  # (B,) bool: ``generate_until``'s row ended (a stop token or its cap), not cut short
TOKEN_VERSIONS = "token_versions"  # (B, R) int64: the actor version whose weights sampled each response token
ROUTED_EXPERTS = "routed_experts"  # (B, R, layers, top_k) int64: each response token's rollout experts (-1: none)
PROMPT_ROUTED_EXPERTS = "prompt_routed_experts"  # (B, P, layers, top_k) int64: the prompt's, at prefill (-1: pad)
ROUTING_MISMATCH = "routing_mismatch"  # (B, R) 1.0 where the trainer's own top-k differs from ``routed_experts``
BASELINE_SCORES = "baseline_scores"  # (B,) the score of one greedy response per prompt, per row of its group
#: multi-turn rows: 1 on every real response token (model and observation); see the module docstring.
RESPONSE_ATTENTION_MASK = "response_attention_mask"
# per-row Python fields (non-tensors)
PROMPT_TEXT = "prompt"  # the prompt as the model was given it (a chat rendered by its template)
META = "meta"  # the row's other fields from the dataset (``answer`` ...), a dict per row
RESPONSE_TEXT = "response_text"  # the decoded response the reward scored
MESSAGES = "messages"  # multi-turn rows: the chat the prompt came from
#: what a forward over prompt+response needs (``sequence_keys`` adds the attention mask where a batch has one).
SEQUENCE_KEYS = (PROMPT_IDS, PROMPT_MASK, RESPONSE_IDS, RESPONSE_MASK)


_NUMPY_INCOMPATIBLE = {torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2}


def _rebuild_batch(arrays: dict[str, Any], size: int, non_tensors: dict[str, list[Any]],
                   info: dict[str, Any]) -> Batch:
    # Arrays from Ray's object store are read-only views; copy those so tensors stay safely writable.
    tensors = {k: v if isinstance(v, torch.Tensor) else torch.from_numpy(v if v.flags.writeable else v.copy())
               for k, v in arrays.items()}
    return Batch(TensorDict(tensors, batch_size=[size]), non_tensors, info)


@dataclass
class Batch:
    """Padded tensors (batch dimension first) plus per-sample non-tensor fields and batch-level info.

    ``tensors``: a ``TensorDict`` of ``(B, ...)`` tensors under the keys above; ``non_tensors``: Python lists of
    length ``B`` (``PROMPT_TEXT``, ``META``, ``RESPONSE_TEXT``); ``info``: batch-level values, e.g.
    ``info["temperature"]``, the sampling temperature a train engine divides its logits by. ``batch[key]``
    reads either kind. What a train engine receives: ``compute_log_probs`` (and ``compute_values``,
    ``compute_greedy_margins``, ``compute_scores``) get ``PROMPT_IDS``, ``PROMPT_MASK``, ``RESPONSE_IDS``,
    ``RESPONSE_MASK`` and return a *new* Batch holding only their outputs (the driver merges it); ``update``
    gets those four plus what the objective reads (``ADVANTAGES``, ``OLD_LOG_PROBS``, ``REF_LOG_PROBS``,
    ``RETURNS``, ``VALUES``, ``ROLLOUT_LOG_PROBS``, whichever the algorithm uses)."""

    tensors: TensorDict
    non_tensors: dict[str, list[Any]] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self)
        for key, values in self.non_tensors.items():
            if len(values) != n:
                raise ValueError(f"non-tensor field '{key}' has {len(values)} entries for a batch of {n}")

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], non_tensors: dict[str, list[Any]] | None = None,
                     info: dict[str, Any] | None = None) -> Batch:
        """A batch from ``{key: (B, ...) tensor}`` (all of one ``B``), optional per-row lists and info: how an
        engine builds what it returns, e.g. ``Batch.from_tensors({LOG_PROBS: lp})``."""
        sizes = {t.shape[0] for t in tensors.values()}
        if len(sizes) > 1:
            raise ValueError(f"tensors disagree on batch size: {sizes}")
        size = sizes.pop() if sizes else len(next(iter((non_tensors or {}).values()), []))
        return cls(TensorDict(tensors, batch_size=[size]), dict(non_tensors or {}), dict(info or {}))

    def __len__(self) -> int:
        """The number of rows ``B``."""
        return int(self.tensors.batch_size[0]) if self.tensors.batch_size else 0

    def __reduce__(self) -> tuple:
        """Pickle CPU tensors as numpy arrays: Ray ships those as zero-copy buffers, which makes a
        driver <-> worker round trip several times cheaper than pickling the TensorDict."""
        arrays: dict[str, Any] = {}
        for key, value in self.tensors.items():
            on_cpu = isinstance(value, torch.Tensor) and value.device.type == "cpu"
            if on_cpu and value.dtype not in _NUMPY_INCOMPATIBLE:
                arrays[key] = value.numpy()
            else:
                arrays[key] = value
        return (_rebuild_batch, (arrays, len(self), self.non_tensors, self.info))

    def __getitem__(self, key: str) -> Any:
        """The tensor (or per-row list) under ``key``; ``KeyError`` when the batch has neither."""
        if key in self.tensors.keys():
            return self.tensors[key]
        return self.non_tensors[key]

    def __contains__(self, key: str) -> bool:
        """Whether ``key`` is a tensor or a per-row field of the batch (``info`` is not searched)."""
        return key in self.tensors.keys() or key in self.non_tensors

    def set(self, key: str, value: torch.Tensor | list[Any]) -> None:
        """Add or replace a field in place: a tensor (``(B, ...)``) or a per-row list of length ``B``."""
        if isinstance(value, torch.Tensor):
            self.tensors.set(key, value)
        else:
            if len(value) != len(self):
                raise ValueError(f"field '{key}' has {len(value)} entries for a batch of {len(self)}")
            self.non_tensors[key] = list(value)

    def update(self, other: Batch) -> Batch:
        """Add (or overwrite) the fields of ``other``, which must have the same length."""
        if len(other) != len(self):
            raise ValueError(f"cannot merge a batch of {len(other)} into one of {len(self)}")
        self.tensors.update(other.tensors)
        self.non_tensors.update(other.non_tensors)
        self.info.update(other.info)
        return self

    def to(self, device: str | torch.device) -> Batch:
        """The same batch with its tensors on ``device`` (non-tensor fields are shared)."""
        return Batch(self.tensors.to(device), self.non_tensors, self.info)

    def select(self, *keys: str) -> Batch:
        """A new batch with only ``keys`` (tensors are shared, not copied; ``info`` is copied);
        ``KeyError`` names the missing ones."""
        tensor_keys = [k for k in keys if k in self.tensors.keys()]
        other = {k: self.non_tensors[k] for k in keys if k in self.non_tensors}
        missing = set(keys) - set(tensor_keys) - set(other)
        if missing:
            raise KeyError(f"batch has no field(s) {sorted(missing)}")
        return Batch(self.tensors.select(*tensor_keys), other, dict(self.info))

    def index(self, idx: torch.Tensor | Sequence[int]) -> Batch:
        """A new batch of the rows ``idx``, in that order (tensors gathered, so copies)."""
        idx_t = torch.as_tensor(idx, dtype=torch.long)
        idx_l = idx_t.tolist()
        return Batch(self.tensors[idx_t], {k: [v[i] for i in idx_l] for k, v in self.non_tensors.items()},
                     dict(self.info))

    def repeat_interleave(self, n: int) -> Batch:
        """Each sample ``n`` times in a row (the n samples of one prompt stay adjacent)."""
        return self.index(torch.arange(len(self)).repeat_interleave(n))

    def chunk(self, parts: int) -> list[Batch]:
        """Split into ``parts`` equal batches; the length must divide (see ``pad_to_multiple``)."""
        if len(self) % parts:
            raise ValueError(f"batch of {len(self)} does not split into {parts} equal parts")
        size = len(self) // parts
        return [self.index(range(i * size, (i + 1) * size)) for i in range(parts)]

    def pad_to_multiple(self, divisor: int, zero_keys: Sequence[str] = ()) -> tuple[Batch, int]:
        """Append copies of the first rows so the length divides ``divisor``; returns (batch, pad count).
        ``zero_keys`` (e.g. the response mask before an update) are zeroed in the copies so that they
        weigh nothing."""
        pad = (-len(self)) % divisor
        if pad == 0:
            return self, 0
        idx = list(range(len(self))) + [i % len(self) for i in range(pad)]
        padded = self.index(idx)
        for key in zero_keys:
            if key in padded.tensors.keys():
                padded.tensors[key][len(self):] = 0
        return padded, pad

    def unpad(self, pad: int) -> Batch:
        """Undo ``pad_to_multiple``: the batch without its last ``pad`` rows."""
        return self if pad == 0 else self.index(range(len(self) - pad))

    @staticmethod
    def concat(batches: Iterable[Batch]) -> Batch:
        """The rows of ``batches`` one after the other (the same keys in each; ``info`` merged, later wins)."""
        batches = list(batches)
        if not batches:
            raise ValueError("cannot concatenate zero batches")
        tensors: TensorDict = torch.cat([b.tensors for b in batches], dim=0)  # type: ignore[assignment]
        keys = batches[0].non_tensors.keys()
        non_tensors = {k: [x for b in batches for x in b.non_tensors[k]] for k in keys}
        info: dict[str, Any] = {}
        for b in batches:
            info.update(b.info)
        return Batch(tensors, non_tensors, info)


def first_row_of_each_group(group_index: Sequence[int]) -> dict[int, int]:
    """``{group: its first row}`` in the order the groups first appear (a step's rows repeat each prompt
    ``n_samples`` times under one ``group_index``)."""
    first: dict[int, int] = {}
    for row, group in enumerate(group_index):
        first.setdefault(int(group), row)
    return first


def response_attention_mask(batch: Batch) -> torch.Tensor:
    """``(B, R)``: 1 on every real response token, the observations of a multi-turn row included
    (``response_attention_mask``); a single-turn batch has none and attends to its ``response_mask``."""
    return batch[RESPONSE_ATTENTION_MASK] if RESPONSE_ATTENTION_MASK in batch else batch[RESPONSE_MASK]


def sequence_keys(batch: Batch) -> tuple[str, ...]:
    """The keys a forward over prompt+response reads (``SEQUENCE_KEYS``, plus the attention mask of a
    multi-turn batch): select these, not ``SEQUENCE_KEYS`` alone, or the observations become padding."""
    return SEQUENCE_KEYS + ((RESPONSE_ATTENTION_MASK,) if RESPONSE_ATTENTION_MASK in batch else ())


def last_positions(mask: torch.Tensor) -> torch.Tensor:
    """``(B,)`` column of each row's last 1 in ``mask`` (0 for a row without any): the last trained token of
    a response (``response_mask``), which a multi-turn row need not have at ``mask.sum() - 1``."""
    if mask.shape[-1] == 0:
        return torch.zeros(mask.shape[:-1], dtype=torch.long, device=mask.device)
    columns = torch.arange(1, mask.shape[-1] + 1, device=mask.device)  # 1-based: 0 marks "no token"
    return ((mask != 0).long() * columns).amax(dim=-1).sub(1).clamp(min=0)


def distinct_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(group, first)`` of left-padded prompts: ``group`` (B,) the same id (from 0, in no set order) for rows
    whose prompts are the same real tokens, ``first`` (G,) the first row of each group (the one that stands for
    it where a prompt is computed once: a GRPO group's samples repeat it)."""
    if not len(prompt_ids):
        return (torch.zeros(0, dtype=torch.long, device=prompt_ids.device),) * 2
    group = torch.unique(prompt_ids.masked_fill(prompt_mask == 0, -1), dim=0, return_inverse=True)[1]
    rows = torch.arange(len(group), device=group.device)
    first = torch.full((int(group.max()) + 1,), len(group), dtype=torch.long, device=group.device).scatter_reduce(
        0, group, rows, reduce="amin")
    return group, first


def sequence_tensors(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, position_ids)`` of prompt+response, positions counted over real tokens
    (the observation tokens of a multi-turn row are real: attended to, never trained).

    A row's real tokens sit between left padding (of the prompt) and right padding (of the response), so its
    first real token is not at column 0: pass these ``position_ids`` to the model (a model with absolute
    position embeddings scores every left-padded row at the wrong positions without them). An engine that
    drops the padding and packs the rows must restart the positions at 0 for each row."""
    input_ids = torch.cat([batch[PROMPT_IDS], batch[RESPONSE_IDS]], dim=1)
    attention_mask = torch.cat([batch[PROMPT_MASK], response_attention_mask(batch)], dim=1).long()
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return input_ids, attention_mask, position_ids


def balanced_order(lengths: Sequence[int], parts: int) -> list[int]:
    """A row order whose ``parts`` consecutive equal chunks carry nearly equal sums of ``lengths`` (the number
    of rows must divide): rows longest first, each to the chunk with the fewest tokens that still has room
    (greedy longest-processing-time under a row quota). Within a chunk rows keep their original order."""
    n = len(lengths)
    if parts <= 1 or n % parts:
        return list(range(n))
    quota = n // parts
    loads = [(0, part) for part in range(parts)]  # a heap of (tokens, part) over the parts with room
    members: list[list[int]] = [[] for _ in range(parts)]
    for row in sorted(range(n), key=lambda i: (-lengths[i], i)):
        load, part = heapq.heappop(loads)
        members[part].append(row)
        if len(members[part]) < quota:
            heapq.heappush(loads, (load + lengths[row], part))
    return [row for part in members for row in sorted(part)]


def token_balanced_order(batch: Batch, parts: int) -> torch.Tensor | None:
    """``balanced_order`` of a batch of prompt+response rows by their real tokens, for a scatter over
    ``parts`` data-parallel ranks (a rank's forward and backward cost its tokens, not its rows). None when
    there is nothing to balance: one part, or no responses yet (a generation batch)."""
    if parts <= 1 or RESPONSE_MASK not in batch or PROMPT_MASK not in batch or len(batch) % parts:
        return None
    lengths = (batch[PROMPT_MASK].sum(-1) + response_attention_mask(batch).sum(-1)).tolist()
    return torch.tensor(balanced_order(lengths, parts), dtype=torch.long)


def padded_rows(sequences: Sequence[Sequence[float]], width: int, fill: float, dtype: torch.dtype,
                left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, kept)`` of shape (B, width): each sequence in its row, right-aligned when ``left`` (left
    padding) else left-aligned, ``fill`` elsewhere; ``kept`` is True where a value sits. The values are
    converted in one go (a 512 x 256 batch: milliseconds, against a tensor per row)."""
    lengths = torch.tensor([len(seq) for seq in sequences], dtype=torch.long)
    if len(sequences) and int(lengths.max()) > width:
        raise ValueError(f"a sequence of {int(lengths.max())} does not fit a width of {width}")
    columns = torch.arange(width)[None, :]
    kept = columns >= (width - lengths)[:, None] if left else columns < lengths[:, None]
    values = torch.full((len(sequences), width), fill, dtype=dtype)
    count = int(lengths.sum())
    if count:  # row-major order of ``kept`` is the sequences' order, each sequence's values in turn
        flat = np.fromiter(chain.from_iterable(sequences), dtype=_NUMPY_DTYPES[dtype], count=count)
        values[kept] = torch.from_numpy(flat)
    return values, kept


_NUMPY_DTYPES = {torch.long: np.int64, torch.float32: np.float32, torch.float64: np.float64}


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int, width: int | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists into ``(ids, mask)`` of shape (B, width)."""
    width = width or max((len(s) for s in sequences), default=0)
    ids, kept = padded_rows(sequences, width, pad_id, torch.long, left=True)
    return ids, kept.long()


def right_pad(sequences: Sequence[Sequence[int]], pad_id: int, width: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists into ``(ids, mask)`` of shape (B, width)."""
    width = width or max((len(s) for s in sequences), default=0)
    ids, kept = padded_rows(sequences, width, pad_id, torch.long)
    return ids, kept.long()


def cap_responses(out: Batch, caps: torch.Tensor) -> Batch:
    """``out``'s responses cut to each row's cap (``max_new_tokens`` (B,)): mask and log-probs zeroed past it
    (the ids there are left as they were, masked). For an engine that cannot stop a row at its own cap."""
    width = out[RESPONSE_MASK].shape[1]
    keep = (torch.arange(width).unsqueeze(0) < caps.reshape(-1, 1).to(torch.long)).to(out[RESPONSE_MASK].dtype)
    out.set(RESPONSE_MASK, out[RESPONSE_MASK] * keep)
    if ROLLOUT_LOG_PROBS in out:
        out.set(ROLLOUT_LOG_PROBS, out[ROLLOUT_LOG_PROBS] * keep)
    return out


def groups_to_complete(group_index: torch.Tensor, share: float) -> int:
    """How many of the distinct groups in ``group_index`` a ``generate_until(share=...)`` call completes before
    it may stop: ``ceil(share * groups)``, at least one where there are rows (so every call makes progress)."""
    groups = int(torch.unique(group_index).numel()) if len(group_index) else 0
    return min(groups, max(1 if groups else 0, math.ceil(share * groups - 1e-9)))


def complete_groups(group_index: torch.Tensor, finished: torch.Tensor) -> int:
    """How many distinct groups have every one of their rows ``finished`` (both (B,))."""
    if not len(group_index):
        return 0
    groups, inverse = torch.unique(group_index, return_inverse=True)
    unfinished = torch.zeros(len(groups), dtype=torch.long, device=group_index.device)
    unfinished.scatter_add_(0, inverse, (~finished).long())
    return int((unfinished == 0).sum())
