"""A model's position in the context: the one object that knows what a model's caches hold.

A cursor owns a model, its layer caches, how many tokens they hold (``held``), the states a
rollback may go back to, and at most one queued pass. The engine's round moves the target's
cursor (verify, queue, give back) and the draft model's drafter moves its own (feed, give
back); neither touches a cache or counts tokens itself.

How a rollback is made is the caches' to say (caches.roll_back asks each layer whether it
can give n tokens back exactly): attention layers trim; recurrent layers cannot, so before
each undoable pass the cursor keeps their state (references, no copy) and a rollback
restores the latest one at or before the kept length, then feeds the kept tokens again -- or,
where the target's verify pass was recorded (recurrent.PassRecorder), recomputes only the
recurrence over them. A round can only give back what it fed, so states from before a
round's first token are forgotten when the next round starts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from .caches import Snapshot, needs_replay, recurrent_layers, roll_back, snapshot
from .hidden import HiddenTap
from .recurrent import PassRecorder
from .tree_acceptance import Tree
from .tree_pass import keep_path, tree_logits

__all__ = ["Cursor", "Hidden", "hidden_states"]


@dataclass
class Hidden:
    """A target pass's hidden states: ``states`` (L, H) at context positions
    start..start+L-1, lazy (the round's one host sync computes them with everything else)."""

    start: int
    states: mx.array


def hidden_states(tap: HiddenTap) -> mx.array:
    """The latest tapped pass's hidden states (L, W) at the tap's places side by side (W: their
    widths summed): row i is position start + i of the tokens that pass was fed."""
    return tap.features()[0]


class Cursor:
    """One model's position: what its caches hold and how to give tokens back.

    model: an mlx-lm model (called as model(x, cache=...)); cache: its layer caches
    (caches.make_caches), holding ``held`` tokens; own_ids: maps ids fed again in a rollback
    to ids the model embeds (a draft narrower than its target), None to feed them as they
    are; record: record verify passes so a recurrent rollback recomputes only the
    recurrence (where the mixers' layout is known); tap: read each pass's hidden states
    (``hidden``) for a drafter that needs them."""

    def __init__(
        self,
        model: nn.Module,
        cache: list,
        held: int,
        *,
        own_ids: Callable[[list[int]], list[int]] | None = None,
        record: bool = False,
        tap: HiddenTap | None = None,
    ):
        if type(held) is not int:  # every later offset, a tree's positions too, counts from it
            raise TypeError(f"held must be a Python int, got {type(held).__name__}")
        self.model, self.cache, self.held = model, cache, held
        self.own_ids, self.tap = own_ids, tap
        self.recurrent = needs_replay(cache)
        self.snaps: list[Snapshot] = []  # recurrent states before this round's passes
        self.queued: mx.array | None = None  # (1, V) logits of a pass queued ahead
        self.hidden: Hidden | None = None  # the latest pass's hidden states, with a tap
        recorder = (
            PassRecorder(model, recurrent_layers(cache)) if record and self.recurrent else None
        )
        self.recorder = recorder if recorder is not None and recorder.supported else None
        self._recorded: Snapshot | None = None  # the state the recorded pass started from
        self.tree_from = 0  # what the caches held before the latest tree pass

    def feed(self, tokens: mx.array, *, undoable: bool = True, record: bool = False) -> mx.array:
        """Run the model over tokens (B, L): logits (B, L, V), lazy; the caches hold L more.

        undoable: keep the recurrent state from before the pass (a prefill's chunks need
        not); record: record the pass's recurrent mixers, for a cheaper rollback into it."""
        if self.recurrent and undoable:
            self.snaps.append(snapshot(self.cache, self.held))
        start, n = self.held, tokens.shape[1]
        recording = record and undoable and self.recorder is not None
        if recording:
            self._recorded = self.snaps[-1]
        if not recording and self.tap is None:  # the plain path: nothing to enter
            logits = self.model(tokens, cache=self.cache)
        else:
            with (
                self.recorder.recording(n) if recording else nullcontext(),
                self.tap or nullcontext(),
            ):
                logits = self.model(tokens, cache=self.cache)
            if self.tap is not None:
                self.hidden = Hidden(start, hidden_states(self.tap))  # (L, H), lazy
        self.held += n
        return logits

    def verify(self, last: int, drafts: mx.array) -> mx.array:
        """The pass that checks ``drafts`` (k,) after the token ``last``: logits (k+1, V),
        lazy, recorded. A queued pass already fed ``last``: its logits are the first row."""
        self.forget_before(self.held - (self.queued is not None))
        if self.queued is None:
            x = mx.concatenate([mx.array([last], dtype=mx.uint32), drafts])[None]  # (1, k+1)
            return self.feed(x, record=True)[0]
        logits, self.queued = self.queued, None
        if drafts.shape[0]:  # the chooser broke its word: correct, if a pass slower
            logits = mx.concatenate([logits, self.feed(drafts[None], record=True)[0]])
        return logits

    def verify_tree(
        self, last: int, nodes: mx.array, tree: Tree, context: Sequence[int]
    ) -> mx.array:
        """The pass that checks a token tree after ``last``: nodes (N,) shaped by ``tree``;
        logits at the root and every node (N + 1, V), lazy. The caches then hold the N + 1
        in pass order until ``keep_path`` (with a tap, ``hidden`` their states, in pass
        order). Full-attention and window caches only (tree_pass.tree_refusal).
        A queued pass is given back first (it fed ``last`` alone); context: what the caches
        hold, for that."""
        if self.queued is not None:
            self.give_back(self.held - 1, context)
        self.forget_before(self.held)
        x = mx.concatenate([mx.array([last], dtype=mx.uint32), nodes])  # (N + 1,)
        if self.tap is None:
            logits = tree_logits(self.model, self.cache, x, tree)
        else:
            with self.tap:
                logits = tree_logits(self.model, self.cache, x, tree)
            self.hidden = Hidden(self.held, hidden_states(self.tap))  # (N + 1, F) pass order
        self.tree_from, self.held = self.held, self.held + x.shape[0]
        return logits

    def keep_path(self, nodes: Sequence[int]) -> None:
        """After ``verify_tree``: keep the pass's ``nodes`` (0 the root, then the kept path,
        in order) and give back the rest; the caches then hold ``len(nodes)`` more than before
        the pass."""
        keep_path(self.cache, self.tree_from, nodes)
        self.held = self.tree_from + len(nodes)

    def queue(self, token: mx.array) -> None:
        """Feed ``token`` (1,) now and keep its logits (1, V) for the next verify, so the next
        plain pass computes while the host reads this round back (as target-only decoding
        overlaps its steps)."""
        self.queued = self.feed(token.reshape(1, 1))[0]
        mx.async_eval(self.queued)

    def give_back(self, keep: int, context: Sequence[int]) -> int:
        """Make the caches hold context[:keep] (keep <= held); returns the tokens fed again.
        A queued pass whose token is given back is dropped with it. RollbackError where no
        exact way back exists (a recurrent state with no kept state at or before ``keep``)."""
        if keep >= self.held:
            return 0
        self.queued = None  # (its token was the last one held)

        def settle(snap: Snapshot, keep: int) -> bool:  # from the recorded verify pass
            return snap is self._recorded and self.recorder.settle(
                keep - snap.offset, snap.recurrent
            )

        again = roll_back(
            self.model, self.cache, self.held, keep, self.snaps, context,
            settle if self.recorder is not None else None, self.own_ids,
        )  # fmt: skip
        self.held = keep
        self.forget_after(keep)
        return again

    def forget_before(self, position: int) -> None:
        """Drop kept states from before ``position``: no rollback will go back past it."""
        if self.snaps:
            self.snaps = [s for s in self.snaps if s.offset >= position]

    def forget_after(self, position: int) -> None:
        """Drop kept states past ``position``: the tokens they followed were given back."""
        if self.snaps:
            self.snaps = [s for s in self.snaps if s.offset <= position]
