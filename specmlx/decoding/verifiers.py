"""The target's side of a round (round.Verifier): a lone row's target over its Cursor, or
the rows of a batch over their batch caches."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

import mlx.core as mx
import mlx.nn as nn

from ..core.batch_caches import attention_rows
from ..core.caches import make_caches, recurrent_layers
from ..core.cursor import Cursor
from ..core.hidden import HiddenTap
from ..core.recurrent import PassRecorder
from ..core.tree_acceptance import Tree
from ..core.tree_pass import keep_rows_paths, rows_tree_logits
from .round import Row


class LoneTarget:
    """A lone row's target: its Cursor, over every cache kind (a rollback each kind knows),
    with the queued plain pass (Cursor.queue); one row only (a second is refused). cursor:
    the target's cursor (recording its verify passes; its tap, if any, gives the features)."""

    def __init__(self, cursor: Cursor):
        self.cursor = cursor
        self.tree_pass = False  # the latest pass verified a token tree

    def verify(self, rows: Sequence[Row], drafts: mx.array | None, trees: Sequence[Tree] | None):
        if len(rows) != 1:  # (its caches are one sequence's: rows share a batch's)
            raise ValueError(f"a lone target verifies one row, not {len(rows)}: rows batch")
        r, cursor = rows[0], self.cursor
        self.tree_pass = trees is not None
        if trees is None:
            d = drafts[0] if drafts is not None else mx.zeros((0,), dtype=mx.uint32)
            logits = cursor.verify(r.ctx[-1], d)  # (k + 1, V)
        else:
            logits = cursor.verify_tree(r.ctx[-1], drafts[0], trees[0], r.ctx)  # (N + 1, V)
        hidden = cursor.hidden if cursor.tap is not None else None
        return logits[None], (hidden.states[None] if hidden is not None else None)

    def queue(self, token: mx.array) -> None:
        self.cursor.queue(token)

    def keep(self, rows: Sequence[Row], fed: list[int], paths: Sequence[list[int]]) -> None:
        r = rows[0]
        if self.tree_pass:  # the kept path's entries moved into place (a chain's are in place)
            self.cursor.keep_path(paths[0])
        ahead = self.cursor.queued is not None and not r.done  # a queued pass stays
        r.stats.replayed += self.cursor.give_back(len(r.ctx) - 1 + ahead, r.ctx)


class RowsTarget:
    """The rows of a batch: the target over core.batch_caches' batch caches (``cache``, None while
    no row is in), a row's rollback its own length; recurrent layers recorded each pass and
    each row's state recomputed over its kept steps. target: the model; tap: a HiddenTap
    for a drafter that reads the target's hidden states (None: none)."""

    def __init__(self, target: nn.Module, tap: HiddenTap | None):
        self.model, self.tap = target, tap
        self.cache: list | None = None  # per layer: core.batch_caches' batch caches
        layers = recurrent_layers(make_caches(target))
        self.recorder = PassRecorder(target, layers) if layers else None
        self._before: list = []  # the recurrent states before the latest pass
        # each row's length before the latest pass when it verified trees ([]: chains)
        self._held: list[int] = []

    def rows_changed(self) -> None:
        """A row joined: the recorder follows the new batch caches."""
        if self.recorder is not None:
            self.recorder.layers = recurrent_layers(self.cache)

    def verify(self, rows: Sequence[Row], drafts: mx.array | None, trees: Sequence[Tree] | None):
        last = mx.array([[r.ctx[-1]] for r in rows], dtype=mx.uint32)  # (B, 1)
        x = last if drafts is None else mx.concatenate([last, drafts], axis=1)  # (B, k + 1)
        self._held = [len(r.ctx) - 1 for r in rows] if trees is not None else []
        recurrent = recurrent_layers(self.cache) if self.recorder is not None else []
        self._before = [list(c.cache) for c in recurrent]  # (references: mixers assign anew)
        with (
            self.recorder.recording(x.shape[1]) if recurrent else nullcontext(),
            self.tap or nullcontext(),
        ):  # (recurrent rows take no tree: tree_refusal)
            if trees is None:
                logits = self.model(x, cache=self.cache)  # (B, k + 1, V)
            else:
                logits = rows_tree_logits(self.model, self.cache, x, trees)  # (B, N + 1, V)
        return logits, (self.tap.features() if self.tap is not None else None)

    def queue(self, token: mx.array) -> None:
        raise NotImplementedError("a batch queues no plain pass")

    def keep(self, rows: Sequence[Row], fed: list[int], paths: Sequence[list[int]]) -> None:
        if self._held:  # a tree pass: each row's kept path moved into place
            keep_rows_paths(self.cache, self._held, paths)
            return
        # a row fed ctx[-1] and its drafts; it keeps what its new ctx[:-1] holds
        for c in attention_rows(self.cache):
            c.lens = [len(r.ctx) - 1 for r in rows]
        if self._before:  # each row's state after its kept steps (lazy: the next sync)
            self.recorder.settle_rows([len(p) for p in paths], self._before)
            self._before = []
