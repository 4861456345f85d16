"""A model's signature: the scalar entries of its HF config and every parameter's shape, built on the meta
device (no memory, a second for a 70B model). A checkpoint records its trained roles' signatures, and a resume
whose model would not load it is refused by them before anything is written."""

from __future__ import annotations

from typing import Any

#: config entries that say nothing about the weights' shapes (left out of the recorded config).
_NOT_SHAPE = ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "architectures", "id2label",
              "label2id", "bos_token_id", "eos_token_id", "pad_token_id")


def model_signature(config: Any) -> dict[str, Any]:
    """``{"config": scalar entries of the HF config, "shapes": parameter name -> shape}`` of the causal LM that
    ``config`` builds, on the meta device (no memory, a second for a 70B model)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {name: list(t.shape) for name, t in model.state_dict().items()}
    scalars = {k: v for k, v in sorted(config.to_dict().items())
               if k not in _NOT_SHAPE and isinstance(v, (int, float, str, bool)) and v is not None}
    return {"config": scalars, "shapes": shapes}
