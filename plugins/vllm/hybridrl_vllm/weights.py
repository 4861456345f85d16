"""Weight buckets on their way into vLLM (engine-free).

Trainers export each tensor once: with tied embeddings the shared matrix arrives as
``model.embed_tokens.weight`` only (``named_parameters`` drops the duplicate). vLLM's in-place layerwise
reload processes a layer once all of *its* weights arrived; the output head of a tied model is a layer of its
own (on CPU it keeps a repacked copy of the matrix), so it must receive the matrix under its own name too,
or it keeps computing logits with the old weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridrl.engines import WeightBucket

#: output name -> input name of the tied embedding, the Hugging Face convention for causal LMs.
DEFAULT_TIED = {"lm_head.weight": "model.embed_tokens.weight"}


def tied_aliases(config: Any, override: Mapping[str, str] | None = None) -> dict[str, str]:
    """``{alias: source}`` to add to buckets: empty unless the model ties its word embeddings."""
    if override is not None:
        return dict(override)
    tied = getattr(config, "tie_word_embeddings", False)
    text = getattr(config, "get_text_config", None)
    if callable(text):
        tied = getattr(text(), "tie_word_embeddings", tied)
    return dict(DEFAULT_TIED) if tied else {}


def with_aliases(bucket: WeightBucket, aliases: Mapping[str, str]) -> WeightBucket:
    """The bucket plus ``(alias, tensor)`` for every source it holds whose alias it does not hold (the same
    tensor object: no copy)."""
    if not aliases:
        return list(bucket)
    names = {name for name, _ in bucket}
    extra = [(alias, tensor) for name, tensor in bucket for alias, source in aliases.items()
             if name == source and alias not in names]
    return [*bucket, *extra]
