"""Recurrent state after a kept prefix, without running the target again.

A verify pass advances each recurrent layer over the k + 1 tokens it checks; a rollback needs
the state after the first m of them. The generic way (engine + caches.restore) restores the
round's starting state and feeds the m kept tokens through the whole target again: a second
pass, about one decode step. For the mixers below, the pass is recorded instead at two seams
of mlx-lm's own code, and the state after m tokens is recomputed from what was recorded:

- the mixer's Conv1d, whose input is the whole padded sequence (the conv state, then the new
  inputs, (B, K - 1 + S, C)): the conv state after m tokens is its rows m .. m + K - 2;
- the recurrence, a module-level function of the mixer's mlx-lm module (gated_delta_update
  for gated delta nets, ssm_update for Mamba 2 style SSMs): called again on the first m steps
  of the same inputs, from the round's starting state, it returns the state after them. Only
  the recurrence runs again; no projection weight is read a second time.

No math is copied from mlx-lm: its functions are called on slices of their own inputs.
Nothing is patched for the process either: while ``recording`` is open, each of this model's
Conv1d instances and mixer instances takes, as that one instance, a subclass that records (a
mixer's methods that call the recurrence are the same code run over a copy of its module's
globals in which the name is the recorder); the block's end gives each its own class back.
Another model in the same process, or this one outside the block, runs mlx-lm's code as is.
Layouts, per mlx-lm module defining the mixer (0.32; each has cache[0] = conv state and
cache[1] = recurrent state, one Conv1d named conv1d and one recurrence call per layer):
qwen3_next, qwen3_5 (gated delta); mamba2, nemotron_h, falcon_h1, granitemoehybrid (SSM).
Any other recurrent family (Jamba's Mamba 1, LFM2's short convolutions, RWKV-7, Kimi
Linear's three convolutions, ...) rolls back by the generic replay; the family matrix in
tests/test_families.py checks both ways token for token.
"""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache

__all__ = ["PassRecorder"]

# the recurrence function's name -> its arguments with a time axis (axis 1)
RECURRENCES = {
    "gated_delta_update": ("q", "k", "v", "a", "b", "mask"),
    "ssm_update": ("hidden_states", "B", "C", "dt", "mask"),
}
# the recurrences that read a batch's row ends from ``lengths`` as well as the mask: a gated
# delta net keeps a row's state through its masked steps, but an SSM's mask only stops the
# decay of the state it started from (the masked steps' inputs still count): it takes the
# state at each row's length from ``lengths``
ROW_LENGTHS = {"ssm_update"}
# mlx-lm modules whose mixers follow the layout above, and the recurrence each calls
LAYOUTS = {
    "mlx_lm.models.qwen3_next": "gated_delta_update",
    "mlx_lm.models.qwen3_5": "gated_delta_update",
    "mlx_lm.models.mamba2": "ssm_update",
    "mlx_lm.models.nemotron_h": "ssm_update",
    "mlx_lm.models.falcon_h1": "ssm_update",
    "mlx_lm.models.granitemoehybrid": "ssm_update",
}


class PassRecorder:
    """Records one target pass's recurrent mixers (their Conv1d inputs and recurrence calls)
    so ``settle`` can set each recurrent layer to its state after the first m tokens.

    model: the target; layers: its recurrent layer caches (ArraysCache), in layer order.
    ``supported`` is False when some mixer does not follow a known layout: the engine then
    replays the kept tokens instead."""

    def __init__(self, model: nn.Module, layers: list[ArraysCache]):
        self.layers = layers
        self.convs: list[mx.array] = []  # each mixer's Conv1d input, (B, K - 1 + S, C)
        self.calls: list[dict] = []  # each recurrence call's bound arguments
        mixers = [m for _, m in model.named_modules() if isinstance(getattr(m, "conv1d", None),
                                                                     nn.Conv1d)]  # fmt: skip
        self.supported = (
            bool(mixers)
            and len(mixers) == len(layers)
            and all(type(m).__module__ in LAYOUTS for m in mixers)
        )
        self.fed = 0  # tokens the recorded pass fed
        # (an instance, its own class, the recording subclass it takes while recording)
        self._swaps: list[tuple[nn.Module, type, type]] = []
        if self.supported:
            made: dict[type, type] = {}
            for m in mixers:
                for inst in (m.conv1d, m):
                    cls = type(inst)
                    if cls not in made:
                        made[cls] = (
                            self._conv_class(cls) if inst is m.conv1d else self._mixer_class(cls)
                        )
                    self._swaps.append((inst, cls, made[cls]))

    def _conv_class(self, cls: type) -> type:
        """``cls`` (a Conv1d) whose call also records its input."""
        convs = self.convs

        def __call__(conv, x, *args, **kwargs):
            convs.append(x)
            return cls.__call__(conv, x, *args, **kwargs)

        return type(f"Recorded{cls.__name__}", (cls,), {"__call__": __call__})

    def _mixer_class(self, cls: type) -> type:
        """``cls`` (a mixer) whose methods that call the recurrence call a recording one: the
        same code objects over a copy of their module's globals, the name rebound there."""
        module = sys.modules[cls.__module__]
        name = LAYOUTS[cls.__module__]
        fn = getattr(module, name)
        signature = inspect.signature(fn)
        calls = self.calls

        def recorded(*args, **kwargs):
            calls.append({"fn": fn, "args": dict(signature.bind(*args, **kwargs).arguments)})
            return fn(*args, **kwargs)

        scope = {**vars(module), name: recorded}
        methods = {}
        for owner in cls.__mro__:
            for attr, f in vars(owner).items():
                if attr in methods or not isinstance(f, types.FunctionType):
                    continue
                if name in f.__code__.co_names and f.__globals__ is vars(module):
                    g = types.FunctionType(f.__code__, scope, f.__name__, f.__defaults__,
                                           f.__closure__)  # fmt: skip
                    g.__kwdefaults__ = f.__kwdefaults__
                    methods[attr] = g
        return type(f"Recorded{cls.__name__}", (cls,), methods)

    @contextmanager
    def recording(self, tokens: int) -> Iterator[None]:
        """Record the pass built inside the block (``tokens``: how many it feeds)."""
        self.convs.clear()
        self.calls.clear()
        self.fed = tokens
        for inst, _, recorded in self._swaps:
            inst.__class__ = recorded
        try:
            yield
        finally:
            for inst, own, _ in self._swaps:
                inst.__class__ = own

    def settle_rows(self, ms: list[int], states: list[list | None]) -> None:
        """settle for a batch whose rows keep different counts: row i of each recurrent
        layer goes to its state after the recorded pass's first ms[i] tokens (1 <= ms[i]).
        The recurrence runs once over the first max(ms) steps with steps t >= ms[i] of row
        i masked (mlx-lm's recurrences keep a row's state through its masked steps, as they
        do for a batch's right padding), and each row's conv state is gathered at its own
        length. RuntimeError where the pass was not recorded (batches record every pass)."""
        n = len(self.layers)
        if not (self.supported and len(self.convs) == n and len(self.calls) == n):
            raise RuntimeError("the batch's verify pass was not recorded")
        top = max(ms)
        kept = mx.array(ms, dtype=mx.int32)  # (B,)
        rows = mx.arange(top)[None] < kept[:, None]  # (B, top): each row's kept steps
        new = []
        for conv_in, call, before in zip(self.convs, self.calls, states, strict=True):
            keep = conv_in.shape[1] - self.fed  # K - 1: the conv state's length
            args = dict(call["args"])
            for name in RECURRENCES[call["fn"].__name__]:
                if args.get(name) is not None:
                    args[name] = args[name][:, :top]
            mask = args.get("mask")
            args["mask"] = rows if mask is None else (mask & rows)
            if call["fn"].__name__ in ROW_LENGTHS:
                args["lengths"] = kept
            _, state = call["fn"](**{**args, "state": before[1] if before is not None else None})
            at = (kept[:, None] + mx.arange(keep))[..., None]  # (B, K - 1, 1)
            new.append([mx.take_along_axis(conv_in, at, axis=1), state])
        for layer, arrays in zip(self.layers, new, strict=True):
            layer.cache = arrays

    def settle(self, m: int, states: list[list | None]) -> bool:
        """Set each recurrent layer to its state after the recorded pass's first m tokens,
        from ``states`` (each layer's [conv, recurrent] arrays before the pass). False, with
        nothing changed, when the recording does not cover it (the caller replays)."""
        n = len(self.layers)
        if not (self.supported and len(self.convs) == n and len(self.calls) == n):
            return False
        if not 0 <= m <= self.fed:
            return False
        new = []
        for conv_in, call, before in zip(self.convs, self.calls, states, strict=True):
            keep = conv_in.shape[1] - self.fed  # K - 1: the conv state's length
            state = before[1] if before is not None else None
            if m:  # (m = 0: nothing of the pass kept, the state before it stands)
                args = dict(call["args"])
                for name in RECURRENCES[call["fn"].__name__]:
                    if args.get(name) is not None:
                        args[name] = args[name][:, :m]
                _, state = call["fn"](**{**args, "state": state})
            new.append([conv_in[:, m : m + keep], state])
        for layer, arrays in zip(self.layers, new, strict=True):
            layer.cache = arrays
        return True
