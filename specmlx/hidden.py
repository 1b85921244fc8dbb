"""The hidden-state seam: a target pass hands back its hidden states, not only its logits.

A drafter that reads the target's features (an MTP head today; an EAGLE-3 head or a DFlash
block drafter later) needs the hidden state at every position a verify pass computed. The
tap records them as the pass runs: the module that makes them gets a one-line subclass whose
call keeps a reference to its output. Nothing extra is computed or read back (the arrays stay
lazy until the round's one host sync), the model's parameter tree is unchanged (loading,
quantization and sharding see the same model), and no family's forward is copied.

Where: "final" is the text model's output, after its final norm (what the LM head reads; the
MTP references, vLLM's and SGLang's, feed this to the head). An int i is the output of
decoder layer i, the residual stream: EAGLE-3 concatenates three of these (by default layers
2, L/2 and L-3, taken before those layers run, so i - 1 here), DFlash several more, each then
projected to the draft's width by its own fc. Those two are not built; their drafters would
ask for ``HiddenTap(target, (1, L // 2 - 1, L - 4))`` and read ``last`` the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn

from .errors import BadInput

Where = str | int


def text_model(model: nn.Module) -> nn.Module:
    """The module that embeds tokens and runs the decoder layers (mlx-lm's ``model.model``;
    multimodal wrappers keep it under ``language_model``)."""
    inner = getattr(model, "model", None)
    if inner is None and hasattr(model, "language_model"):
        inner = getattr(model.language_model, "model", None)
    if not isinstance(inner, nn.Module) or not hasattr(inner, "embed_tokens"):
        raise BadInput(
            f"{type(model).__module__} has no text model whose hidden states can be read"
        )
    return inner


def _tapped(cls: type, slot: int) -> type:
    """``cls`` whose call also stores its output in the module's tap, at ``slot``."""

    def __call__(self, *args, **kwargs):
        out = cls.__call__(self, *args, **kwargs)
        self._specmlx_tap.last[slot] = out
        return out

    return type(f"Tapped{cls.__name__}", (cls,), {"__call__": __call__})


class HiddenTap:
    """The hidden states of a model's latest pass at the places in ``at`` ("final" or a
    decoder layer index). After ``model(x, cache=...)``, ``last[i]`` is the (B, L, H) output
    at ``at[i]``, lazy. One tap per model: asking again returns the one already there.

    model: an mlx-lm model; at: where to read (default: the final hidden state)."""

    def __new__(cls, model: nn.Module, at: Sequence[Where] = ("final",)):
        at = tuple(at)
        inner = text_model(model)
        old = getattr(inner, "_specmlx_tap", None)
        if old is not None and old.at == at:
            return old
        if old is not None:
            raise BadInput(f"the model's hidden states are already read at {old.at}, not {at}")
        tap = super().__new__(cls)
        tap.at, tap.last = at, [None] * len(at)
        layers = getattr(inner, "layers", None)
        for slot, where in enumerate(at):
            if where == "final":
                module = inner
            elif (
                isinstance(where, int)
                and layers is not None
                and -len(layers) <= where < len(layers)
            ):
                module = layers[where]
            else:
                raise BadInput(f"no hidden state at {where!r} in {type(model).__module__}")
            if isinstance(getattr(module, "_specmlx_tap", None), HiddenTap):
                raise BadInput(f"{where!r} is tapped twice")
            module.__class__ = _tapped(type(module), slot)
            module._specmlx_tap = tap  # a plain attribute: not a parameter
        return tap

    def __init__(self, model: nn.Module, at: Sequence[Where] = ("final",)):
        pass  # set up in __new__ (one tap per model)

    def final(self) -> mx.array:
        """The first tapped place's output of the latest pass, (B, L, H)."""
        if self.last[0] is None:
            raise RuntimeError("the tapped model has not run yet")
        return self.last[0]
