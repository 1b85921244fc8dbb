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
        modules = {type(m).__module__ for m in mixers}
        self.supported = (
            bool(mixers) and len(mixers) == len(layers) and all(n in LAYOUTS for n in modules)
        )
        self._convs = [m.conv1d for m in mixers]
        self._modules = [sys.modules[n] for n in sorted(modules)] if self.supported else []
        self.fed = 0  # tokens the recorded pass fed

    @contextmanager
    def recording(self, tokens: int) -> Iterator[None]:
        """Record the pass built inside the block (``tokens``: how many it feeds)."""
        self.convs, self.calls, self.fed = [], [], tokens
        if not self.supported:
            yield
            return
        wrapped = {}
        for module in self._modules:
            name = LAYOUTS[module.__name__]
            wrapped[module] = name, getattr(module, name)
            setattr(module, name, self._recorder(wrapped[module][1]))
        convs = set(map(id, self._convs))
        conv_call = nn.Conv1d.__call__

        def record_conv(conv, x, *a, **kw):
            if id(conv) in convs:
                self.convs.append(x)
            return conv_call(conv, x, *a, **kw)

        nn.Conv1d.__call__ = record_conv
        try:
            yield
        finally:
            nn.Conv1d.__call__ = conv_call
            for module, (name, fn) in wrapped.items():
                setattr(module, name, fn)

    def _recorder(self, fn):
        signature = inspect.signature(fn)

        def recorded(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            self.calls.append({"fn": fn, "args": dict(bound.arguments)})
            return fn(*args, **kwargs)

        return recorded

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
