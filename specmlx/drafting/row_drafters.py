"""Drafters for the rows of a round (decoding/round.py): each proposes for B rows at once
(B = 1: a lone generation) and brings each row's own state to what the round's target pass
confirmed. One class a kind of drafter, behind one small interface (RowDrafter), so the
round has one drafting path: a new drafter is written here once, never as a branch of the
round. (The interface and Drafts: proposals.py; drafters with trees of their own:
trees/rows.py.)

- ModelRows: a draft model. Each row is fed its unseen tokens (right-padded, the pads given
  back), then k - 1 one-token steps for all rows together; a recurrent draft keeps its state
  after each step, and each row takes the one at its kept length.
- HeadRows: a chained head over the target's hidden states (MTP, EAGLE-3): every row's
  waiting pairs fed at once (right-padded, the pads given back), then k - 1 chained steps;
  the chained entries are given back after the round.
- BlockRows: a block drafter (DFlash): each row keeps its own context cache and drafts its
  block in a pass of its own, at its own width (a block attends to itself both ways, so its
  logits depend on its width and on nothing of another row).
- LoneRows: a lone sequence's drafter (drafters.py: prompt lookup; the draft model over its
  own cursor, for per-token stopping or caches with no batch kind) as a row of one; it
  refuses a second row by name.
- ChainRows: drafters tried in order each round, the first that proposes drafts (the
  hybrid: lookup first, the draft model when lookup finds nothing worth verifying).

A row (decoding.round.Row) carries the per-row draft state these classes read and write:
``draft_held`` (how much of its context the draft's row holds), ``waiting`` (a head's
confirmed features not yet fed) and ``own_cache`` (a block drafter's context cache). A
sampled row draws its drafts with its own draft key, split into its own k keys, as a solo
drafter does (drafters.py): its drafts past its k are never verified.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn

from ..core.batch_caches import attention_rows, batchable, row_of, rows_of, solo_of
from ..core.caches import WindowKVCache, layer_caches, recurrent_layers
from ..core.kvstate import reads_hidden
from ..core.sampling import sample
from ..core.vocab import draft_ids, logit_width
from ..errors import BadInput
from .choosing.tree_size import OFF, SideSizer, TreeSize
from .drafters import FEED_AFTER, SAFE_ID, Drafter
from .heads.medusa import MedusaDraft
from .proposals import (
    BY_MODEL,
    Drafts,
    RowDrafter,
    block_plan,
    branched,
    followers,
    next_best,
    side_plan,
    with_leaves,
)
from .trees.expand import Grown, HeadFeed, grow, keep, model_feed
from .trees.rows import MedusaRows


def row_drafter(
    target: nn.Module,
    draft: nn.Module,
    vocab_size: int | None = None,
    sizer: SideSizer | None = None,
    size: TreeSize = OFF,
) -> tuple[RowDrafter, int]:
    """The row drafter for ``draft`` (a model, a chained head or a block drafter) and the ids
    it may propose: the smaller logit width, or ``vocab_size`` when fewer.

    target: the target model; draft: the draft model or head; vocab_size: the ids the pair
    shares (None: the smaller logit width); sizer: side leaves for every drafter but Medusa
    (None: chains); size: Medusa's own trees (off: the chain of its heads' best)."""
    if not reads_hidden(draft):
        embeds, vocab = draft_ids(target, draft, vocab_size)
        return ModelRows(draft, vocab, embeds, sizer), vocab
    width = logit_width(target)
    vocab = min(vocab_size or width, width)
    if isinstance(draft, MedusaDraft):
        return MedusaRows(draft, min(vocab, draft.heads.vocab), size), vocab
    if getattr(draft, "block_size", None):
        return BlockRows(draft, vocab, sizer), vocab
    return HeadRows(draft, vocab, sizer), vocab


def fits_one_row(draft: nn.Module, caches: list) -> bool:
    """Whether a lone sequence's draft model drafts as a row of one (a row drafter): its
    caches have a batch kind (core.batch_caches.batchable), and none is a sliding window (a row
    keeps every key of a window layer, masking queries to the window, so a long generation
    would hold more than a solo window cache and the memory plan count).

    draft: the draft model; caches: its layer caches as a solo generation holds them."""
    if batchable(draft) is not None:
        return False
    return not any(isinstance(c, WindowKVCache) for c in layer_caches(caches))


class _SharedCache(RowDrafter):
    """A drafter whose rows share one batch cache per layer (core.batch_caches)."""

    def __init__(self, model, vocab: int, sizer: SideSizer | None = None):
        self.model, self.vocab, self.sizer = model, vocab, sizer
        self.cache: list | None = None  # per layer: core.batch_caches' batch caches
        self._grown: list[Grown] | None = None  # this round's grown trees (expand.py)

    def _grows(self, rows, ks: list[int]) -> bool:
        """Whether this round grows EAGLE-2's trees (``--tree expand:N``, expand.py): where
        every row that drafts takes trees. A row that asked for none (a library caller's
        mix: a server gives every row one setting) keeps the batch on chains and side
        leaves, as a row's draws must not change with the rows beside it."""
        size = self.sizer.size if self.sizer is not None else None
        return bool(
            size and size.expand and any(ks)
            and all(r.wants_trees for r, n in zip(rows, ks, strict=True) if n)
        )  # fmt: skip

    def _grow(self, rows, feed, logits: mx.array, ks: list[int]) -> Drafts:
        """Each row's grown tree of depth ks[i] as its drafts, scored by its own sampling
        (expand.grow); logits (B, vocab): the draft's after each row's root."""
        held = attention_rows(self.cache)[0].lens
        process = [r.process for r in rows]
        self._grown = grow(feed, held, logits, ks, self.sizer.size.nodes, process=process)
        n = max(len(g.tokens) for g in self._grown)
        tokens = mx.array([g.tokens + [0] * (n - len(g.tokens)) for g in self._grown],
                          dtype=mx.uint32)  # (B, N), zeros past a row's own tree  # fmt: skip
        trees = [g.tree for g in self._grown]
        b = len(trees)
        return Drafts(tokens, [None] * b, [t.size for t in trees], [BY_MODEL] * b, trees,
                      0, [0] * b, [()] * b)  # fmt: skip

    def join(self, row, draft, held, waiting) -> None:
        self.cache = rows_of(self.cache, draft)
        row.draft_held, row.waiting = held, waiting

    def leave(self, i, row) -> list:
        return solo_of(self.cache, i)

    def copy_of(self, i, row) -> list | None:
        return row_of(self.cache, i)

    def empty(self) -> None:
        self.cache = None


class ModelRows(_SharedCache):
    """A draft model for every row (see the module). model: the draft; vocab: the ids it
    may propose; embeds: the ids it can embed (others are fed as SAFE_ID)."""

    def __init__(self, model, vocab: int, embeds: int, sizer: SideSizer | None = None):
        super().__init__(model, vocab, sizer)
        self.embeds = embeds
        self._states: list[list[list]] = []  # recurrent layers' states after each step

    def propose(self, rows, k, ks, keys):
        """Each draft row is fed its unseen tokens first, right-padded to the longest (a pad
        sits after a row's real tokens, where causal attention keeps it from them, and is
        given back before the chain), then k - 1 one-token steps: its cache grows by its
        unseen tokens and k - 1."""
        unseen = [[t if t < self.embeds else SAFE_ID for t in r.ctx[r.draft_held :]]
                  for r in rows]  # fmt: skip
        width = max(len(p) for p in unseen)
        x = mx.array([p + [SAFE_ID] * (width - len(p)) for p in unseen], dtype=mx.uint32)
        recurrent = recurrent_layers(self.cache)
        for c in recurrent:  # the pads leave each row's state as its real tokens left it
            c.lengths = mx.array([len(p) for p in unseen])
        logits = self.model(x, cache=self.cache)  # (B, width, V)
        for c in recurrent:
            c.lengths = None
        at = mx.array([len(p) - 1 for p in unseen])[:, None, None]  # each row's last real
        logits = mx.take_along_axis(logits, at, axis=1)[:, 0, : self.vocab]  # (B, vocab)
        for c in attention_rows(self.cache):
            c.give_back([width - len(p) for p in unseen])  # the pads
        if self._grows(rows, ks):  # EAGLE-2's trees instead of chains (expand.py)
            return self._grow(rows, model_feed(self.model, self.cache, self.embeds), logits, ks)
        keep = lambda: [list(c.cache) for c in recurrent]  # noqa: E731 - references only
        self._states = [keep()] if recurrent else []
        steps = _step_keys(keys, ks)
        sides = side_plan(self.sizer, rows, ks)
        tokens, qs, leaves = [], [], [[] for _ in rows]
        for j in range(k):
            if j:
                fed = mx.where(tokens[-1] < self.embeds, tokens[-1], SAFE_ID)
                logits = self.model(fed[:, None], cache=self.cache)[:, -1, : self.vocab]
                if recurrent:
                    self._states.append(keep())
            t, q = _draw(rows, logits, [s[j] if s is not None and j < s.shape[0] else None
                                        for s in steps])  # fmt: skip
            _add_leaves(leaves, sides, j, logits, t, q)
            tokens.append(t)
            qs.append(q)
            mx.async_eval(t)  # the host builds the next step while this one runs
        drafts = Drafts.model(mx.stack(tokens, axis=1), _per_row(rows, qs), ks)
        return with_leaves(drafts, sides, leaves) if branched(sides) else drafts

    def settle(self, rows, k, fed, accepted, feats) -> None:
        """The draft fed ctx and k - 1 drafts: each row keeps what its ctx confirms of them
        (its recurrent layers: the state after that many steps); after a grown tree, the
        entries of the nodes it fed along the kept path."""
        if self._grown is not None:
            held = [f + 1 for f in fed]
            slots = [g.kept(r.ctx[h : len(r.ctx) - 1])
                     for g, r, h in zip(self._grown, rows, held, strict=True)]  # fmt: skip
            keep(self.cache, held, slots)
            for r, h, s in zip(rows, held, slots, strict=True):
                r.draft_held = h + len(s)
            self._grown = None
            return
        if not k:
            return
        steps = []
        states, self._states = self._states, []
        for r, f, n in zip(rows, fed, accepted, strict=True):
            r.draft_held = min(f + 1 + min(n, k - 1), len(r.ctx) - 1)
            steps.append(r.draft_held - f - 1)  # drafting steps kept after its catch-up
            if steps[-1] < 0 and states:
                # it kept nothing (its first token ended it: an EOS), and a recurrent layer
                # cannot give back its catch-up's last token: it holds all of ctx, and says
                # so (one past ctx[:-1]: a later prompt starts its draft afresh)
                steps[-1], r.draft_held = 0, f + 1
        for c in attention_rows(self.cache):
            c.lens = [r.draft_held for r in rows]
        if not states:
            return
        index = mx.arange(len(steps))
        at = mx.array(steps, dtype=mx.int32)
        for layer, c in enumerate(recurrent_layers(self.cache)):
            c.cache = [
                None if states[0][layer][e] is None
                else mx.stack([s[layer][e] for s in states])[at, index]  # (B, ...)
                for e in range(len(c.cache))
            ]  # fmt: skip


class HeadRows(_SharedCache):
    """A chained head over the target's hidden states for every row (see the module):
    head(hidden (B, L, H), tokens (B, L), cache) -> (g, logits). vocab: the ids it may
    propose."""

    def __init__(self, head, vocab: int, sizer: SideSizer | None = None):
        super().__init__(head, vocab, sizer)
        self.reads_hidden = head.reads_hidden

    def limit(self, row) -> int | None:
        return 0 if row.waiting is None else None  # (nothing to read yet: no drafts)

    def propose(self, rows, k, ks, keys):
        g, logits = self._feed_waiting(rows, keep_last=False)  # (B, 1, H), (B, vocab)
        if self._grows(rows, ks):  # EAGLE-2's trees instead of chains (expand.py)
            return self._grow(rows, HeadFeed(self.model, self.cache, g), logits, ks)
        steps = _step_keys(keys, ks)
        sides = side_plan(self.sizer, rows, ks)
        tokens, qs, leaves = [], [], [[] for _ in rows]
        for j in range(k):
            if j:
                g, logits = self.model(g, tokens[-1][:, None], self.cache)
                g, logits = g[:, -1:], logits[:, -1, : self.vocab]
            t, q = _draw(rows, logits, [s[j] if s is not None and j < s.shape[0] else None
                                        for s in steps])  # fmt: skip
            _add_leaves(leaves, sides, j, logits, t, q)
            tokens.append(t)
            qs.append(q)
            mx.async_eval(t)
        drafts = Drafts.model(mx.stack(tokens, axis=1), _per_row(rows, qs), ks)
        return with_leaves(drafts, sides, leaves) if branched(sides) else drafts

    def settle(self, rows, k, fed, accepted, feats) -> None:
        """The pairs (h_j, t_{j+1}) this pass confirmed wait to be fed; the chained entries
        are never kept (they read drafts)."""
        _add_waiting(rows, fed, feats)
        if k or self._grown is not None:
            self._grown = None
            for c in attention_rows(self.cache):
                c.lens = [r.draft_held for r in rows]
        if max(len_of(r.waiting) for r in rows) > FEED_AFTER:
            # rounds without proposals would pile them up: all but each row's newest, queued
            self._feed_waiting(rows, keep_last=True)
            mx.async_eval([c.state for c in attention_rows(self.cache)])

    def _feed_waiting(self, rows, keep_last: bool):
        """Feed every row's waiting pairs (all but each row's newest when ``keep_last``),
        right-padded to the longest; the pads are given back and each row's draft_held grows
        by what it was fed. Returns the outputs at each row's last pair fed: g (B, 1, H) and
        logits (B, vocab). A row with nothing to feed is fed a zero pair, given back."""
        counts = [max(0, len_of(r.waiting) - keep_last) for r in rows]
        top = max(max(counts), 1)
        width = next(r.waiting.shape[-1] for r in rows if r.waiting is not None)
        feats, toks = [], []
        for r, m in zip(rows, counts, strict=True):
            f = r.waiting[:m] if m else mx.zeros((0, width))
            feats.append(mx.pad(f, [(0, top - m), (0, 0)]))
            toks.append(pair_ids(r.ctx, r.draft_held, m) + [0] * (top - m))
        g, logits = self.model(mx.stack(feats), mx.array(toks, dtype=mx.uint32), self.cache)
        for c in attention_rows(self.cache):
            c.give_back([top - m for m in counts])
        at = mx.array([max(m - 1, 0) for m in counts])[:, None, None]
        g = mx.take_along_axis(g, at, axis=1)  # (B, 1, H)
        logits = mx.take_along_axis(logits, at, axis=1)[:, 0, : self.vocab]
        for r, m in zip(rows, counts, strict=True):
            r.draft_held += m
            r.waiting = r.waiting[m:] if r.waiting is not None and m < len_of(r.waiting) else None
        return g, logits


class BlockRows(RowDrafter):
    """A block drafter over the target's hidden states, each row with its own context cache
    (see the module): head.block(hidden, first, width, cache) -> logits drafts a block,
    head(hidden, tokens, cache) feeds context. vocab: the ids it may propose."""

    def __init__(self, head, vocab: int, sizer: SideSizer | None = None):
        self.model, self.vocab, self.sizer = head, vocab, sizer
        self.reads_hidden = head.reads_hidden

    def limit(self, row) -> int | None:
        return 0 if row.waiting is None else self.model.block_size - 1

    def join(self, row, draft, held, waiting) -> None:
        row.own_cache, row.draft_held, row.waiting = draft, held, waiting

    def leave(self, i, row) -> list:
        return row.own_cache

    def copy_of(self, i, row) -> list | None:
        return copy.deepcopy(row.own_cache)  # (free until written)

    def propose(self, rows, k, ks, keys):
        """Each row's block: its waiting context fed to its own cache, then a block of its
        own ks[i] + 1 positions after its newest token (zeros past ks[i])."""
        tokens, qs, leaves = [], [], [[] for _ in rows]
        sides, runs = block_plan(self.sizer, rows, ks)
        for i, (r, ki, key) in enumerate(zip(rows, ks, keys, strict=True)):
            m = len_of(r.waiting)
            if m:
                self.model(r.waiting[None], None, r.own_cache)
                r.draft_held, r.waiting = r.draft_held + m, None
            if not ki:
                tokens.append(mx.zeros((k,), dtype=mx.uint32))
                qs.append(None)
                continue
            first = mx.array(r.ctx[-1:], dtype=mx.uint32)  # (1,)
            logits = self.model.block(None, first, ki + 1, r.own_cache)[0, :, : self.vocab]
            if r.process is None:
                d, q = mx.argmax(logits, axis=-1).astype(mx.uint32), None
            else:  # (each position has its own q, drawn independently)
                q = r.process(logits)
                d = sample(q, key)
            if sides and any(sides[i]):  # the top of each position, then the followers
                for j, m in enumerate(sides[i][:ki]):
                    if m:
                        leaves[i].append(next_best(logits[j] if q is None else q[j], d[j], m))
                leaves[i] += followers(d, sides[i][:ki], runs[i])
            tokens.append(mx.concatenate([d, mx.zeros((k - ki,), dtype=mx.uint32)]))
            qs.append(q)
        d = mx.stack(tokens)  # (B, k)
        mx.async_eval(d)
        drafts = Drafts.model(d, qs, ks)
        return with_leaves(drafts, sides, leaves, runs) if branched(sides) else drafts

    def settle(self, rows, k, fed, accepted, feats) -> None:
        """The context this pass confirmed waits to be fed; a row that piles up more than
        FEED_AFTER (rounds without drafts) feeds all but its newest, queued."""
        _add_waiting(rows, fed, feats)
        if max(len_of(r.waiting) for r in rows) <= FEED_AFTER:
            return
        for r in rows:
            m = len_of(r.waiting) - 1
            if m > 0:
                self.model(r.waiting[None, :m], None, r.own_cache)
                r.draft_held, r.waiting = r.draft_held + m, r.waiting[m:]
                mx.async_eval([c.state for c in r.own_cache])


def pair_ids(ctx: Sequence[int], start: int, m: int) -> list[int]:
    """The tokens of a head's pairs at positions start..start+m-1: the pair at j is (h_j,
    t_{j+1}), the hidden state and the token that followed it.

    ctx: the context; start: the first pair's position; m: how many pairs."""
    return list(ctx[start + 1 : start + 1 + m])


def len_of(x: mx.array | None) -> int:
    """Rows of an array, 0 for None."""
    return 0 if x is None else x.shape[0]


def _add_waiting(rows, fed: list[int], feats: mx.array) -> None:
    """Each row's features at the positions this pass confirmed, (kept, F), join its
    waiting ones: the pass fed ctx[fed] and the drafts, and ctx[:-1] is confirmed."""
    for i, (r, f) in enumerate(zip(rows, fed, strict=True)):
        new = feats[i, : len(r.ctx) - 1 - f]
        r.waiting = new if r.waiting is None else mx.concatenate([r.waiting, new])


def _add_leaves(leaves: list[list], sides: list[list[int]], j: int, logits, t, q) -> None:
    """Step j's side leaves, row by row (side_plan's ``sides``): the best ids of the q each
    draw used, or a greedy row's logits (B, vocab), other than its draw t (B,)."""
    for i, plan in enumerate(sides):
        if j < len(plan) and plan[j]:
            leaves[i].append(next_best(logits[i] if q[i] is None else q[i], t[i], plan[j]))


def _step_keys(keys: list, ks: list[int]) -> list:
    """A sampled row's draft key split into its own ks[i] keys, one a step (None: greedy, or
    no drafts), as a solo drafter splits its own."""
    return [mx.random.split(kk, ki) if kk is not None and ki else None
            for kk, ki in zip(keys, ks, strict=True)]  # fmt: skip


def _per_row(rows, qs: list[list]) -> list:
    """Each row's q over the steps (k, vocab), None for a greedy row; qs: per step, per row."""
    return [None if r.process is None else mx.stack([q[i] for q in qs])
            for i, r in enumerate(rows)]  # fmt: skip


def _draw(rows, logits: mx.array, keys: list) -> tuple[mx.array, list]:
    """One draft token per row from logits (B, vocab): argmax for greedy rows, a draw from
    the row's processed q otherwise; (tokens (B,), each row's q (vocab,) or None)."""
    if all(r.process is None for r in rows):
        return mx.argmax(logits, axis=-1).astype(mx.uint32), [None] * len(rows)
    tokens, qs = [], []
    for i, r in enumerate(rows):
        if r.process is None:
            tokens.append(mx.argmax(logits[i], axis=-1).astype(mx.uint32))
            qs.append(None)
        else:
            q = r.process(logits[i : i + 1])  # (1, vocab): drawn as a solo draft draws it
            tokens.append(sample(q, keys[i])[0])
            qs.append(q[0])
    return mx.stack(tokens), qs


class LoneRows(RowDrafter):
    """A lone sequence's drafter (drafters.Drafter: prompt lookup, or the draft model over
    its own cursor) as a row drafter of one row; it keeps its own state, so it never joins a
    batch, and refuses a second row by name.

    drafter: the lone drafter; name: what it is, for the refusal; sizer: side leaves for a
    drafter whose proposals keep their step scores (the draft model without per-token
    stopping), where the target verifies trees (None: chains)."""

    lone = True

    def __init__(self, drafter: Drafter, name: str, sizer: SideSizer | None = None):
        self.drafter, self.name, self.sizer = drafter, name, sizer
        self.needs_k = drafter.needs_k

    def propose(self, rows, k, ks, keys) -> Drafts:
        if len(rows) != 1:
            raise BadInput(f"{self.name} drafts for a lone request only, not for {len(rows)} rows")
        r = rows[0]
        p = self.drafter.propose(r.ctx, ks[0], r.stops.room, keys[0])
        sides = side_plan(self.sizer, rows, [p.k]) if p.scores else []
        if not branched(sides):
            return Drafts.one(p)
        leaves = [next_best(p.scores[j], p.tokens[j], m) for j, m in enumerate(sides[0]) if m]
        return with_leaves(Drafts.one(p), sides, [leaves])

    def settle(self, rows, k, fed, accepted, feats) -> None:
        # what the drafter saw of its own drafts and ctx still holds: a tree's path may leave
        # the chain for a side leaf after ``accepted`` of its drafts
        r = rows[0]
        self.drafter.settle(r.ctx, min(len(r.ctx) - 1, fed[0] + 1 + accepted[0]))

    def close(self) -> None:
        self.drafter.close()


class ChainRows(RowDrafter):
    """Row drafters tried in order each round; the first that proposes anything drafts it
    (each within its own limit). The others settle as drafters that proposed nothing.

    drafters: in the order they are tried (lookup first)."""

    def __init__(self, drafters: Sequence[RowDrafter]):
        self.drafters = list(drafters)
        self.reads_hidden = next((d.reads_hidden for d in drafters if d.reads_hidden), ())
        self.needs_k = all(d.needs_k for d in drafters)
        self.used: RowDrafter | None = None  # this round's

    def propose(self, rows, k, ks, keys) -> Drafts:
        self.used = None
        for d in self.drafters:
            own = [ki if (top := d.limit(r)) is None else max(0, min(ki, top))
                   for r, ki in zip(rows, ks, strict=True)]  # fmt: skip
            if max(own) or not d.needs_k:
                drafts = d.propose(rows, max(own), own, keys)
                if drafts.k:
                    self.used = d
                    return drafts
        return Drafts.none(len(rows))

    def settle(self, rows, k, fed, accepted, feats) -> None:
        for d in self.drafters:
            d.settle(rows, k if d is self.used else 0, fed, accepted, feats)

    def close(self) -> None:
        for d in self.drafters:
            d.close()
