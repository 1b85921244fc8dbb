"""What a head uses of its target without owning it: the target's embedding and LM head.

The MTP and DFlash heads embed with the target's embedding and score with its LM head; the
heads' own parameters never include them (they are the target's, loaded, cast and sharded
with it). ``TargetParts`` holds the two by reference, outside the head's parameter tree."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_5

from ...core.hidden import text_model


def _ties_embedding(text: nn.Module) -> bool:
    # the LM head is the embedding read as a linear layer: tied, or no lm_head of its own
    return getattr(text.args, "tie_word_embeddings", False) or not hasattr(text, "lm_head")


def lm_head(model: nn.Module) -> Callable[[mx.array], mx.array]:
    """The target's hidden -> logits: its own LM head (or tied embeddings), gathered across
    ranks where the head is split."""
    text = getattr(model, "language_model", model)
    inner = text_model(model)
    if _ties_embedding(text):
        return inner.embed_tokens.as_linear
    group = getattr(text, "sharding_group", None)
    if group is None:
        return text.lm_head

    def gathered(h: mx.array) -> mx.array:
        return qwen3_5.gather_last_axis(text.lm_head(h), group)

    return gathered


def lm_head_weight(model: nn.Module) -> mx.array:
    """The target's LM head weight (V, T): its lm_head's, or the embedding's when tied (this
    process's part where the head is split)."""
    text = getattr(model, "language_model", model)
    if _ties_embedding(text):
        return text_model(model).embed_tokens.weight
    return text.lm_head.weight


class TargetParts:
    """The target's embedding and LM head, held by reference: not the head's parameters."""

    def __init__(self, embed: nn.Module, head: Callable[[mx.array], mx.array]):
        self.embed, self.head = embed, head

    @classmethod
    def of(cls, target: nn.Module) -> TargetParts:
        """The parts of ``target`` (an mlx-lm model) a head reads."""
        return cls(text_model(target).embed_tokens, lm_head(target))
