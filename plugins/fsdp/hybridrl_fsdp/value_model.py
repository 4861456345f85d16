"""Model heads for the critic and reward-model roles, as plain ``nn.Module`` roots that FSDP2 can shard.

* ``ValueModel``: a causal LM's backbone (``AutoModel``: no LM head) plus ``nn.Linear(hidden, 1)``; one value
  per position. Saved as the backbone's HF checkpoint with ``value_head.safetensors`` beside it; loading a
  plain causal-LM checkpoint (the actor's) gives a fresh head.
* ``SequenceScorer``: wraps an ``AutoModelForSequenceClassification`` (``num_labels=1``) and scores each
  row at its last real token, found from the attention mask (not from the pad id, which may be unset or
  equal to EOS).

Both own their forward, so the FSDP root's hooks gather the embedding/norm/head shards before use.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

VALUE_HEAD_FILE = "value_head.safetensors"


def _quiet_from_pretrained(cls: Any, path: str, **kwargs: Any) -> Any:
    """``from_pretrained`` without the loading bar and the "unused weights" report (a causal-LM checkpoint
    loaded as a backbone always leaves its LM head unused)."""
    from transformers.utils import logging as hf_logging

    bars, level = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        return cls.from_pretrained(path, **kwargs)
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


class ValueModel(nn.Module):
    """Backbone + scalar value head. ``forward`` returns ``(B, T)`` values (fp32), one per position."""

    def __init__(self, backbone: nn.Module) -> None:
        super().__init__()
        self.backbone = backbone
        self.config = backbone.config
        hidden = int(backbone.config.hidden_size)
        self.value_head = nn.Linear(hidden, 1)
        # Small head, zero bias (OpenRLHF's init): the first values are near 0 whatever the backbone says.
        nn.init.normal_(self.value_head.weight, std=1.0 / (hidden + 1))
        nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_pretrained(cls, path: str | Path, **kwargs: Any) -> ValueModel:
        """Backbone from ``path`` (a causal LM or a saved ``ValueModel``); the head from
        ``value_head.safetensors`` when present, else freshly initialised (from the global torch seed)."""
        from transformers import AutoModel

        model = cls(_quiet_from_pretrained(AutoModel, str(path), **kwargs))
        head = Path(path) / VALUE_HEAD_FILE
        if head.is_file():
            from safetensors.torch import load_file

            model.value_head.load_state_dict(load_file(str(head)))
        return model.to(kwargs.get("dtype", torch.float32))

    def save_pretrained(self, path: str | Path) -> None:
        """The backbone as an HF checkpoint plus ``value_head.safetensors`` (``from_pretrained`` reads both)."""
        from safetensors.torch import save_file

        Path(path).mkdir(parents=True, exist_ok=True)
        self.backbone.save_pretrained(str(path))
        save_file({k: v.detach().cpu().contiguous() for k, v in self.value_head.state_dict().items()},
                  str(Path(path) / VALUE_HEAD_FILE))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor,
                keep_last: int | None = None, keep_index: torch.Tensor | None = None, **attention: Any
                ) -> torch.Tensor:
        """Values of every position, of the last ``keep_last`` positions, or of positions ``keep_index`` of
        the sequence dimension (the head is skipped on the others). ``attention``: the packed rows' boundaries
        (``cu_seq_lens_q`` ...), passed to the backbone's attention."""
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=False, **attention).last_hidden_state
        if keep_index is not None:
            hidden = hidden[:, keep_index]
        elif keep_last is not None:
            hidden = hidden[:, -keep_last:]
        return self.value_head(hidden).squeeze(-1).to(torch.float32, copy=True)  # a copy: FSDP hooks dislike views

    def gradient_checkpointing_enable(self, **kwargs: Any) -> None:
        self.backbone.gradient_checkpointing_enable(**kwargs)

    @property
    def is_gradient_checkpointing(self) -> bool:
        return bool(getattr(self.backbone, "is_gradient_checkpointing", False))


class SequenceScorer(nn.Module):
    """A sequence-classification model scoring each row at its last attended token; ``forward`` -> (B,)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        if not isinstance(getattr(model, "score", None), nn.Module):
            raise TypeError(f"{type(model).__name__} has no 'score' head; the reward model must be an "
                            "AutoModelForSequenceClassification of a decoder (Qwen2, Llama ...)")
        self.model = model
        self.config = model.config

    @classmethod
    def from_pretrained(cls, path: str | Path, **kwargs: Any) -> SequenceScorer:
        from transformers import AutoModelForSequenceClassification

        model = _quiet_from_pretrained(AutoModelForSequenceClassification, str(path), num_labels=1, **kwargs)
        return cls(model)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor,
                last_index: torch.Tensor | None = None, **attention: Any) -> torch.Tensor:
        """Scores ``(B,)``, of each row's last attended token; packed rows (one sequence, ``attention`` holding
        their boundaries) give ``last_index``, the position of each row's last token."""
        hidden = self.model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                                       position_ids=position_ids, use_cache=False, **attention).last_hidden_state
        if last_index is not None:
            picked = hidden[0, last_index]
        else:
            width = attention_mask.shape[1]
            last = width - 1 - attention_mask.long().flip(1).argmax(dim=1)  # index of the last 1 in each row
            picked = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
        return self.model.score(picked).squeeze(-1).to(torch.float32, copy=True)
