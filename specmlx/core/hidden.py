"""The hidden-state seam: a target pass hands back its hidden states, not only its logits.

A drafter that reads the target's features (an MTP head, an EAGLE-3 head, a DFlash block
drafter) needs the hidden state at every position a verify pass computed. The
tap records them as the pass runs: while a ``with tap:`` block is open, each module that
makes them is, as that one instance, of a one-line subclass whose call keeps a reference to
its output; the block's end gives the instance its own class back. Nothing else in the
process changes (no class, no library function, no other model), nothing extra is computed
or read back (the arrays stay lazy until the round's one host sync), the model's parameter
tree is unchanged (loading, quantization and sharding see the same model), and no family's
forward is copied.

Where: "final" is the text model's output, after its final norm (what the LM head reads; the
MTP references, vLLM's and SGLang's, feed this to the head). An int i is the output of
decoder layer i, the residual stream: EAGLE-3 concatenates three of these (by default layers
2, L/2 and L-3, taken before those layers run, so i - 1 here), DFlash several more, each then
projected to the draft's width by its own fc. A drafter reading several places gets them
side by side (``features``: concatenated on the last axis, in the order it asked).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn

from ..errors import BadInput

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


class HiddenTap:
    """The hidden states of a model's passes at the places in ``at`` ("final" or a decoder
    layer index). After ``with tap: model(x, cache=...)``, ``last[i]`` is that pass's
    (B, L, H) output at ``at[i]``, lazy. Outside the block the model runs as it always does.

    model: an mlx-lm model; at: where to read (default: the final hidden state)."""

    def __init__(self, model: nn.Module, at: Sequence[Where] = ("final",)):
        self.at = tuple(at)
        self.last: list[mx.array | None] = [None] * len(self.at)
        inner = text_model(model)
        layers = getattr(inner, "layers", None)
        # (the instance, its own class, the subclass it takes inside the block)
        self._swaps: list[tuple[nn.Module, type, type]] = []
        for slot, where in enumerate(self.at):
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
            if any(m is module for m, _, _ in self._swaps):
                raise BadInput(f"{where!r} is tapped twice")
            self._swaps.append((module, type(module), self._tapped(type(module), slot)))

    def _tapped(self, cls: type, slot: int) -> type:
        """``cls`` whose call also keeps its output in ``last[slot]``."""
        last = self.last

        def __call__(module, *args, **kwargs):
            out = cls.__call__(module, *args, **kwargs)
            last[slot] = out
            return out

        return type(f"Tapped{cls.__name__}", (cls,), {"__call__": __call__})

    def __enter__(self) -> HiddenTap:
        for module, own, _ in self._swaps:
            if type(module) is not own:  # another tap's block is open on the same module
                raise BadInput(f"a {own.__name__}'s output is read by two taps at once")
        for module, _, tapped in self._swaps:
            module.__class__ = tapped
        return self

    def __exit__(self, *exc) -> None:
        for module, own, _ in self._swaps:
            module.__class__ = own

    def features(self) -> mx.array:
        """The latest pass's outputs at every tapped place, concatenated on the last axis in
        the order of ``at``: (B, L, sum of their widths)."""
        if any(x is None for x in self.last):
            raise RuntimeError("the tapped model has not run inside the tap yet")
        if len(self.last) == 1:
            return self.last[0]
        return mx.concatenate(self.last, axis=-1)

    def final(self) -> mx.array:
        """The first tapped place's output of the latest pass, (B, L, H)."""
        if self.last[0] is None:
            raise RuntimeError("the tapped model has not run inside the tap yet")
        return self.last[0]
