"""Row drafters that propose trees of their own, for a lone row: Medusa heads (their sparse
tree each round) and lookup beside another drafter (SpecInfer's several drafters in one
tree). Lookup's own tree is lookup/rows.py; the chains with side leaves are the drafters'
own (row_drafters.py, through proposals.with_leaves)."""

from __future__ import annotations

import mlx.core as mx

from ...core.stats import KChooser
from ...core.tree_acceptance import Tree
from ...errors import BadInput
from ..choosing.tree_size import OFF, TreeSize
from ..drafters import Proposal
from ..heads.medusa import MedusaDraft, tree_shape
from ..lookup.memory import Lookup
from ..proposals import BY_MODEL, Drafts, RowDrafter


class MedusaRows(RowDrafter):
    """Medusa heads (medusa.MedusaDraft) for a lone row: each round they read the target's
    final hidden state at the position that produced the row's newest token and draft a
    sparse tree, the first of their choices that fit (depth at most k, at most ``size.nodes``
    nodes; ``size`` off: the chain of each head's best). A head's top tokens are chosen, not
    drawn: a sampled row's q is a point mass at each (tree_acceptance), which keeps it exact.

    draft: the heads; vocab: the ids they may propose; size: the tree's (default off: the
    chain of each head's best)."""

    lone = True

    def __init__(self, draft: MedusaDraft, vocab: int, size: TreeSize = OFF):
        self.model, self.vocab, self.size = draft, vocab, size
        self.reads_hidden = draft.reads_hidden
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
        mx.async_eval(tokens)
        if tree is None:  # trees off: the chain of each head's best
            return Drafts(tokens[None], [q], [tokens.shape[0]], [BY_MODEL])
        return Drafts.tree_of_one(tokens[None], q, BY_MODEL, tree)  # (its own tree: no chain)

    def settle(self, rows, k, fed, accepted, feats) -> None:
        """The heads read next the target's state at the row's last kept position: feats
        (1, kept..., F) hold the pass's kept positions in order (a tree's path)."""
        r = rows[0]
        kept = len(r.ctx) - 1 - fed[0]
        if feats is not None and kept > 0:
            r.waiting, r.draft_held = feats[0, kept - 1 : kept], len(r.ctx) - 1


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
        n, tree = drafts.k, drafts.trees[0] if drafts.trees is not None else Tree.chain(drafts.k)
        chain, sides = (drafts.chain, drafts.sides[0]) if drafts.trees is not None else (n, ())
        parents = tree.parents
        parents += (0,) + tuple(range(n + 1, n + len(found)))  # lookup's branch, under the root
        q = drafts.q[0]
        if q is not None:  # a sampled row: its drafter's q, then a point mass at each of lookup's
            q = mx.pad(q, [(0, 0), (0, self.width - q.shape[-1])])
            q = mx.concatenate([q, (mx.arange(self.width) == look[:, None]).astype(q.dtype)])
        tokens = mx.concatenate([drafts.tokens, look[None]], axis=1)  # (1, N + L)
        return Drafts.tree_of_one(tokens, q, drafts.how[0], Tree(parents), chain, sides)

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
