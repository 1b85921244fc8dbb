"""Drafters for the rows of a round (decoding/round.py): each proposes for B rows at once
(B = 1: a lone generation) and brings each row's own state to what the round's target pass
confirmed. One class a kind of drafter, behind one small interface (RowDrafter), so the
round has one drafting path: a new drafter is written here once, never as a branch of the
round.

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
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx
import mlx.nn as nn

from ..core.caches import WindowKVCache, layer_caches, recurrent_layers
from ..core.kvstate import reads_hidden
from ..core.rows import attention_rows, batchable, row_of, rows_of, solo_of
from ..core.sampling import Processor, sample
from ..core.stats import KChooser, Stats
from ..core.tree_acceptance import Tree
from ..core.vocab import draft_ids, logit_width
from ..errors import BadInput
from .drafters import FEED_AFTER, SAFE_ID, Drafter, Proposal
from .lookup import Lookup
from .medusa import MedusaDraft, tree_shape
from .trees import SideSizer, TreeSize, side_parents

_MODEL = Proposal(source="model")  # how a row drafter's drafts were made: nothing to add
_NOTHING = Proposal()


@dataclass
class Drafts:
    """A round's drafts for B rows. tokens (B, k) uint32, maybe lazy (row i's past ks[i] are
    never verified; None: k = 0); q: each row's (ks[i] or k, V_q) distribution its drafts
    were drawn from, None for a greedy row or a point mass (lookup); ks: each row's drafts
    to verify; how: each row's drafters.Proposal saying how they were made (its source, a
    lookup's match, per-token stopping's confidences and timing; its tokens unused)."""

    tokens: mx.array | None
    q: list
    ks: list[int]
    how: list[Proposal]
    # a lone row's token tree (trees.py): its shape over the k nodes, the drafter's chain
    # (nodes 1..chain, each the child of the one before) and its side leaves by depth (the
    # nodes after the chain; any nodes after those are another drafter's, SiblingRows);
    # None: the drafts are a chain
    tree: Tree | None = None
    chain: int = 0
    sides: tuple[int, ...] = ()

    @property
    def k(self) -> int:
        return 0 if self.tokens is None else self.tokens.shape[1]

    @classmethod
    def none(cls, b: int) -> Drafts:
        """No drafts for any of b rows."""
        return cls(None, [None] * b, [0] * b, [_NOTHING] * b)

    @classmethod
    def one(cls, p: Proposal) -> Drafts:
        """A lone row's proposal as the drafts of a round of one."""
        return cls(p.tokens[None] if p.k else None, [p.q], [p.k], [p])

    @classmethod
    def model(cls, tokens: mx.array, q: list, ks: list[int]) -> Drafts:
        """A row drafter's drafts (B, k), its q per row and ks."""
        return cls(tokens, q, list(ks), [_MODEL] * len(ks))


class DraftRow(Protocol):
    """What a row drafter reads and writes of a row (decoding.round.Row)."""

    ctx: list[int]
    process: Processor | None
    stats: Stats
    draft_held: int
    waiting: mx.array | None
    own_cache: list | None


class RowDrafter:
    """The interface: ``limit`` a row's drafts this round, ``propose`` for every row,
    ``settle`` each row after the round, ``close`` when the generation ends; ``join``,
    ``leave`` and ``copy_of`` move a row's draft state in and out of the batch (as a
    KVState's draft caches, draft_held and waiting). ``reads_hidden``: the places in the
    target whose hidden states the round must tap for ``settle`` (empty: none);
    ``needs_k``: propose only in rounds with k > 0 (lookup may verify a match at k = 0);
    ``lone``: it drafts for a lone request only (a batch refuses it; a server runs such
    requests alone)."""

    reads_hidden: tuple = ()
    needs_k: bool = True
    lone: bool = False
    # set for a lone row whose target verifies trees (trees.SideSizer): a drafter with a
    # distribution at each step gives its chain the side leaves it plans (``_side_leaves``)
    sizer: SideSizer | None = None

    def limit(self, row: DraftRow) -> int | None:
        """The most drafts ``row`` may get this round (None: no limit of the drafter's)."""
        return None

    def join(self, row: DraftRow, draft: list, held: int, waiting: mx.array | None) -> None:
        """Take a joining row's draft caches (holding ``held`` of its context) and waiting
        features."""
        raise NotImplementedError

    def leave(self, i: int, row: DraftRow) -> list:
        """Row ``i`` leaves: its draft caches, as a solo generation's."""
        raise NotImplementedError

    def copy_of(self, i: int, row: DraftRow) -> list | None:
        """A copy of row ``i``'s draft caches (None: they cannot be copied)."""
        raise NotImplementedError

    def empty(self) -> None:
        """Every row has left."""

    def close(self) -> None:
        """The generation ended (or stopped early)."""

    def propose(self, rows: Sequence[DraftRow], k: int, ks: list[int], keys: list) -> Drafts:
        """Up to k drafts for every row (row i: ks[i], a lone drafter may propose fewer, or
        lookup up to the row's room), as Drafts. keys: each row's draft key (None when
        greedy)."""
        raise NotImplementedError

    def settle(
        self,
        rows: Sequence[DraftRow],
        k: int,
        fed: list[int],
        accepted: list[int],
        feats: mx.array | None,
    ) -> None:
        """The round is over and each row's ctx holds what it kept: bring each row's draft
        state there. k: the drafts proposed (0: none); fed[i]: where row i's drafts started
        (its ctx length before the round, less one); accepted[i]: its drafts accepted;
        feats: the tapped features of the pass (B, k + 1, F), lazy, for a drafter that reads
        them."""
        raise NotImplementedError


def row_drafter(
    target: nn.Module, draft: nn.Module, vocab_size: int | None = None
) -> tuple[RowDrafter, int]:
    """The row drafter for ``draft`` (a model, a chained head or a block drafter) and the ids
    it may propose: the smaller logit width, or ``vocab_size`` when fewer.

    target: the target model; draft: the draft model or head; vocab_size: the ids the pair
    shares (None: the smaller logit width)."""
    if not reads_hidden(draft):
        embeds, vocab = draft_ids(target, draft, vocab_size)
        return ModelRows(draft, vocab, embeds), vocab
    width = logit_width(target)
    vocab = min(vocab_size or width, width)
    if isinstance(draft, MedusaDraft):
        return MedusaRows(draft, min(vocab, draft.heads.vocab)), vocab
    if getattr(draft, "block_size", None):
        return BlockRows(draft, vocab), vocab
    return HeadRows(draft, vocab), vocab


def fits_one_row(draft: nn.Module, caches: list) -> bool:
    """Whether a lone sequence's draft model drafts as a row of one (a row drafter): its
    caches have a batch kind (core.rows.batchable), and none is a sliding window (a row
    keeps every key of a window layer, masking queries to the window, so a long generation
    would hold more than a solo window cache and the memory plan count).

    draft: the draft model; caches: its layer caches as a solo generation holds them."""
    if batchable(draft) is not None:
        return False
    return not any(isinstance(c, WindowKVCache) for c in layer_caches(caches))


class _SharedCache(RowDrafter):
    """A drafter whose rows share one batch cache per layer (core.rows)."""

    def __init__(self, model, vocab: int):
        self.model, self.vocab = model, vocab
        self.cache: list | None = None  # per layer: core.rows' batch caches

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

    def __init__(self, model, vocab: int, embeds: int):
        super().__init__(model, vocab)
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
        keep = lambda: [list(c.cache) for c in recurrent]  # noqa: E731 - references only
        self._states = [keep()] if recurrent else []
        steps = _step_keys(keys, ks)
        sides = _side_plan(self.sizer, rows, k)
        tokens, qs, leaves = [], [], []
        for j in range(k):
            if j:
                fed = mx.where(tokens[-1] < self.embeds, tokens[-1], SAFE_ID)
                logits = self.model(fed[:, None], cache=self.cache)[:, -1, : self.vocab]
                if recurrent:
                    self._states.append(keep())
            t, q = _draw(rows, logits, [s[j] if s is not None and j < s.shape[0] else None
                                        for s in steps])  # fmt: skip
            if sides and sides[j]:  # (the q a draw used, or the logits of a greedy one)
                leaves.append(_next_best(logits[0] if q[0] is None else q[0], t[0], sides[j]))
            tokens.append(t)
            qs.append(q)
            mx.async_eval(t)  # the host builds the next step while this one runs
        drafts = Drafts.model(mx.stack(tokens, axis=1), _per_row(rows, qs), ks)
        return _with_leaves(drafts, k, sides, leaves) if any(sides) else drafts

    def settle(self, rows, k, fed, accepted, feats) -> None:
        """The draft fed ctx and k - 1 drafts: each row keeps what its ctx confirms of them
        (its recurrent layers: the state after that many steps)."""
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

    def __init__(self, head, vocab: int):
        super().__init__(head, vocab)
        self.reads_hidden = head.reads_hidden

    def limit(self, row) -> int | None:
        return 0 if row.waiting is None else None  # (nothing to read yet: no drafts)

    def propose(self, rows, k, ks, keys):
        g, logits = self._feed_waiting(rows, keep_last=False)  # (B, 1, H), (B, vocab)
        steps = _step_keys(keys, ks)
        sides = _side_plan(self.sizer, rows, k)
        tokens, qs, leaves = [], [], []
        for j in range(k):
            if j:
                g, logits = self.model(g, tokens[-1][:, None], self.cache)
                g, logits = g[:, -1:], logits[:, -1, : self.vocab]
            t, q = _draw(rows, logits, [s[j] if s is not None and j < s.shape[0] else None
                                        for s in steps])  # fmt: skip
            if sides and sides[j]:
                leaves.append(_next_best(logits[0] if q[0] is None else q[0], t[0], sides[j]))
            tokens.append(t)
            qs.append(q)
            mx.async_eval(t)
        drafts = Drafts.model(mx.stack(tokens, axis=1), _per_row(rows, qs), ks)
        return _with_leaves(drafts, k, sides, leaves) if any(sides) else drafts

    def settle(self, rows, k, fed, accepted, feats) -> None:
        """The pairs (h_j, t_{j+1}) this pass confirmed wait to be fed; the chained entries
        are never kept (they read drafts)."""
        _add_waiting(rows, fed, feats)
        if k:
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

    def __init__(self, head, vocab: int):
        self.model, self.vocab = head, vocab
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
        tokens, qs, leaves = [], [], []
        sides = _side_plan(self.sizer, rows, k)
        for r, ki, key in zip(rows, ks, keys, strict=True):
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
            for j, m in enumerate(sides[:ki]):  # (a lone row: the top of each position)
                if m:
                    leaves.append(_next_best(logits[j] if q is None else q[j], d[j], m))
            tokens.append(mx.concatenate([d, mx.zeros((k - ki,), dtype=mx.uint32)]))
            qs.append(q)
        d = mx.stack(tokens)  # (B, k)
        mx.async_eval(d)
        drafts = Drafts.model(d, qs, ks)
        return _with_leaves(drafts, k, sides, leaves) if any(sides) else drafts

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


class MedusaRows(RowDrafter):
    """Medusa heads (medusa.MedusaDraft) for a lone row: each round they read the target's
    final hidden state at the position that produced the row's newest token and draft a
    sparse tree, the first of their choices that fit (depth at most k, at most ``size.nodes``
    nodes; ``size`` off: the chain of each head's best). A head's top tokens are chosen, not
    drawn: a sampled row's q is a point mass at each (tree_acceptance), which keeps it exact.

    draft: the heads; vocab: the ids they may propose. ``size``: set by the engine (default
    off)."""

    lone = True

    def __init__(self, draft: MedusaDraft, vocab: int):
        self.model, self.vocab = draft, vocab
        self.reads_hidden = draft.reads_hidden
        self.size: TreeSize = TreeSize()
        self._shapes: dict[tuple[int, int], tuple] = {}

    def limit(self, row) -> int | None:
        return 0 if row.waiting is None else self.model.heads.heads

    def join(self, row, draft, held, waiting) -> None:
        row.draft_held, row.waiting = held, waiting

    def leave(self, i, row) -> list:
        return []

    def copy_of(self, i, row) -> list | None:
        return []

    def _shape(self, k: int) -> tuple:
        """(Tree or None for a chain, each node's place in the heads' flattened top (N,),
        the ranks a head's top needs) for depth k."""
        nodes = 1 if self.size.off else self.size.nodes
        if (k, nodes) not in self._shapes:
            if self.size.off:
                picked = [(0,) * d for d in range(1, k + 1)]
            else:
                picked = [c for c in self.model.choices if len(c) <= k][:nodes]
            parents, places = tree_shape(picked)
            width = max(r for _, r in places) + 1
            at = mx.array([h * width + r for h, r in places], dtype=mx.int32)
            tree = None if self.size.off else Tree(parents)
            self._shapes[(k, nodes)] = (tree, at, width, max(h for h, _ in places) + 1)
        return self._shapes[(k, nodes)]

    def propose(self, rows, k, ks, keys) -> Drafts:
        if len(rows) != 1:
            raise BadInput(f"Medusa heads draft for a lone request only, not for {len(rows)} rows")
        r = rows[0]
        tree, at, width, heads = self._shape(k)
        logits = self.model.heads(r.waiting[-1])[:heads, : self.vocab]  # (heads, vocab)
        top = mx.argpartition(-logits, kth=width - 1, axis=-1)[:, :width]  # (heads, width)
        order = mx.argsort(-mx.take_along_axis(logits, top, axis=-1), axis=-1)
        top = mx.take_along_axis(top, order, axis=-1)  # each head's best first
        tokens = top.reshape(-1)[at].astype(mx.uint32)  # (N,)
        q = None
        if r.process is not None:  # point masses (chosen, not drawn)
            q = (mx.arange(self.vocab) == tokens[:, None]).astype(mx.float32)  # (N, vocab)
        n = tokens.shape[0]
        mx.async_eval(tokens)
        return Drafts(tokens[None], [q], [n], [_MODEL], tree)  # (a tree of its own: no chain)

    def settle(self, rows, k, fed, accepted, feats) -> None:
        """The heads read next the target's state at the row's last kept position: feats
        (1, kept..., F) hold the pass's kept positions in order (a tree's path)."""
        r = rows[0]
        kept = len(r.ctx) - 1 - fed[0]
        if feats is not None and kept > 0:
            r.waiting, r.draft_held = feats[0, kept - 1 : kept], len(r.ctx) - 1


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


def _step_keys(keys: list, ks: list[int]) -> list:
    """A sampled row's draft key split into its own ks[i] keys, one a step (None: greedy, or
    no drafts), as a solo drafter splits its own."""
    return [mx.random.split(kk, ki) if kk is not None and ki else None
            for kk, ki in zip(keys, ks, strict=True)]  # fmt: skip


def _side_plan(sizer: SideSizer | None, rows, k: int) -> list[int]:
    """A lone row's side leaves per depth this round (trees.SideSizer); none for a batch."""
    return sizer.plan(k, rows[0].stats) if sizer is not None and len(rows) == 1 else []


def _next_best(scores: mx.array, chosen: mx.array, m: int) -> mx.array:
    """The m best ids by ``scores`` (vocab,) other than ``chosen`` (the chain's draw), best
    first (m,): the side leaves at a step."""
    top = mx.argpartition(-scores, kth=m)[: m + 1]  # the m + 1 best, in no order
    value = mx.where(top == chosen, -mx.inf, scores[top])  # the chain's own token last
    return top[mx.argsort(-value)[:m]]


def _with_leaves(drafts: Drafts, k: int, sides: list[int], leaves: list) -> Drafts:
    """A lone row's chain of k with side leaves (trees.py): tokens (1, N), the chain's
    first; a sampled row's q (N, vocab) the chain's rows, then a point mass (one-hot) for each
    leaf: the leaves are the draft's top ranks, chosen, not drawn (tree_acceptance)."""
    leaf = mx.concatenate(leaves)  # (N - k,)
    tokens = mx.concatenate([drafts.tokens, leaf[None]], axis=1)  # (1, N)
    q = drafts.q[0]
    if q is not None:
        one_hot = (mx.arange(q.shape[-1]) == leaf[:, None]).astype(q.dtype)  # (N - k, vocab)
        q = mx.concatenate([q, one_hot])
    n = tokens.shape[1]
    return Drafts(tokens, [q], [n], drafts.how, Tree(side_parents(k, sides)), k, tuple(sides))


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

    drafter: the lone drafter; name: what it is, for the refusal."""

    lone = True

    def __init__(self, drafter: Drafter, name: str):
        self.drafter, self.name = drafter, name
        self.needs_k = drafter.needs_k

    def propose(self, rows, k, ks, keys) -> Drafts:
        if len(rows) != 1:
            raise BadInput(f"{self.name} drafts for a lone request only, not for {len(rows)} rows")
        r = rows[0]
        return Drafts.one(self.drafter.propose(r.ctx, ks[0], r.stops.room, keys[0]))

    def settle(self, rows, k, fed, accepted, feats) -> None:
        self.drafter.settle(rows[0].ctx, len(rows[0].ctx) - 1)

    def close(self) -> None:
        self.drafter.close()


class SiblingRows(RowDrafter):
    """Prompt lookup beside a row drafter in one tree (SpecInfer's several drafters as
    siblings), for a lone row: the drafter's chain (with its side leaves) and, under the root
    after them, lookup's continuation as a branch of point masses. Either may be right; the
    target's pass checks both. Where one of them proposes nothing, the other's drafts go
    alone.

    finder: the row's lookup (its index over the row's context, and the memory); chooser:
    sizes lookup's proposal (stats.KChooser.lookup_length); drafter: the row drafter (a lone
    row's); width: the target's logit width (a sampled row's point masses span it: lookup may
    propose ids past the draft's vocabulary)."""

    lone = True
    needs_k = False

    def __init__(self, finder: Lookup, chooser: KChooser, drafter: RowDrafter, width: int):
        self.finder, self.chooser, self.drafter, self.width = finder, chooser, drafter, width
        self.reads_hidden = drafter.reads_hidden
        self.drafted = False  # this round's drafter drafted (it settles on its own drafts)

    def limit(self, row) -> int | None:
        return None  # (the drafter's own limit is asked in propose)

    def propose(self, rows, k, ks, keys) -> Drafts:
        if len(rows) != 1:
            raise BadInput(
                f"lookup beside a draft drafts for a lone request only, not {len(rows)} rows"
            )
        r = rows[0]
        top = self.drafter.limit(r)
        own = max(0, min(k, top)) if top is not None else k
        drafts = self.drafter.propose(rows, own, [own], keys) if own else Drafts.none(1)
        self.drafted = bool(own)
        match, found = self.finder.find(max(k, 1) if drafts.k else r.stops.room)
        found = found[: self.chooser.lookup_length(match, len(found), max(k, 1), False)]
        if not found:
            return drafts
        look = mx.array(found, dtype=mx.uint32)
        if not drafts.k:  # lookup alone: a chain of point masses
            return Drafts.one(Proposal(look, None, "lookup", match=match))
        n, chain = drafts.k, drafts.chain if drafts.tree is not None else drafts.k
        parents = drafts.tree.parents if drafts.tree is not None else tuple(range(n))
        parents += (0,) + tuple(range(n + 1, n + len(found)))  # lookup's branch, under the root
        q = drafts.q[0]
        if q is not None:  # a sampled row: its drafter's q, then a point mass at each of lookup's
            q = mx.pad(q, [(0, 0), (0, self.width - q.shape[-1])])
            q = mx.concatenate([q, (mx.arange(self.width) == look[:, None]).astype(q.dtype)])
        tokens = mx.concatenate([drafts.tokens, look[None]], axis=1)  # (1, N + L)
        size = tokens.shape[1]
        return Drafts(tokens, [q], [size], drafts.how, Tree(parents), chain, drafts.sides)

    def settle(self, rows, k, fed, accepted, feats) -> None:
        """k: the drafter's chain (0 where lookup's drafts went alone: its state saw none)."""
        self.drafter.settle(rows, k if self.drafted else 0, fed, accepted, feats)
        self.finder.sync()

    def join(self, row, draft, held, waiting) -> None:
        self.drafter.join(row, draft, held, waiting)

    def leave(self, i, row) -> list:
        return self.drafter.leave(i, row)

    def close(self) -> None:
        self.drafter.close()
        self.finder.remember()


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
