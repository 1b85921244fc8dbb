"""What a row drafter gives the round and the interface every one keeps (decoding/round.py
reads nothing else of a drafter): ``Drafts`` for B rows, the ``RowDrafter`` interface, and the
side leaves a drafter with a distribution at each step adds to each row's chain (a token
tree a row, drafting/choosing/tree_size.py). The drafters themselves: row_drafters.py (the draft model, the
heads, the block drafter, lone drafters and chains) and trees/rows.py (Medusa's trees, lookup
beside a drafter)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import mlx.core as mx

from ..core.sampling import Processor
from ..core.stats import Stats
from ..core.tree_acceptance import Tree
from .choosing.tree_size import SideSizer, side_parents
from .drafters import Proposal

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
    # a token tree a row (trees.py): row i's shape over its first ks[i] nodes, the
    # drafter's chain first (nodes 1..chains[i], each the child of the one before), then
    # its side leaves by depth (sides[i]; after those, a block drafter's continuations of
    # its leaves, or another drafter's nodes, SiblingRows); chain: what the drafter drafted
    # for every row, which its settle is told (0: a tree of its own, Medusa's); None: chains
    trees: list[Tree] | None = None
    chain: int = 0
    chains: list[int] = field(default_factory=list)
    sides: list[tuple[int, ...]] = field(default_factory=list)

    @property
    def k(self) -> int:
        return 0 if self.tokens is None else self.tokens.shape[1]

    @property
    def told(self) -> int:
        """What ``RowDrafter.settle`` is told was drafted: k for chains; for trees the
        drafter's chain (0: a tree of its own)."""
        return self.k if self.trees is None else self.chain

    def followed(self, i: int, path: list[int]) -> tuple[int, dict]:
        """How row i's kept path (its nodes, root excluded) went through its drafts: the
        drafts its drafter's settle counts as accepted (a tree: how far the path followed
        the chain) and, for a tree, its stats.RoundReport fields (chain, sides, side: the
        rank of the side leaf the path then took, -1 none; on_chain)."""
        if self.trees is None:
            return len(path), {}
        chain, sides, tree = self.chains[i], self.sides[i], self.trees[i]
        if not chain:  # a tree of its own (Medusa's): no chain, no side leaves
            on_chain, side, chain = len(path), -1, max(tree.depths())
        else:
            on_chain = next((j for j, u in enumerate(path) if u != j + 1), len(path))
            # a kept side leaf's rank: the leaves follow the chain, depth by depth, in rank order
            first = chain + sum(sides[:on_chain]) + 1  # its depth's first leaf
            width = sides[on_chain] if on_chain < len(sides) else 0
            took = on_chain < len(path) and first <= path[on_chain] < first + width
            side = path[on_chain] - first if took else -1
        return on_chain, {"chain": chain, "sides": sides, "side": side, "on_chain": on_chain}

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

    @classmethod
    def tree_of_one(
        cls, tokens: mx.array, q, how: Proposal, tree: Tree, chain: int = 0, sides=()
    ) -> Drafts:
        """A lone row's token tree: tokens (1, N) shaped by ``tree``, q its (N, V_q) or None,
        the drafter's chain nodes 1..chain (0: none) and its side leaves by depth."""
        return cls(tokens, [q], [tree.size], [how], [tree], chain, [chain], [tuple(sides)])


class DraftRow(Protocol):
    """What a row drafter reads and writes of a row (decoding.round.Row)."""

    ctx: list[int]
    process: Processor | None
    stats: Stats
    wants_trees: bool  # it takes side leaves where the drafter's sizer plans them
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
    # set where the target verifies trees (trees.SideSizer): a drafter with a distribution
    # at each step gives each row's chain the side leaves it plans (proposals.with_leaves)
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


def side_plan(sizer: SideSizer | None, rows, ks: list[int]) -> list[list[int]]:
    """Each row's side leaves per depth of its chain of ks[i] this round (trees.SideSizer;
    [] without a sizer: chains)."""
    return sizer.plan_rows(ks, rows)[0] if sizer is not None else []


def block_plan(sizer: SideSizer | None, rows, ks: list[int]) -> tuple[list, list]:
    """Each row's side leaves per depth and their continuations (trees.SideSizer.plan_rows:
    a block drafter's leaves may go on with the block's later positions); [], [] without a
    sizer."""
    return sizer.plan_rows(ks, rows) if sizer is not None else ([], [])


def branched(sides: list[list[int]]) -> bool:
    """Whether a plan (``side_plan``'s) adds any leaf."""
    return any(any(s) for s in sides)


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
    drafts: Drafts, sides: list[list[int]], leaves: list[list], runs: Sequence = ()
) -> Drafts:
    """Each row's chain (its first ks[i] drafts) with side leaves (trees.py), a tree a row:
    tokens (B, N), row i's chain first, then its leaves (``leaves[i]``: arrays of tokens),
    padded with zeros to the widest row; a sampled row's q (N_i, vocab) its chain's rows,
    then a point mass (one-hot) for each leaf: the leaves are the draft's top ranks, chosen,
    not drawn (tree_acceptance). A block drafter's ``leaves[i]`` end with its continuations'
    tokens (followers), ``runs[i]`` their counts; they are point masses too: tokens chosen
    for a place other than their draw's. sides: each row's leaves by depth (side_plan's)."""
    rows, qs, trees = [], [], []
    for i, (c, row_sides, row_leaves) in enumerate(zip(drafts.ks, sides, leaves, strict=True)):
        chain = drafts.tokens[i, :c]
        leaf = mx.concatenate(row_leaves) if row_leaves else chain[:0]  # (N_i - c,)
        rows.append(mx.concatenate([chain, leaf]))
        q = drafts.q[i]
        if q is not None:
            one_hot = (mx.arange(q.shape[-1]) == leaf[:, None]).astype(q.dtype)  # (N_i - c, V)
            q = mx.concatenate([q[:c], one_hot])
        qs.append(q)
        trees.append(Tree(side_parents(c, row_sides[:c], runs[i] if runs else ())))
    n = max(t.size for t in trees)
    tokens = mx.stack([mx.pad(t, [(0, n - t.shape[0])]) for t in rows])  # (B, N)
    return Drafts(tokens, qs, [t.size for t in trees], drafts.how, trees, drafts.k,
                  list(drafts.ks), [tuple(s) for s in sides])  # fmt: skip
