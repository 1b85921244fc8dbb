"""Prompt lookup as a row drafter for a lone row: suffix lookup's tree of continuations
where the target verifies trees, else its likeliest path, or the n-gram chain."""

from __future__ import annotations

import mlx.core as mx

from ...core.stats import KChooser
from ...core.tree_acceptance import Tree
from ...errors import BadInput
from ..choosing.adaptive import SUFFIX_MAX, TREE_MAX
from ..choosing.tree_size import OFF, TreeSize, pass_cost, paying
from ..drafters import Proposal
from ..proposals import Drafts, RowDrafter
from .memory import Lookup
from .suffix import Speculation

SPEC_DEPTH = 32  # the deepest node suffix lookup proposes
MATCH_BUCKET = 8  # match lengths from this up are learned as one (stats.KChooser.lookup_length)


class LookupRows(RowDrafter):
    """Prompt lookup (lookup.Lookup) for a lone row. "suffix": suffix lookup's tree of
    continuations (suffix.py) where the target verifies trees (``size`` not off), else its
    likeliest path; "ngram": the continuation of the most recent occurrence of the longest
    match (the lookup before suffix trees). How much of the path to verify is the chooser's
    (stats.KChooser.lookup_length, learned by match length), weighed against the draft
    model's k where one follows (``fallback``) or a plain step; a tree then adds the other
    continuations, best first: up to ``size.nodes`` for a fixed size, while they pay by the
    cost curve for auto (trees.paying). Every node is chosen, not drawn: a sampled row's q
    is a point mass at each (tree_acceptance), which keeps it exact.

    finder: the row's lookup; chooser: the k chooser; fallback: a draft model drafts when
    lookup declines; method: "suffix" or "ngram" (kinds.LookupKind.method); width: the target's logit width (a
    sampled row's point masses span it); size: the tree of
    continuations suffix lookup proposes (default off: its likeliest path)."""

    lone = True
    needs_k = False

    def __init__(self, finder: Lookup, chooser: KChooser, *, fallback: bool = False,
                 method: str = "suffix", width: int = 0, size: TreeSize = OFF):  # fmt: skip
        self.finder, self.chooser, self.fallback = finder, chooser, fallback
        self.method, self.width, self.size = method, width, size

    def propose(self, rows, k, ks, keys) -> Drafts:
        if len(rows) != 1:
            raise BadInput(
                f"prompt lookup drafts for a lone request only, not for {len(rows)} rows"
            )
        r = rows[0]
        if self.method == "ngram":
            match, found = self.finder.find(r.stops.room)
            found = found[: self.chooser.lookup_length(match, len(found), k, self.fallback)]
            return self._chain(found, match)
        depth = min(r.stops.room, SPEC_DEPTH)
        # (a budget of TREE_MAX even for a chain: best first, branches may come before the
        # likeliest path's deeper nodes)
        spec = self.finder.speculate(depth, TREE_MAX)
        chain = spec.chain()
        match = min(spec.match, MATCH_BUCKET)
        longest = SUFFIX_MAX  # (suffix lookup's proposals may run longer than n-gram's)
        chain = chain[: self.chooser.lookup_length(match, len(chain), k, self.fallback, longest)]
        if not (self.size.off or self.size.auto):
            chain = chain[: self.size.nodes]  # a fixed size caps the tokens a pass verifies
        tokens, parents = self._tree(spec, chain, r.process is None)
        if len(tokens) == len(chain):
            return self._chain(tokens, match)
        look = mx.array(tokens, dtype=mx.uint32)
        q = None
        if r.process is not None:  # point masses (chosen, not drawn)
            q = (mx.arange(self.width) == look[:, None]).astype(mx.float32)  # (N, width)
        how = Proposal(source="lookup", match=match)
        return Drafts.tree_of_one(look[None], q, how, Tree(parents), len(chain))

    def settle(self, rows, k, fed, accepted, feats) -> None:
        self.finder.sync()  # the row's ctx is the index's own list: index what joined it

    def close(self) -> None:
        self.finder.remember()

    def _chain(self, found: list[int], match: int) -> Drafts:
        if not found:
            return Drafts.none(1)
        return Drafts.one(Proposal(mx.array(found, dtype=mx.uint32), None, "lookup", match=match))

    def _tree(
        self, spec: Speculation, chain: list[int], greedy: bool
    ) -> tuple[list[int], tuple[int, ...]]:
        """The proposal's tokens and parents: the chain's nodes first (1..n), then the other
        nodes no deeper than the chain, best first, as many as the size allows or pay (greedy:
        the row decodes greedily, so a cheaper wider pass may be filled: trees.paying)."""
        n = len(chain)
        if self.size.off or not n:
            return [spec.tokens[j - 1] for j in chain], tuple(range(n))
        place = {0: 0, **{j: i + 1 for i, j in enumerate(chain)}}  # spec node -> ours
        depth = {0: 0, **{j: i + 1 for i, j in enumerate(chain)}}
        rest: list[int] = []
        for j, parent in enumerate(spec.parents, start=1):
            if j not in place and parent in depth and depth[parent] < n:
                depth[j] = depth[parent] + 1
                rest.append(j)
        room = self.size.nodes - n
        if self.size.auto:
            reach = 1.0 + sum(spec.probs[j - 1] for j in chain)
            values = [spec.probs[j - 1] for j in rest[:room]]
            room = paying(pass_cost(self.chooser), n, reach, values, dips=greedy)
        for j in rest[: max(room, 0)]:
            place[j] = len(place)
        nodes = sorted(place, key=place.get)[1:]  # ours, in order
        parents = tuple(place[spec.parents[j - 1]] for j in nodes)
        return [spec.tokens[j - 1] for j in nodes], parents
