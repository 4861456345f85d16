"""The shape of a decoder-only transformer, read from its HF ``config.json`` or the tiny model's settings.

Memory, FLOPs and the plan's advice all depend on these few sizes; a mixture-of-experts model also on its
experts per layer and per token. Reading a shape never imports a backend (transformers only for its config
defaults) and never allocates a weight.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridrl.config import RunConfig
from hybridrl.errors import HybridRLError


class MemoryEstimateError(HybridRLError, ValueError):
    """The model config cannot be read or describes an architecture the estimate does not cover."""


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer that memory and FLOPs depend on. A mixture-of-experts model
    (``num_experts`` > 0) has routed experts of width ``moe_intermediate_size`` in every layer's MLP (and a
    shared expert where ``shared_expert_intermediate_size`` is set): its weights count every expert
    (``param_count``), its compute and activations the ``experts_per_token`` a token is routed to
    (``active_param_count``, ``token_intermediate``)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head's queries and keys
    max_positions: int | None = None  # the context length the model was made for (max_position_embeddings)
    num_experts: int = 0  # routed experts per layer; 0: a dense MLP of ``intermediate_size``
    experts_per_token: int = 0  # top-k of the router
    moe_intermediate_size: int = 0  # one expert's MLP width
    shared_expert_intermediate_size: int = 0  # an always-on shared expert (Qwen2-MoE), 0: none

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def token_intermediate(self) -> int:
        """The MLP width one token runs through: the dense width, or its top-k experts' (and the shared one)."""
        if not self.is_moe:
            return self.intermediate_size
        return self.experts_per_token * self.moe_intermediate_size + self.shared_expert_intermediate_size

    def _mlp_params(self, experts: int) -> int:
        h = self.hidden_size
        if not self.is_moe:
            return 3 * h * self.intermediate_size + (2 * self.intermediate_size + h if self.mlp_bias else 0)
        shared = 3 * h * self.shared_expert_intermediate_size + (h if self.shared_expert_intermediate_size else 0)
        return experts * 3 * h * self.moe_intermediate_size + self.num_experts * h + shared  # + the router

    @property
    def active_layer_params(self) -> int:
        """``layer_params`` with only a token's top-k experts (what one token's forward multiplies by)."""
        return self.layer_params - self._mlp_params(self.num_experts) + self._mlp_params(self.experts_per_token)

    def active_param_count(self) -> int:
        """Parameters one token's forward uses (all of them for a dense model)."""
        return self.num_layers * self.active_layer_params + self.root_params

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        h, q, kv = self.hidden_size, self.q_dim, self.kv_dim
        attn = h * q + 2 * h * kv + q * h
        if self.qkv_bias:
            attn += q + 2 * kv
        if self.o_bias:
            attn += h
        if self.qk_norm:
            attn += 2 * self.head_dim
        mlp = self._mlp_params(self.num_experts)
        return attn + mlp + 2 * h  # two RMSNorms

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def root_params(self) -> int:
        """Parameters outside the decoder layers: embeddings, LM head (when untied), final norm."""
        return self.embedding_params * (1 if self.tie_word_embeddings else 2) + self.hidden_size

    def param_count(self) -> int:
        return self.num_layers * self.layer_params + self.root_params

    @property
    def layer_tensors(self) -> int:
        """Parameter tensors of one decoder layer (a Hugging Face layer's ``named_parameters``): q, k, v, o and
        their biases, the MLP's three projections (an MoE layer: the router, the experts' fused ``gate_up_proj``
        and ``down_proj``, a shared expert's three and its gate), the norms."""
        attn = 4 + (3 if self.qkv_bias else 0) + (1 if self.o_bias else 0) + (2 if self.qk_norm else 0)
        if not self.is_moe:
            mlp = 3 * (2 if self.mlp_bias else 1)
        else:
            mlp = 1 + 2 + (4 if self.shared_expert_intermediate_size else 0)
        return attn + mlp + 2

    def tensor_count(self) -> int:
        """Parameter tensors of the model: the layers', the embeddings, the final norm and an untied head (a weight
        export gathers each of them on its own)."""
        return self.num_layers * self.layer_tensors + 2 + (0 if self.tie_word_embeddings else 1)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.kv_dim * dtype_bytes

    def saved_bytes_per_token_layer(self, compute_bytes: int, fused: bool = False) -> int:
        """Bytes one decoder layer keeps for backward per token, counted on a real Qwen2 layer (SDPA with
        grouped-query attention, no padding mask): each RMSNorm keeps its fp32 input, the rsqrt and the
        normalised value in the compute dtype; the attention and MLP input projections keep their input; the
        attention keeps rotated q/k, v, its output and the fp32 log-sum-exp per head; the MLP keeps gate, up,
        act(gate) and their product. Exact for bf16 (13608 bytes per token for hidden 256, intermediate 1024,
        8 heads, 2 KV heads), and for fp32, where the dtype casts are no-ops. ``fused`` (the FSDP backend's
        ``fused_kernels``): each RMSNorm keeps its input and the fp32 rsqrt per row, the MLP gate and up only
        (its product is the down projection's input)."""
        h, q, kv, i, cb = self.hidden_size, self.q_dim, self.kv_dim, self.token_intermediate, compute_bytes
        routing = self.routing_bytes_per_token(cb)
        if fused:  # the fused SwiGLU covers a dense MLP (and a shared expert), not transformers' routed experts
            routed = self.experts_per_token * self.moe_intermediate_size if self.is_moe else 0
            return (2 * (cb * h + 4) + 2 * cb * h + cb * (2 * q + 2 * kv) + 4 * self.num_heads + 3 * cb * i
                    + cb * routed + routing)
        norm = 4 * h + 4 + (4 * h if cb == 4 else cb * h)  # fp32 input (the cast is a no-op in fp32), rsqrt, normalised
        return 2 * norm + 2 * cb * h + cb * (2 * q + 2 * kv) + 4 * self.num_heads + 4 * cb * i + routing

    def routing_bytes_per_token(self, compute_bytes: int) -> int:
        """What an MoE layer keeps per token beyond its experts' MLPs: the router's logits and fp32
        probabilities, and for each of the top-k experts the token's gathered input, the expert's output (the
        routing weight's gradient needs it) and the weighted output."""
        if not self.is_moe:
            return 0
        return (compute_bytes + 4) * self.num_experts + 3 * self.experts_per_token * compute_bytes * self.hidden_size

    def forward_bytes_per_token_layer(self, compute_bytes: int) -> int:
        """Peak transient bytes per token inside one layer of a forward without autograd (residual stream,
        the fp32 norm, q/k/v and the attention output, the MLP's gate, up and product)."""
        h, q, kv, i, cb = self.hidden_size, self.q_dim, self.kv_dim, self.token_intermediate, compute_bytes
        return 4 * h + cb * (3 * h + 2 * q + 2 * kv + 3 * i) + self.routing_bytes_per_token(cb)

    def backward_bytes_per_token_layer(self, compute_bytes: int) -> int:
        """Transient bytes per token while one layer runs its backward (gradients of the MLP intermediates and
        of the residual stream)."""
        return compute_bytes * (3 * self.token_intermediate + 2 * self.hidden_size)

    def describe(self) -> str:
        def size(n: int) -> str:
            return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"

        if self.is_moe:
            return (f"{self.model_type} {size(self.param_count())} parameters ({size(self.active_param_count())} "
                    f"active: {self.experts_per_token} of {self.num_experts} experts per token)")
        return f"{self.model_type} {size(self.param_count())} parameters"


def shape_from_hf_config(config: dict[str, Any]) -> ModelShape:
    """``ModelShape`` from a ``config.json`` dict; keys the file leaves out take the transformers class
    defaults (a saved config omits values equal to them)."""
    data = dict(config)
    model_type = str(data.get("model_type", "")).lower()
    try:
        from transformers import AutoConfig

        full = AutoConfig.for_model(model_type, **{k: v for k, v in data.items() if k != "model_type"}).to_dict()
        data = {**full, **data}
    except (ImportError, ValueError, KeyError, TypeError):
        pass  # an unknown model type: use the file's keys as they are
    moe = moe_fields(model_type, data)
    try:
        hidden = int(data["hidden_size"])
        heads = int(data["num_attention_heads"])
        shape = ModelShape(
            model_type=model_type or "unknown",
            vocab_size=int(data["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(data["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(data.get("num_key_value_heads") or heads),
            head_dim=int(data.get("head_dim") or hidden // heads),
            intermediate_size=int(data["intermediate_size"]),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(data.get("attention_bias")),
            o_bias=model_type != "qwen2" and bool(data.get("attention_bias")),
            mlp_bias=bool(data.get("mlp_bias")),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            max_positions=int(data["max_position_embeddings"]) if data.get("max_position_embeddings") else None,
            **moe,
        )
    except KeyError as exc:
        raise MemoryEstimateError(
            f"model config has no {exc.args[0]!r}: not a decoder-only transformer config") from None
    return shape


def moe_fields(model_type: str, data: dict[str, Any]) -> dict[str, int]:
    """The ``ModelShape`` fields of a mixture-of-experts config (none for a dense one); an MoE layout this
    module does not know (``hybridrl.weights.experts.KNOWN_MOE_TYPES``) is a ``MemoryEstimateError``."""
    from hybridrl.weights.experts import expert_count, moe_layout_problem

    problem = moe_layout_problem(data)
    if problem:
        raise MemoryEstimateError(problem)
    experts = expert_count(data)
    if not experts:
        return {}
    return {"num_experts": experts, "experts_per_token": int(data["num_experts_per_tok"]),
            "moe_intermediate_size": int(data["moe_intermediate_size"]),
            "shared_expert_intermediate_size": int(data.get("shared_expert_intermediate_size") or 0)}


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """A ``config.json`` given as the file or its folder."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise MemoryEstimateError(
            f"no model config at '{p}' (give --model-config FILE or a folder holding config.json)")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise MemoryEstimateError(f"'{p}' is not valid JSON: {exc}") from None


def tiny_shape(tiny: Any) -> ModelShape:
    """The shape of the model ``model.tiny`` builds: a tied-embedding Qwen2 over its tokenizer's vocabulary, or with
    ``num_experts`` a Qwen3-MoE with a head of its own (as ``model.tiny.tiny_hf_config`` builds them)."""
    from hybridrl.model.tiny import tiny_tokenizer

    try:
        vocab = len(tiny_tokenizer(tiny))
    except (OSError, ValueError) as exc:
        raise MemoryEstimateError(f"model.tiny.tokenizer: {exc}") from None
    if tiny.num_experts:
        return ModelShape("qwen3_moe", vocab, tiny.hidden_size, tiny.num_layers, tiny.num_heads, tiny.num_kv_heads,
                          tiny.hidden_size // tiny.num_heads, tiny.intermediate_size, tie_word_embeddings=False,
                          qk_norm=True, num_experts=tiny.num_experts, experts_per_token=tiny.experts_per_token,
                          moe_intermediate_size=tiny.expert_size)
    return ModelShape("qwen2", vocab, tiny.hidden_size, tiny.num_layers, tiny.num_heads,
                      tiny.num_kv_heads, tiny.hidden_size // tiny.num_heads, tiny.intermediate_size,
                      tie_word_embeddings=True, qkv_bias=True)


def config_candidates(path: str, base_dirs: Sequence[str | Path]) -> list[Path]:
    """``path`` as given (relative to the working folder, like every path in a config), then under each base."""
    return [Path(path)] + ([] if Path(path).is_absolute() else [Path(b) / path for b in base_dirs])


def model_shape(cfg: RunConfig, model_config: str | Path | None = None, base_dirs: Sequence[str | Path] = ()
                ) -> tuple[ModelShape, str]:
    """The actor's model shape and where it came from: ``model_config`` (file or folder) if given, the tiny
    model's settings, or ``model.path``/config.json (also tried under ``base_dirs``)."""
    if model_config is not None:
        return shape_from_hf_config(read_hf_config(model_config)), str(model_config)
    if cfg.model.tiny is not None:
        return tiny_shape(cfg.model.tiny), "model.tiny"
    assert cfg.model.path is not None
    for candidate in config_candidates(cfg.model.path, base_dirs):
        if (candidate / "config.json").is_file():
            return shape_from_hf_config(read_hf_config(candidate)), str(candidate / "config.json")
    raise MemoryEstimateError(f"model.path '{cfg.model.path}' holds no config.json; give --model-config FILE")
