"""Build a Megatron-core ``GPTModel`` stage for a Llama/Qwen2/Qwen3-MoE checkpoint and fill it from the HF weights.

The local layer spec (plain PyTorch modules, no Transformer Engine) is used on every device: its attention
takes the explicit padding-and-causal mask the engine builds for left-padded prompts. (Transformer Engine's
spec declares a causal-only mask type; using it would need ``padding_causal`` masks, checked on a GPU.)
Every parameter of the stage is named by its *full* Megatron name (``convert.mcore_names``) through
``param_table``; loading, export and checkpoints all go through that table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hybridrl_megatron.convert import (
    VALUE_HEAD_NAMES,
    ConversionError,
    HFCheckpoint,
    ModelSpec,
    check_ep,
    check_tp,
    expert_of,
    global_layer,
    is_vocab_parallel,
    local_to_global_layer,
    mcore_names,
    pad_vocab,
    padded_vocab_size,
    renumber_expert,
    shard_tp,
    tp_partition_dim,
)
from hybridrl_megatron.parallel import Layout
from hybridrl_megatron.settings import MegatronSettings

#: where a critic's value head is kept beside its backbone checkpoint (the FSDP critic's file name).
VALUE_HEAD_FILE = "value_head.safetensors"

@dataclass(frozen=True)
class ParamEntry:
    """One parameter of this stage: its module name, its full Megatron name, and whether it is the last
    stage's copy of a tied embedding (trained in sync with stage 0's, never exported twice)."""

    local_name: str
    name: str
    param: nn.Parameter
    tied_copy: bool = False


def transformer_config(spec: ModelSpec, settings: MegatronSettings, layout: Layout, device: str,
                       dtype: torch.dtype):
    """The ``TransformerConfig`` of ``spec``: fp32 on CPU (no fused kernels, CPU initialisation), ``dtype``
    (bf16/fp16) parameters and compute on CUDA."""
    from megatron.core.transformer import TransformerConfig

    if spec.num_layers % layout.pp:
        raise ConversionError(f"pipeline_parallel={layout.pp} does not divide num_hidden_layers={spec.num_layers}")
    check_tp(spec, layout.tp)
    check_ep(spec, layout.ep)
    params_dtype = dtype if device == "cuda" else torch.float32
    kwargs = {}
    if settings.recompute:
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if spec.is_moe:
        kwargs.update(moe_config(spec, settings, layout))
    return TransformerConfig(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads, kv_channels=spec.head_dim, ffn_hidden_size=spec.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=spec.rms_norm_eps, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=spec.qkv_bias,
        hidden_dropout=0.0, attention_dropout=0.0, attention_softmax_in_fp32=True,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        params_dtype=params_dtype, pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16,
        use_cpu_initialization=device == "cpu", perform_initialization=False,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        **kwargs,
    )


def moe_config(spec: ModelSpec, settings: MegatronSettings, layout: Layout) -> dict:
    """``TransformerConfig`` keys of a mixture-of-experts model. The router: top-k of the logits, then a softmax
    over the k (the same weights as a softmax over all experts renormalised over the top k: Qwen3-MoE's
    ``norm_topk_prob``); without renormalisation, the softmax over all experts first. Tokens reach their experts
    through the all-gather dispatcher; the load-balancing loss is Megatron's ``aux_loss``, weighted by
    ``options.moe_aux_loss_coef`` (default: the checkpoint's ``router_aux_loss_coef``)."""
    coef = settings.moe_aux_loss_coef if settings.moe_aux_loss_coef is not None else spec.router_aux_loss_coef
    return dict(num_moe_experts=spec.num_experts, moe_router_topk=spec.experts_per_token,
                moe_ffn_hidden_size=spec.moe_ffn_hidden_size, moe_router_pre_softmax=not spec.norm_topk_prob,
                moe_router_load_balancing_type="aux_loss" if coef > 0 else "none", moe_aux_loss_coeff=coef,
                moe_token_dispatcher_type="allgather", moe_grouped_gemm=False, moe_router_dtype="fp32",
                expert_model_parallel_size=layout.ep, qk_layernorm=spec.qk_norm)


class ValueHead(nn.Module):
    """A critic's scalar head in the place of the last stage's output layer: ``GPTModel`` calls
    ``output_layer(hidden, weight=..., runtime_gather_output=...)`` and takes ``(out, bias)``; this returns one
    value per position, ``(s, b, 1)``. Replicated over tensor-parallel ranks (the hidden states are)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, hidden_size, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(1, dtype=dtype, device=device))

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        return F.linear(hidden, self.weight, self.bias), None


def build_gpt(spec: ModelSpec, config, layout: Layout, settings: MegatronSettings, head: str = "lm") -> nn.Module:
    """This rank's stage of the model (weights uninitialised: ``load_hf_weights`` fills them). ``head="value"``
    (critic): no tied LM head, and the last stage's output layer is a ``ValueHead``."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    kwargs = {}
    if spec.rope_scaling_factor is not None:
        kwargs.update(rope_scaling=True, rope_scaling_factor=spec.rope_scaling_factor)
    if spec.rope_linear_factor is not None:
        kwargs["seq_len_interpolation_factor"] = spec.rope_linear_factor
    theta = spec.rope_theta
    model = GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(
            normalization="RMSNorm", num_experts=spec.num_experts or None, moe_grouped_gemm=False,
            qk_layernorm=spec.qk_norm),
        vocab_size=padded_vocab_size(spec.vocab_size, layout.tp, settings.vocab_multiple),
        max_sequence_length=spec.max_position_embeddings, pre_process=layout.first_stage,
        post_process=layout.last_stage, parallel_output=True,
        share_embeddings_and_output_weights=spec.tie_embeddings and head == "lm", position_embedding_type="rope",
        rotary_percent=1.0, rotary_base=int(theta) if float(theta).is_integer() else theta, **kwargs,
    )
    if not config.use_cpu_initialization:
        _to_device_dtype(model, config.params_dtype)
    if head == "value" and layout.last_stage:
        lm_head = model.output_layer.weight
        model.output_layer = ValueHead(spec.hidden_size, lm_head.dtype, lm_head.device)
    return model


def _to_device_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """On the GPU Megatron's own layers allocate their weights there in ``params_dtype``, but the local spec's
    norms are plain torch modules built on the CPU in fp32; Megatron's training scripts fix this with
    ``model.cuda()`` and ``Float16Module``. Do the same for the parameters (buffers such as rotary
    frequencies move but keep their dtype)."""
    model.cuda(torch.cuda.current_device())
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)


def stage_layers(spec: ModelSpec, layout: Layout, stage: int) -> range:
    """Global indices of the decoder layers of pipeline ``stage`` (Megatron's even split)."""
    per_stage = spec.num_layers // layout.pp
    return range(stage * per_stage, (stage + 1) * per_stage)


def ep_experts(spec: ModelSpec, layout: Layout, ep_rank: int) -> range:
    """Global indices of the experts expert-parallel rank ``ep_rank`` holds (a contiguous block)."""
    per_rank = spec.num_experts // layout.ep
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


def stage_names(spec: ModelSpec, layout: Layout, stage: int, head: str = "lm", ep_rank: int | None = None
                ) -> list[str]:
    """The full Megatron names a pipeline stage exports (tied copies excluded), in ``mcore_names`` order; a
    critic's last stage ends with the value head instead of an output layer. ``ep_rank``: only that
    expert-parallel rank's experts (None: every expert)."""
    layers = stage_layers(spec, layout, stage)
    names = []
    full = [n for n in mcore_names(spec) if head == "lm" or n != "output_layer.weight"]
    if head == "value":
        full += list(VALUE_HEAD_NAMES)
    for name in full:
        layer = global_layer(name)
        if layer is not None:
            keep = layer in layers
        elif name == "embedding.word_embeddings.weight":
            keep = stage == 0
        else:  # final norm, untied output layer or value head
            keep = stage == layout.pp - 1
        expert = expert_of(name)
        if keep and (expert is None or ep_rank is None or expert in ep_experts(spec, layout, ep_rank)):
            names.append(name)
    return names


def param_table(model: nn.Module, spec: ModelSpec, layout: Layout, head: str = "lm") -> list[ParamEntry]:
    """Every parameter of this stage with its full Megatron name (checked against the expected set)."""
    layers = getattr(getattr(model, "decoder", None), "layers", [])
    offset = layers[0].layer_number - 1 if len(layers) else 0
    expected = stage_layers(spec, layout, layout.pp_rank)
    if len(layers) != len(expected) or offset != expected.start:
        raise RuntimeError(f"stage {layout.pp_rank} holds layers from {offset} ({len(layers)} of them), expected "
                           f"{expected.start}..{expected.stop - 1}")
    table = []
    for local_name, param in model.named_parameters():
        name = renumber_expert(local_to_global_layer(local_name, offset), ep_experts(spec, layout, layout.ep_rank).start
                               if spec.is_moe else 0)
        if head == "value" and name.startswith("output_layer."):
            name = "value_head." + name.removeprefix("output_layer.")
        tied_copy = name == "output_layer.weight" and spec.tie_embeddings
        if tied_copy:
            name = "embedding.word_embeddings.weight"
        table.append(ParamEntry(local_name, name, param, tied_copy))
    _mark_tensor_parallel(table)
    owned = {e.name for e in table if not e.tied_copy}
    want = set(stage_names(spec, layout, layout.pp_rank, head, ep_rank=layout.ep_rank))
    if owned != want:
        raise RuntimeError(f"stage {layout.pp_rank} parameters do not match the checkpoint: missing "
                           f"{sorted(want - owned)[:5]}, unexpected {sorted(owned - want)[:5]}")
    return table


def _mark_tensor_parallel(table: list[ParamEntry]) -> None:
    """Megatron's linear layers and embedding set ``tensor_model_parallel``/``partition_dim`` only inside their
    weight initialisation, which ``perform_initialization=False`` skips (the weights come from the checkpoint).
    Gradient norms, DDP and checkpoints read them, so they are set here from the conversion's split rule."""
    for entry in table:
        if hasattr(entry.param, "tensor_model_parallel"):
            continue
        dim = tp_partition_dim(entry.name)
        entry.param.tensor_model_parallel = dim is not None
        entry.param.partition_dim = -1 if dim is None else dim
        entry.param.partition_stride = 1


def local_shard(name: str, full: torch.Tensor, spec: ModelSpec, layout: Layout, padded_vocab: int) -> torch.Tensor:
    """This rank's tensor-parallel shard of a full Megatron tensor (vocabulary padded first)."""
    if is_vocab_parallel(name):
        full = pad_vocab(full, padded_vocab)
    return shard_tp(name, full, layout.tp)[layout.tp_rank]


@torch.no_grad()
def load_hf_weights(table: list[ParamEntry], ckpt: HFCheckpoint, layout: Layout, padded_vocab: int,
                    seed: int = 0) -> None:
    """Copy every parameter of the stage from the HF checkpoint (each rank reads only what it holds). A
    value head comes from ``value_head.safetensors`` beside the checkpoint, else it is initialised like the
    FSDP critic's (normal, std 1/(hidden+1), zero bias) from ``seed``, identically on every rank."""
    for entry in table:
        if entry.name in VALUE_HEAD_NAMES:
            entry.param.data.copy_(_value_head_tensor(entry.name, ckpt, seed))
            continue
        shard = local_shard(entry.name, ckpt.mcore_tensor(entry.name), ckpt.spec, layout, padded_vocab)
        if shard.shape != entry.param.shape:
            raise ConversionError(f"'{entry.name}': converted shard {tuple(shard.shape)} does not fit the "
                                  f"model's {tuple(entry.param.shape)}")
        entry.param.data.copy_(shard)


def _value_head_tensor(name: str, ckpt: HFCheckpoint, seed: int) -> torch.Tensor:
    saved = ckpt.path / VALUE_HEAD_FILE
    if saved.is_file():
        from safetensors.torch import load_file

        return load_file(str(saved))[name.removeprefix("value_head.")]
    hidden = ckpt.spec.hidden_size
    if name.endswith("bias"):
        return torch.zeros(1)
    return torch.randn(1, hidden, generator=torch.Generator().manual_seed(seed)) / (hidden + 1)
