"""Lookahead decoding (Fu et al. 2024, hao-ai-lab/LookaheadDecoding; llama.cpp's lookahead
example): the target drafts for itself by Jacobi iteration. One target pass carries two
branches, both parts of one token tree (the tree verify's mask and per-token positions):

- the verification branch: suffix lookup's proposal (lookup.rows.LookupRows) over the context,
  the lookup memory and the pool of n-grams the window produced (``Lookup.pool``);
- the lookahead branch: a window of W columns and N - 1 levels of Jacobi guesses. Level 0 is
  a chain under the root (guesses for the next W positions); the guess at level l, column i
  is the child of level l - 1's in that column, so it sees the context, level 0 up to
  column i, then its column's lower levels: its depth, i + l + 1, is its position.

After the pass, the target's argmax at the top level's guesses (what each column predicts
next) is each column's new top; every column then gives an N-gram to the pool (its levels
and that prediction), and the window drops its oldest level. While the window fills (the
first N - 2 rounds) the predictions are stacked as new levels. The guesses are never the
output: the round keeps what the target's acceptance rule keeps along any of the tree's
paths (every node a point mass), so a round is exact whatever the window holds.

A window costs W (N - 1) rows of every pass, paid back only in later rounds: where the pass
cost grows with its rows (a CPU; an Apple GPU past a few rows), auto keeps the window within
WINDOW_COST of the pass without it, down to no window (suffix lookup alone, or a plain step).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import mlx.core as mx

from ...core.stats import KChooser
from ...core.tree_acceptance import Tree
from ...errors import BadInput
from ..choosing.adaptive import TREE_MAX
from ..choosing.choosers import count_of
from ..choosing.tree_size import AUTO, TreeSize, pass_cost
from ..drafters import Proposal
from ..proposals import Drafts, RowDrafter
from .memory import Lookup
from .rows import LookupRows
from .suffix import SEP, SuffixIndex

WINDOWS = (8, 4, 2, 1)  # the window widths auto tries, widest first
WINDOW_COST = 1.1  # auto's window may make a pass at most this much slower
POOL_TOKENS = 65_536  # the pool starts afresh past this many tokens
_LIMITS = {"w": (1, 16), "n": (2, 8), "g": (1, 16)}


@dataclass(frozen=True)
class LookaheadSize:
    """``--draft lookahead`` (auto) or ``lookahead:w=W,n=N,g=G``: the window's width W and
    n-gram size N (N - 1 levels), and the most n-gram candidates G the verification branch
    proposes (G (N - 1) nodes at most). ``auto``: N = 3, W by the pass cost (WINDOWS, down
    to 0), G from suffix lookup's sizing."""

    window: int = 0
    ngram: int = 3
    pool: int = 4
    auto: bool = True

    @classmethod
    def of(cls, text: str) -> LookaheadSize:
        """Parse "lookahead" or "lookahead:" then w=, n=, g= (comma-separated, any of them;
        the others keep auto's); BadInput for anything else or a value past its limit."""
        if text == "lookahead":
            return cls()
        head, _, body = text.partition(":")
        if head != "lookahead" or not body:
            raise BadInput(f"expected 'lookahead' or 'lookahead:w=W,n=N,g=G', got {text!r}")
        got = {"w": 4, "n": 3, "g": 4}
        for part in body.split(","):
            key, _, value = part.partition("=")
            n = count_of(value)
            if key not in _LIMITS:
                raise BadInput(f"lookahead: unknown setting {key!r} (w=window, n=n-gram, g=pool)")
            lo, hi = _LIMITS[key]
            if n is None or not lo <= n <= hi:
                raise BadInput(
                    f"lookahead: {key} must be an integer from {lo} to {hi}, got {value!r}"
                )
            got[key] = n
        size = cls(got["w"], got["n"], got["g"], auto=False)
        if size.nodes > TREE_MAX:
            raise BadInput(
                f"lookahead: w={size.window}, g={size.pool} at n={size.ngram} verify {size.nodes} "
                f"tokens a pass, more than {TREE_MAX}"
            )
        return size

    @property
    def nodes(self) -> int:
        """The most drafted tokens a pass verifies: window and candidates."""
        return (self.window + self.pool) * (self.ngram - 1)

    def __str__(self) -> str:
        if self.auto:
            return "lookahead"
        return f"lookahead:w={self.window},n={self.ngram},g={self.pool}"


class LookaheadRows(RowDrafter):
    """Lookahead decoding for a lone row (see the module).

    finder: the row's lookup (its pool is set here); chooser: the k chooser (suffix lookup's
    path length, the pass-cost curve auto reads); size: the settings; width: the target's
    logit width (a sampled row's point masses span it); seed: where the first window's
    guesses are drawn from the context."""

    lone = True
    needs_k = False
    reads_argmax = True

    def __init__(self, finder: Lookup, chooser: KChooser, size: LookaheadSize, width: int,
                 seed: int = 0):  # fmt: skip
        self.finder, self.chooser, self.size, self.width = finder, chooser, size, width
        finder.pool = self.pool = SuffixIndex()
        tree = AUTO if size.auto else TreeSize(size.pool * (size.ngram - 1))
        self.lookup = LookupRows(finder, chooser, width=width, size=tree)
        self.levels: list[list[int]] = []  # the window: levels of W guesses, oldest first
        self.placed: list[int] = []  # this round's top level's nodes (ids in the pass)
        self._rng = random.Random(seed)

    def propose(self, rows, k, ks, keys) -> Drafts:
        r = rows[0]
        drafts = self.lookup.propose(rows, k, ks, keys)  # (1, V): the verification branch
        w = self._width(drafts.k) if r.stops.room > 1 else 0
        self.placed = []
        if not w:
            return drafts
        if not self.levels or len(self.levels[0]) != w:  # (re)start: guesses from the context
            self.levels = [[self._rng.choice(r.ctx) for _ in range(w)]]
        v = drafts.k
        parents = list(drafts.trees[0].parents if drafts.trees is not None else range(v))
        tokens: list[int] = []
        below = [0] * w  # each column's node in the level below (level 0: a chain)
        for level in self.levels:
            for i, t in enumerate(level):
                parents.append(below[i] if below[i] else (v + len(tokens) if i else 0))
                tokens.append(t)
                below[i] = v + len(tokens)
        self.placed = below  # the top level's nodes
        look = mx.array(tokens, dtype=mx.uint32)
        both = look[None] if not v else mx.concatenate([drafts.tokens, look[None]], axis=1)
        q = None
        if r.process is not None:  # point masses (chosen, not drawn)
            q = (mx.arange(self.width) == both[0][:, None]).astype(mx.float32)  # (N, width)
        how = drafts.how[0] if v else Proposal(source="lookup")
        chain = drafts.chain if drafts.trees is not None else v
        return Drafts.tree_of_one(both, q, how, Tree(tuple(parents)), chain)

    def observe(self, argmax: list[int]) -> None:
        """The window's next level: what the target predicts after each column's top guess;
        a full window gives each column's n-gram to the pool and drops its oldest level."""
        if not self.placed:
            return
        top = [argmax[j] for j in self.placed]
        if len(self.levels) + 1 < self.size.ngram:
            self.levels.append(top)
            return
        if len(self.pool.tokens) > POOL_TOKENS:
            self.finder.pool = self.pool = SuffixIndex()
        for i, t in enumerate(top):
            self.pool.extend([*(level[i] for level in self.levels), t, SEP])
        self.levels = [*self.levels[1:], top]

    def settle(self, rows, k, fed, accepted, feats) -> None:
        self.lookup.settle(rows, k, fed, accepted, feats)

    def close(self) -> None:
        self.lookup.close()

    def _width(self, v: int) -> int:
        """The window's width beside v verification nodes: the setting's, or for auto the
        widest in WINDOWS whose rows keep the pass within WINDOW_COST of the pass without
        them (0: none)."""
        levels = self.size.ngram - 1
        if not self.size.auto:
            return self.size.window
        cost = pass_cost(self.chooser)
        base = cost.shape(v)
        for w in WINDOWS:
            if v + w * levels <= TREE_MAX and cost.shape(v + w * levels) <= WINDOW_COST * base:
                return w
        return 0
