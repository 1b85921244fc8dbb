"""What a row drafter gives the round and the interface every one keeps (decoding/round.py
reads nothing else of a drafter): ``Drafts`` for B rows, the ``RowDrafter`` interface, and the
side leaves a drafter with a distribution at each step adds to a lone row's chain (a token
tree, drafting/trees.py). The drafters themselves: row_drafters.py (the draft model, the
heads, the block drafter, lone drafters and chains) and tree_rows.py (Medusa's trees, lookup
beside a drafter)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx

from ..core.sampling import Processor
from ..core.stats import Stats
from ..core.tree_acceptance import Tree
from .drafters import Proposal
from .trees import SideSizer, side_parents

BY_MODEL = Proposal(source="model")  # how a row drafter's drafts were made: nothing to add
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
    # nodes after the chain; after those, a block drafter's continuations of its leaves, or
    # another drafter's nodes, SiblingRows); None: the drafts are a chain
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
        return cls(tokens, q, list(ks), [BY_MODEL] * len(ks))


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
    requests alone); ``reads_argmax``: after a tree round, ``observe`` gets the target's
    argmax at the root and at every node (lookahead's Jacobi window learns from them)."""

    reads_hidden: tuple = ()
    needs_k: bool = True
    lone: bool = False
    reads_argmax: bool = False
    # set for a lone row whose target verifies trees (trees.SideSizer): a drafter with a
    # distribution at each step gives its chain the side leaves it plans (proposals.with_leaves)
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

    def observe(self, argmax: list[int]) -> None:
        """A tree round's target argmax at the root and each node (N + 1), before ``settle``
        (asked only where ``reads_argmax``)."""

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


def side_plan(sizer: SideSizer | None, rows, k: int) -> list[int]:
    """A lone row's side leaves per depth this round (trees.SideSizer); none for a batch."""
    return sizer.plan(k, rows[0].stats) if sizer is not None and len(rows) == 1 else []


def block_plan(sizer: SideSizer | None, rows, k: int) -> tuple[list[int], list[int]]:
    """A lone row's side leaves per depth and their continuations (trees.SideSizer.plan_runs:
    a block drafter's leaves may go on with the block's later positions); none for a batch."""
    if sizer is None or len(rows) != 1:
        return [], []
    return sizer.plan_runs(k, rows[0].stats)


def followers(chain: mx.array, sides: list[int], runs: list[int]) -> list[mx.array]:
    """The tokens of each leaf's continuation, in side_parents' order: after a leaf at depth
    d, the chain's own tokens at depths d + 1, d + 2, ... (a block's later positions, drafted
    from the context alone). chain (k,): the row's chain."""
    depths = [d for d, m in enumerate(sides) for _ in range(m)]  # each leaf's 0-based depth
    return [chain[d + 1 : d + 1 + n] for d, n in zip(depths, runs, strict=False) if n]


def next_best(scores: mx.array, chosen: mx.array, m: int) -> mx.array:
    """The m best ids by ``scores`` (vocab,) other than ``chosen`` (the chain's draw), best
    first (m,): the side leaves at a step."""
    top = mx.argpartition(-scores, kth=m)[: m + 1]  # the m + 1 best, in no order
    value = mx.where(top == chosen, -mx.inf, scores[top])  # the chain's own token last
    return top[mx.argsort(-value)[:m]]


def with_leaves(
    drafts: Drafts, k: int, sides: list[int], leaves: list, runs: Sequence[int] = ()
) -> Drafts:
    """A lone row's chain of k with side leaves (trees.py): tokens (1, N), the chain's
    first; a sampled row's q (N, vocab) the chain's rows, then a point mass (one-hot) for each
    leaf: the leaves are the draft's top ranks, chosen, not drawn (tree_acceptance). A block
    drafter's ``leaves`` end with its continuations' tokens (followers), ``runs`` their
    counts; they are point masses too: tokens chosen for a place other than their draw's."""
    leaf = mx.concatenate(leaves)  # (N - k,)
    tokens = mx.concatenate([drafts.tokens, leaf[None]], axis=1)  # (1, N)
    q = drafts.q[0]
    if q is not None:
        one_hot = (mx.arange(q.shape[-1]) == leaf[:, None]).astype(q.dtype)  # (N - k, vocab)
        q = mx.concatenate([q, one_hot])
    n = tokens.shape[1]
    tree = Tree(side_parents(k, sides, runs))
    return Drafts(tokens, [q], [n], drafts.how, tree, k, tuple(sides))
