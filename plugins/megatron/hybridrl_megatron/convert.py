"""Hugging Face <-> Megatron-core weight conversion for the Llama, Qwen2 and Qwen3-MoE families (pure tensor logic).

Nothing here needs megatron-core or torch.distributed, so it is unit-tested on its own.

Megatron names are those of ``GPTModel`` built with the *local* layer spec (no Transformer Engine), with
global layer indices, as one tensor-parallel rank would hold them with ``tensor_parallel=1`` ("full"):

=========================================================  ============================================
Megatron                                                   Hugging Face
=========================================================  ============================================
``embedding.word_embeddings.weight``                       ``model.embed_tokens.weight``
``decoder.layers.L.input_layernorm.weight``                ``model.layers.L.input_layernorm.weight``
``decoder.layers.L.self_attention.linear_qkv.weight|bias`` ``...self_attn.{q,k,v}_proj.weight|bias``
``decoder.layers.L.self_attention.linear_proj.weight``     ``...self_attn.o_proj.weight``
``decoder.layers.L.pre_mlp_layernorm.weight``              ``...post_attention_layernorm.weight``
``decoder.layers.L.mlp.linear_fc1.weight``                 ``...mlp.{gate,up}_proj.weight``
``decoder.layers.L.mlp.linear_fc2.weight``                 ``...mlp.down_proj.weight``
``decoder.final_layernorm.weight``                         ``model.norm.weight``
``output_layer.weight`` (untied only)                      ``lm_head.weight``
=========================================================  ============================================

A mixture-of-experts layer (Qwen3-MoE; Megatron's local spec: a ``SequentialMLP`` of experts) replaces the
MLP rows and adds Qwen3's per-head query/key norms:

==============================================================  ===================================================
``decoder.layers.L.self_attention.{q,k}_layernorm.weight``      ``model.layers.L.self_attn.{q,k}_norm.weight``
``decoder.layers.L.mlp.router.weight``                          ``model.layers.L.mlp.gate.weight``
``decoder.layers.L.mlp.experts.local_experts.E.linear_fc1``     ``...mlp.experts.E.{gate,up}_proj.weight``
``decoder.layers.L.mlp.experts.local_experts.E.linear_fc2``     ``...mlp.experts.E.down_proj.weight``
==============================================================  ===================================================

``E`` is the global expert index in the "full" names used here; expert parallelism (``shard_ep``) gives each of
``ep`` ranks a contiguous block of ``num_experts / ep`` experts, renumbered from 0 as Megatron's
``local_experts`` are.

Fused QKV uses Megatron's interleaved grouped-query layout: for each of the ``num_kv_heads`` query groups,
the group's ``heads/kv_heads`` query heads, then its key head, then its value head (rows of ``head_dim``).
Tensor parallelism splits whole groups, so a plain split of the rows gives each rank its groups. The fused
``linear_fc1`` is ``[gate; up]``; tensor parallelism splits gate and up separately, so each rank holds
``[gate_r; up_r]``.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from hybridrl.errors import HybridRLError

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3_moe")

#: HF files that describe the model besides its weights (copied next to converted weights).
_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")


class ConversionError(HybridRLError, ValueError):
    """The checkpoint is not of a supported family, or tensors are missing or mis-shaped."""


@dataclass(frozen=True)
class ModelSpec:
    """The architecture facts conversion and model building need, read from an HF ``config.json``."""

    family: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    qkv_bias: bool
    tie_embeddings: bool
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling_factor: float | None = None  # Llama 3 style scaling (Megatron's fixed 1/4/8192 variant)
    rope_linear_factor: float | None = None  # "linear" position interpolation
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's queries and keys
    num_experts: int = 0  # routed experts per layer (0: a dense MLP)
    experts_per_token: int = 0  # the router's top-k
    moe_ffn_hidden_size: int = 0  # one expert's MLP width
    norm_topk_prob: bool = True  # the top-k probabilities renormalised to sum to 1
    router_aux_loss_coef: float = 0.0  # the load-balancing loss weight the checkpoint was trained with

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def qkv_rows(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    def to_json(self) -> dict[str, Any]:
        """The spec as plain data (a dense model's without the MoE fields: as recorded before they existed)."""
        data = asdict(self)
        if not self.is_moe:
            for key in ("qk_norm", "num_experts", "experts_per_token", "moe_ffn_hidden_size", "norm_topk_prob",
                        "router_aux_loss_coef"):
                del data[key]
        return data

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelSpec:
        """Read a ``config.json`` dict (or ``PretrainedConfig.to_dict()``); unsupported features raise."""
        family = config.get("model_type")
        if family not in SUPPORTED_FAMILIES:
            raise ConversionError(f"model_type '{family}' is not supported "
                                  f"(supported: {', '.join(SUPPORTED_FAMILIES)})")
        problems = []
        if config.get("hidden_act", "silu") != "silu":
            problems.append(f"hidden_act '{config.get('hidden_act')}' (only silu)")
        if family == "llama" and (config.get("attention_bias") or config.get("mlp_bias")):
            problems.append("attention_bias/mlp_bias (biases on o_proj and the MLP have no local-spec counterpart)")
        if family in ("qwen2", "qwen3_moe") and config.get("use_sliding_window"):
            problems.append("use_sliding_window")
        moe: dict[str, Any] = {}
        if family == "qwen3_moe":
            experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
            if config.get("mlp_only_layers") or int(config.get("decoder_sparse_step") or 1) != 1:
                problems.append("dense layers between the expert layers (mlp_only_layers / decoder_sparse_step)")
            if config.get("attention_bias"):
                problems.append("attention_bias")
            moe = {"qk_norm": True, "num_experts": experts, "experts_per_token": int(config["num_experts_per_tok"]),
                   "moe_ffn_hidden_size": int(config["moe_intermediate_size"]),
                   "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
                   "router_aux_loss_coef": float(config.get("router_aux_loss_coef") or 0.0)}
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        hidden = int(config["hidden_size"])
        head_dim = int(config.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            problems.append(f"num_attention_heads {heads} not divisible by num_key_value_heads {kv_heads}")
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = linear = None
        if rope_type == "llama3":
            fixed = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
            if any(float(rope.get(k, v)) != v for k, v in fixed.items()):
                problems.append(f"llama3 rope scaling {rope} (megatron-core fixes low/high factors 1/4 and 8192)")
            scaling = float(rope.get("factor", 8.0))
        elif rope_type == "linear":
            linear = float(rope["factor"])
        elif rope_type != "default":
            problems.append(f"rope_type '{rope_type}'")
        if problems:
            raise ConversionError(f"{family} config not supported: " + "; ".join(problems))
        return cls(family=family, num_layers=int(config["num_hidden_layers"]), hidden_size=hidden,
                   num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                   ffn_hidden_size=int(config["intermediate_size"]), vocab_size=int(config["vocab_size"]),
                   qkv_bias=family == "qwen2", tie_embeddings=bool(config.get("tie_word_embeddings", False)),
                   rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=theta,
                   max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
                   rope_scaling_factor=scaling, rope_linear_factor=linear, **moe)


# --- names ------------------------------------------------------------------------------------------------
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
#: an expert's Megatron suffix -> its HF suffixes (``{e}``: the expert).
_EXPERT_MAP = {"linear_fc1": ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"),
               "linear_fc2": ("mlp.experts.{e}.down_proj.weight",)}
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

#: Megatron layer suffix -> HF layer suffixes it is fused from (in fusion order).
_LAYER_MAP: dict[str, tuple[str, ...]] = {
    "input_layernorm.weight": ("input_layernorm.weight",),
    "self_attention.linear_qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                         "self_attn.v_proj.weight"),
    "self_attention.linear_qkv.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight",),
    "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight",),
    "mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight",),
    "self_attention.q_layernorm.weight": ("self_attn.q_norm.weight",),
    "self_attention.k_layernorm.weight": ("self_attn.k_norm.weight",),
    "mlp.router.weight": ("mlp.gate.weight",),
}
_QK_NORMS = ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")
_DENSE_MLP = ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight")
_GLOBAL_MAP: dict[str, str] = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
    # a critic's scalar head (``nn.Linear(hidden, 1)``, kept beside the backbone as ``value_head.safetensors``)
    "value_head.weight": "value_head.weight",
    "value_head.bias": "value_head.bias",
}
VALUE_HEAD_NAMES = ("value_head.weight", "value_head.bias")


def layer_suffixes(spec: ModelSpec) -> list[str]:
    """The Megatron parameter suffixes of one decoder layer, in a fixed order (an MoE layer: the router, then
    each expert's two projections)."""
    out = [s for s in _LAYER_MAP if (spec.qkv_bias or not s.endswith("linear_qkv.bias"))
           and (spec.qk_norm or s not in _QK_NORMS) and (spec.is_moe or s != "mlp.router.weight")
           and not (spec.is_moe and s in _DENSE_MLP)]
    if spec.is_moe:
        out += [f"mlp.experts.local_experts.{e}.{part}.weight" for e in range(spec.num_experts)
                for part in ("linear_fc1", "linear_fc2")]
    return out


def mcore_names(spec: ModelSpec) -> list[str]:
    """Every full Megatron parameter name of the model, embedding first, layers in order, head last."""
    names = ["embedding.word_embeddings.weight"]
    names += [f"decoder.layers.{i}.{s}" for i in range(spec.num_layers) for s in layer_suffixes(spec)]
    names.append("decoder.final_layernorm.weight")
    if not spec.tie_embeddings:
        names.append("output_layer.weight")
    return names


def hf_names_for(mcore_name: str) -> list[str]:
    """The HF names one Megatron parameter is made of (one, or the parts of a fused tensor)."""
    if mcore_name in _GLOBAL_MAP:
        return [_GLOBAL_MAP[mcore_name]]
    match = _LAYER_RE.match(mcore_name)
    expert = _EXPERT_RE.match(match.group(2)) if match else None
    if expert:
        return [f"model.layers.{match.group(1)}.{s.format(e=expert.group(1))}" for s in _EXPERT_MAP[expert.group(2)]]
    if not match or match.group(2) not in _LAYER_MAP:
        raise ConversionError(f"no HF counterpart for Megatron parameter '{mcore_name}'")
    layer, suffix = match.groups()
    return [f"model.layers.{layer}.{s}" for s in _LAYER_MAP[suffix]]


def hf_shapes(spec: ModelSpec, mcore_name: str) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of the parts of one Megatron parameter, from the spec alone (receive buffers)."""
    h, d = spec.hidden_size, spec.head_dim
    suffix = mcore_name.split(".", 3)[-1] if mcore_name.startswith("decoder.layers.") else mcore_name
    expert = _EXPERT_RE.match(suffix)
    if expert:
        i = spec.moe_ffn_hidden_size
        sizes = [(i, h), (i, h)] if expert.group(2) == "linear_fc1" else [(h, i)]
        return list(zip(hf_names_for(mcore_name), sizes))
    shapes: dict[str, list[tuple[int, ...]]] = {
        "embedding.word_embeddings.weight": [(spec.vocab_size, h)],
        "output_layer.weight": [(spec.vocab_size, h)],
        "value_head.weight": [(1, h)],
        "value_head.bias": [(1,)],
        "decoder.final_layernorm.weight": [(h,)],
        "input_layernorm.weight": [(h,)],
        "pre_mlp_layernorm.weight": [(h,)],
        "self_attention.linear_qkv.weight": [(spec.num_heads * d, h), (spec.num_kv_heads * d, h),
                                             (spec.num_kv_heads * d, h)],
        "self_attention.linear_qkv.bias": [(spec.num_heads * d,), (spec.num_kv_heads * d,), (spec.num_kv_heads * d,)],
        "self_attention.linear_proj.weight": [(h, spec.num_heads * d)],
        "mlp.linear_fc1.weight": [(spec.ffn_hidden_size, h), (spec.ffn_hidden_size, h)],
        "mlp.linear_fc2.weight": [(h, spec.ffn_hidden_size)],
        "self_attention.q_layernorm.weight": [(d,)],
        "self_attention.k_layernorm.weight": [(d,)],
        "mlp.router.weight": [(spec.num_experts, h)],
    }
    return list(zip(hf_names_for(mcore_name), shapes[suffix]))


# --- fusing -----------------------------------------------------------------------------------------------
def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """HF q/k/v (weights ``(rows, hidden)`` or biases ``(rows,)``) -> Megatron's interleaved fused QKV."""
    g, d = spec.num_kv_heads, spec.head_dim
    rest = q.shape[1:]
    parts = (q.reshape(g, spec.heads_per_group * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest))
    return torch.cat(parts, dim=1).reshape(spec.qkv_rows, *rest)


def split_qkv(qkv: torch.Tensor, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of ``fuse_qkv``."""
    g, d = spec.num_kv_heads, spec.head_dim
    rest = qkv.shape[1:]
    grouped = qkv.reshape(g, (spec.heads_per_group + 2) * d, *rest)
    q, k, v = torch.split(grouped, [spec.heads_per_group * d, d, d], dim=1)
    return (q.reshape(spec.num_heads * d, *rest), k.reshape(g * d, *rest), v.reshape(g * d, *rest))


def to_mcore(mcore_name: str, hf_parts: list[torch.Tensor], spec: ModelSpec) -> torch.Tensor:
    """Build one full Megatron tensor from its HF parts (in ``hf_names_for`` order)."""
    if mcore_name.endswith("linear_qkv.weight") or mcore_name.endswith("linear_qkv.bias"):
        return fuse_qkv(*hf_parts, spec)
    if mcore_name.endswith("linear_fc1.weight"):
        return torch.cat(hf_parts, dim=0)
    (single,) = hf_parts
    return single


def from_mcore(mcore_name: str, tensor: torch.Tensor, spec: ModelSpec) -> list[tuple[str, torch.Tensor]]:
    """Split one full Megatron tensor into its HF (name, tensor) parts."""
    names = hf_names_for(mcore_name)
    if mcore_name.endswith("linear_qkv.weight") or mcore_name.endswith("linear_qkv.bias"):
        parts: Iterable[torch.Tensor] = split_qkv(tensor, spec)
    elif mcore_name.endswith("linear_fc1.weight"):
        parts = torch.chunk(tensor, 2, dim=0)
    else:
        parts = [tensor]
    return list(zip(names, parts))


def hf_to_mcore(hf_state: Mapping[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """A whole HF state dict -> full Megatron state dict (``tensor_parallel=1``, global layer indices)."""
    out = {}
    for name in mcore_names(spec):
        try:
            parts = [hf_state[n] for n in hf_names_for(name)]
        except KeyError as exc:
            raise ConversionError(f"HF state has no '{exc.args[0]}' (needed for '{name}')") from None
        out[name] = to_mcore(name, parts, spec)
    return out


def mcore_to_hf(mcore_state: Mapping[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Inverse of ``hf_to_mcore`` (a tied model gets ``model.embed_tokens.weight`` only)."""
    out: dict[str, torch.Tensor] = {}
    for name in mcore_names(spec):
        out.update(from_mcore(name, mcore_state[name], spec))
    return out


# --- tensor parallelism and vocabulary padding ---------------------------------------------------------------
def padded_vocab_size(vocab_size: int, tp_size: int, multiple: int = 128) -> int:
    """Megatron's rule: round the vocabulary up to a multiple of ``multiple * tp_size``."""
    step = max(1, multiple) * tp_size
    return -(-vocab_size // step) * step


def is_vocab_parallel(mcore_name: str) -> bool:
    return mcore_name in ("embedding.word_embeddings.weight", "output_layer.weight")


def pad_vocab(tensor: torch.Tensor, padded: int) -> torch.Tensor:
    """Zero rows appended up to ``padded`` (the logits of padded ids are masked out, never used)."""
    extra = padded - tensor.shape[0]
    if extra < 0:
        raise ConversionError(f"vocabulary of {tensor.shape[0]} rows is larger than the padded size {padded}")
    return tensor if extra == 0 else torch.cat([tensor, tensor.new_zeros(extra, *tensor.shape[1:])], dim=0)


def _tp_layout(mcore_name: str) -> str:
    """How a Megatron parameter is split over tensor-parallel ranks."""
    if mcore_name.endswith("linear_fc1.weight"):
        return "gate_up"
    if mcore_name.endswith(("linear_qkv.weight", "linear_qkv.bias")) or is_vocab_parallel(mcore_name):
        return "rows"
    if mcore_name.endswith("linear_proj.weight") or mcore_name.endswith("linear_fc2.weight"):
        return "cols"
    return "replicated"


def check_tp(spec: ModelSpec, tp_size: int) -> None:
    problems = []
    sizes = [("num_key_value_heads", spec.num_kv_heads), ("num_attention_heads", spec.num_heads)]
    sizes.append(("moe_intermediate_size", spec.moe_ffn_hidden_size) if spec.is_moe
                 else ("intermediate_size", spec.ffn_hidden_size))
    for what, value in sizes:
        if value % tp_size:
            problems.append(f"{what} {value}")
    if problems:
        raise ConversionError(f"tensor_parallel={tp_size} does not divide " + ", ".join(problems))


def shard_tp(mcore_name: str, full: torch.Tensor, tp_size: int) -> list[torch.Tensor]:
    """The ``tp_size`` shards of a full Megatron tensor (replicated tensors: the same tensor each time).
    Vocabulary-parallel tensors must already be padded to a multiple of ``tp_size``."""
    layout = _tp_layout(mcore_name)
    if layout == "replicated" or tp_size == 1:
        return [full] * tp_size
    if layout == "rows":
        return list(torch.chunk(full, tp_size, dim=0))
    if layout == "cols":
        return list(torch.chunk(full, tp_size, dim=1))
    gate, up = torch.chunk(full, 2, dim=0)
    return [torch.cat(pair, dim=0) for pair in zip(torch.chunk(gate, tp_size), torch.chunk(up, tp_size))]


def merge_tp(mcore_name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of ``shard_tp``."""
    layout = _tp_layout(mcore_name)
    if layout == "replicated" or len(shards) == 1:
        return shards[0]
    if layout == "rows":
        return torch.cat(shards, dim=0)
    if layout == "cols":
        return torch.cat(shards, dim=1)
    halves = [torch.chunk(s, 2, dim=0) for s in shards]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)


def tp_partition_dim(mcore_name: str) -> int | None:
    """The dimension along which shards are concatenated for a gather (None when replicated; the fused
    gate/up tensor gathers along 0 and is then re-ordered by ``merge_tp``)."""
    layout = _tp_layout(mcore_name)
    return {"rows": 0, "gate_up": 0, "cols": 1}.get(layout)


# --- expert parallelism --------------------------------------------------------------------------------------
def check_ep(spec: ModelSpec, ep_size: int) -> None:
    if ep_size > 1 and not spec.is_moe:
        raise ConversionError(f"expert_parallel={ep_size} needs a mixture-of-experts model ({spec.family} has no "
                              "experts)")
    if spec.is_moe and spec.num_experts % ep_size:
        raise ConversionError(f"expert_parallel={ep_size} does not divide num_experts={spec.num_experts}")


def expert_of(mcore_name: str) -> int | None:
    """The expert index of an expert's parameter (None for every other parameter)."""
    match = _LAYER_RE.match(mcore_name)
    expert = _EXPERT_RE.match(match.group(2)) if match else None
    return int(expert.group(1)) if expert else None


def renumber_expert(mcore_name: str, offset: int) -> str:
    """``...local_experts.<e>...`` -> ``...local_experts.<e + offset>...`` (other names unchanged): a rank's
    local expert names to the global ones (offset ``ep_rank * experts_per_rank``) or back (its negative)."""
    e = expert_of(mcore_name)
    if e is None:
        return mcore_name
    return mcore_name.replace(f".local_experts.{e}.", f".local_experts.{e + offset}.", 1)


def ep_owner(spec: ModelSpec, mcore_name: str, ep_size: int) -> int | None:
    """The expert-parallel rank holding an expert's parameter (None: every rank holds it)."""
    e = expert_of(mcore_name)
    return None if e is None else e // (spec.num_experts // ep_size)


def shard_ep(state: Mapping[str, torch.Tensor], spec: ModelSpec, ep_size: int) -> list[dict[str, torch.Tensor]]:
    """A full Megatron state dict -> each expert-parallel rank's: the shared parameters, and its block of
    experts under local names."""
    check_ep(spec, ep_size)
    per_rank = spec.num_experts // max(1, ep_size) if spec.is_moe else 0
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(ep_size)]
    for name, tensor in state.items():
        owner = ep_owner(spec, name, ep_size)
        for rank in range(ep_size) if owner is None else (owner,):
            shards[rank][renumber_expert(name, -rank * per_rank)] = tensor
    return shards


def merge_ep(shards: list[Mapping[str, torch.Tensor]], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Inverse of ``shard_ep`` (the shared parameters are taken from rank 0)."""
    per_rank = spec.num_experts // len(shards) if spec.is_moe else 0
    out: dict[str, torch.Tensor] = {}
    for rank, shard in enumerate(shards):
        for name, tensor in shard.items():
            if expert_of(name) is not None:
                out[renumber_expert(name, rank * per_rank)] = tensor
            elif rank == 0:
                out[name] = tensor
    return out


def local_to_global_layer(name: str, offset: int) -> str:
    """``decoder.layers.<local>.x`` of a pipeline stage -> ``decoder.layers.<local+offset>.x``."""
    match = _LAYER_RE.match(name)
    return name if not match else f"decoder.layers.{int(match.group(1)) + offset}.{match.group(2)}"


def global_layer(name: str) -> int | None:
    match = _LAYER_RE.match(name)
    return int(match.group(1)) if match else None


# --- HF checkpoint directories ------------------------------------------------------------------------------
class HFCheckpoint:
    """Lazy tensor access to an HF checkpoint folder (safetensors, sharded or not; ``pytorch_model.bin``)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        config_file = self.path / "config.json"
        if not config_file.is_file():
            raise ConversionError(f"{self.path} has no config.json")
        self.config: dict[str, Any] = json.loads(config_file.read_text())
        self.spec = ModelSpec.from_hf_config(self.config)
        self._index: dict[str, Path] = {}
        self._bin: dict[str, torch.Tensor] | None = None
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._index = {name: self.path / file for name, file in weight_map.items()}
        elif (self.path / "model.safetensors").is_file():
            from safetensors import safe_open

            with safe_open(str(self.path / "model.safetensors"), framework="pt") as f:
                self._index = {name: self.path / "model.safetensors" for name in f.keys()}
        elif (self.path / "pytorch_model.bin").is_file():
            self._bin = torch.load(self.path / "pytorch_model.bin", map_location="cpu", weights_only=True)
        else:
            raise ConversionError(f"{self.path} has no model.safetensors(.index.json) or pytorch_model.bin")

    def names(self) -> list[str]:
        return list(self._bin) if self._bin is not None else list(self._index)

    def get(self, name: str) -> torch.Tensor:
        """One tensor; a tied checkpoint that stores only one of embed/lm_head answers for both."""
        if self._bin is not None:
            if name not in self._bin and name == "lm_head.weight" and self.spec.tie_embeddings:
                name = "model.embed_tokens.weight"
            return self._bin[name]
        if name not in self._index:
            raise ConversionError(f"{self.path} has no tensor '{name}'")
        from safetensors import safe_open

        with safe_open(str(self._index[name]), framework="pt") as f:
            return f.get_tensor(name)

    def mcore_tensor(self, mcore_name: str) -> torch.Tensor:
        """One full Megatron tensor, read from the HF parts it is fused from."""
        return to_mcore(mcore_name, [self.get(n) for n in hf_names_for(mcore_name)], self.spec)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: self.get(name) for name in self.names()}


def load_hf_as_mcore(path: str | Path) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """An HF checkpoint folder -> (spec, full Megatron state dict)."""
    ckpt = HFCheckpoint(path)
    return ckpt.spec, {name: ckpt.mcore_tensor(name) for name in mcore_names(ckpt.spec)}


def write_hf_checkpoint(out_dir: str | Path, hf_tensors: Iterable[tuple[str, torch.Tensor]],
                        source_dir: str | Path | None = None, shard_bytes: int = 4 << 30) -> Path:
    """Write HF-named tensors as safetensors shards (+ index when sharded) into ``out_dir``; the config and
    tokenizer files of ``source_dir`` are copied alongside, so the folder loads with ``from_pretrained``."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in hf_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if size and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.detach().cpu().contiguous()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / file), metadata={"format": "pt"})
            weight_map.update({name: file for name in shard})
        index = {"metadata": {}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    if source_dir is not None:
        for file in _SIDE_FILES:
            src = Path(source_dir) / file
            if src.is_file() and src.resolve() != (out / file).resolve():
                shutil.copyfile(src, out / file)
    return out


def save_mcore_as_hf(mcore_state: Mapping[str, torch.Tensor], spec: ModelSpec, out_dir: str | Path,
                     source_dir: str | Path | None = None) -> Path:
    """A full Megatron state dict -> an HF checkpoint folder."""
    return write_hf_checkpoint(out_dir, mcore_to_hf(mcore_state, spec).items(), source_dir)

