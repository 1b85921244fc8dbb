"""The widths of a pair's vocabularies: how many logits a model makes, and which ids a
draft may embed and propose (Code Llama 7B has 16 ids more than 34B; a padded embedding
table is wider than the tokenizer)."""

from __future__ import annotations

import weakref

import mlx.core as mx
import mlx.nn as nn

_WIDTHS: dict[int, tuple[weakref.ref, int]] = {}


def logit_width(model: nn.Module) -> int:
    """The width of a model's logits, known from shapes alone: a graph on a dummy input is
    built (never evaluated) once per model object, not once per generation.

    model: an mlx-lm model (anything called as model(tokens (1, L)) -> logits (1, L, V))."""
    hit = _WIDTHS.get(id(model))
    if hit is not None and hit[0]() is model:
        return hit[1]
    width = model(mx.array([[0]], dtype=mx.uint32)).shape[-1]
    _WIDTHS[id(model)] = (weakref.ref(model), width)
    return width


def draft_ids(target: nn.Module, draft: nn.Module, vocab_size: int | None) -> tuple[int, int]:
    """(ids the draft can embed, ids it may propose): the second is the smaller logit width
    unless ``vocab_size`` says fewer.

    target, draft: the pair's models; vocab_size: the ids the pair shares (None: the
    smaller logit width)."""
    width = logit_width(draft)
    embeds = getattr(getattr(draft, "args", None), "vocab_size", None) or width
    if vocab_size is None:
        vocab_size = min(logit_width(target), width)
    return embeds, min(vocab_size, embeds)
