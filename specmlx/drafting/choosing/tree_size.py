"""How wide a round's token tree is: the ``--tree`` setting, parsed once, and the sizer that
picks each round's side leaves.

The tree a drafter proposes here is its chain (k drafts, node i the child of node i - 1)
with side leaves: at each depth d, the draft's next-best tokens after the chain's node
d - 1 (its top-m at that step, the chain's own token left out). They cost the draft
nothing (the step's distribution is already there) and a row each of the target's pass.
A side leaf pays when the chain's token at its depth is rejected and the target's token is
that leaf's: the round then keeps the leaf and the target's token after it, one more than
the chain's correction alone.

The sizer's model, per leaf at depth d (1-based) and rank s among its siblings (0: the
draft's best after the chain's token):

    value(d, s) = P(the chain reaches depth d) * P(the chain's token at d is rejected)
                  * h_s,  h_s = P(rank s is the target's token | the chain's was rejected)

with P(reach d) = a_1 ... a_(d-1), each a learned by depth, and h_s learned by rank (the
row's stats.Stats: a generation learns its own, from a prior).

A block drafter (DFlash) drafts every position of its block at once, each from the context
alone, so its later positions' tokens serve under a side leaf as well as under the chain, at
no cost to the draft. Its leaves may continue (DDTree's branches, sized here by the learned
rates rather than by the round's own probabilities, which the host would have to read): the
m-th token after leaf (d, s) is the block's token at depth d + m, worth

    value(d, s, m) = value(d, s) * a_(d+1) ... a_(d+m).

A fixed
``--tree N`` adds the most valuable leaves up to N nodes; ``auto`` adds them while expected
tokens per second grow, reading the k chooser's measured pass-cost curve (a chain, k = 0
side leaves, when no leaf pays).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ...core.stats import KChooser, Stats
from ...errors import BadInput
from .adaptive import TREE_MAX, AdaptiveK
from .choosers import count_of
from .cost_curve import CostCurve

AUTO_NODES = 16  # auto's cap on a tree's nodes
EXPAND = "expand:"  # --tree expand:N, EAGLE-2's dynamic tree of N nodes
SIDE_MAX = 4  # side leaves per depth: the draft's ranks 2 to 5 at most (a cap, not measured)
# (hits, trials) before any round: a chain's draft passes half the time; a side leaf holds
# the target's token a fifth of the time where the chain's was rejected
_DEPTH_PRIOR, _RANK_PRIOR = (1.0, 2.0), (1.0, 5.0)


@dataclass(frozen=True)
class TreeSize:
    """The ``--tree`` setting, parsed once (``TreeSize.of``): ``nodes`` 0 is off (chains),
    ``auto`` sizes each round by the cost model up to AUTO_NODES, a number N caps the drafted
    tokens one pass verifies and fills them with the most valuable leaves; ``expand`` ("expand:N")
    grows a draft model's tree of N by EAGLE-2's expansion instead (drafting/trees/expand.py)."""

    nodes: int = 0
    auto: bool = False
    expand: bool = False

    @classmethod
    def of(cls, value: TreeSize | int | str, name: str = "tree") -> TreeSize:
        """'off', 'auto', an integer from 1 to TREE_MAX (or its text), 'expand:' and such an
        integer, or a TreeSize as it is; BadInput otherwise, naming the setting as ``name``
        (the CLI's "--tree")."""
        if isinstance(value, TreeSize):
            return value
        if value == "off":
            return cls()
        if value == "auto":
            return cls(AUTO_NODES, auto=True)
        expand = isinstance(value, str) and value.startswith(EXPAND)
        n = count_of(value[len(EXPAND) :] if expand else value)
        if n is None or not 1 <= n <= TREE_MAX:
            raise BadInput(
                f"{name} must be 'off', 'auto', an integer from 1 to {TREE_MAX} or "
                f"'{EXPAND}' and one, got {value!r}"
            )
        return cls(n, expand=expand)

    @property
    def off(self) -> bool:
        return self.nodes == 0

    @property
    def value(self) -> int | str:
        """As JSON and models.toml write it: "off", "auto", the int or "expand:" and it."""
        if self.expand:
            return f"{EXPAND}{self.nodes}"
        return "off" if self.off else "auto" if self.auto else self.nodes

    def __str__(self) -> str:
        return str(self.value)


OFF, AUTO = TreeSize(), TreeSize(AUTO_NODES, auto=True)


def side_parents(k: int, sides: list[int], runs: Sequence[int] = ()) -> tuple[int, ...]:
    """The parents of a chain of k with ``sides[d]`` side leaves at depth d + 1: the chain
    is nodes 1..k (node i's parent i - 1), then each depth's leaves in rank order, children
    of the chain's node at the depth above (the root for depth 1); then, where ``runs`` (one
    count per leaf, in that order) says so, each leaf's continuation, node after node."""
    parents = list(range(k))
    for d, m in enumerate(sides):
        parents += [d] * m
    for leaf, n in enumerate(runs, start=k + 1):
        at = leaf
        for _ in range(n):
            parents.append(at)
            at = len(parents)  # (the node just added)
    return tuple(parents)


class SideSizer:
    """Each round's side leaves per depth (see the module), from what the row's statistics
    learned so far (stats.Stats: the chain's acceptance by depth, the leaves' by rank, with
    a prior before any round).

    size: the setting (not off); chooser: the k chooser, whose pass-cost curve and draft
    timing ``auto`` reads where it has them (``pass_cost``: an AdaptiveK's, or the probe of
    a FixedK); otherwise a pass is taken to cost 10% more a token (CostCurve's guess).
    runs: leaves may continue (a block drafter's: see the module); dips: a lone row may fill
    a cheaper wider pass (greedy: CostCurve.tree_curve; a sampled round's acceptance is not
    probed)."""

    def __init__(self, size: TreeSize, chooser: KChooser, *, runs: bool = False,
                 dips: bool = True):  # fmt: skip
        self.size, self.chooser, self.runs, self.dips = size, chooser, runs, dips

    def plan(self, k: int, stats: Stats) -> list[int]:
        """Side leaves at each depth 1..k for a chain of k (all 0: a chain). stats: the row's
        statistics so far."""
        return self._choose(k, stats)[0]

    def plan_runs(self, k: int, stats: Stats) -> tuple[list[int], list[int]]:
        """The side leaves at each depth, and each leaf's continuation (one count per leaf,
        depth by depth, in rank order: side_parents' ``runs``; all 0 unless ``runs``)."""
        sides, runs, _ = self._choose(k, stats)
        return sides, runs

    def plan_rows(
        self, ks: Sequence[int], rows: Sequence
    ) -> tuple[list[list[int]], list[list[int]]]:
        """Each row's side leaves by depth and their continuations (``plan_runs``'s), for
        chains of ks[i]. rows: each row's ``stats``, and ``tree``: whether it takes leaves.

        A lone row's plan is ``plan_runs``'s, and so is a sampled row's in any batch: its
        draws depend on its tree, and a seeded request with a fixed k must draw the same
        tokens alone and in whatever batch it joins, on any machine; so such a row reads the
        guessed curve, never a measured one (``_seeded``).

        A batch's rows share one pass, as wide as its widest row (core.tree_pass pads the
        others), so every greedy row that takes leaves gets the same count, its own best;
        for auto, the count that maximizes the greedy rows' expected tokens per second, a
        pass over B rows of w tokens costing what the pass-cost curve says of B * w tokens
        (every row's tokens share the reads of the weights). The drafting time is left
        out: it does not change with the leaves, and leaving it out only ever picks fewer."""
        drawn = [r.process is not None for r in rows]
        if len(rows) == 1:
            cost = _seeded(rows[0])
            sides, runs, _ = self._choose(ks[0], rows[0].stats, self.dips and not drawn[0], cost)
            return [sides], [runs]
        plans = [self._choose(ki, r.stats, False, _seeded(r)) if d and r.wants_trees else None
                 for ki, r, d in zip(ks, rows, drawn, strict=True)]  # fmt: skip
        greedy = [i for i, d in enumerate(drawn) if not d]
        if greedy:
            k = max(ks[i] for i in greedy)
            ranked = {i: self._ranked(ks[i], rows[i].stats, rows[i].wants_trees) for i in greedy}
            most = min(max(0, self.size.nodes - k), max(len(n) for n, _ in ranked.values()))
            dips = self.dips and not any(drawn)
            auto = self.size.auto
            n = self._batch_count(k, list(ranked.values()), most, dips) if auto else most
            for i, (nodes, _) in ranked.items():
                plans[i] = self._take(ks[i], nodes[:n])
        plans = [p or ([0] * ki, [], 0.0) for ki, p in zip(ks, plans, strict=True)]
        return [p[0] for p in plans], [p[1] for p in plans]

    def gain(self, k: int, stats: Stats) -> tuple[float, int]:
        """What the plan for a chain of k adds: (expected tokens, drafted tokens verified);
        an adaptive k chooser weighs each k with it (AdaptiveK.widen). stats: the row's."""
        sides, runs, value = self._choose(k, stats)
        return value, sum(sides) + sum(runs)

    def _choose(
        self, k: int, stats: Stats, dips: bool | None = None, cost: CostCurve | None = None
    ) -> tuple[list[int], list[int], float]:
        """(side leaves by depth, continuations by leaf, their summed value) for a chain of k;
        dips: a cheaper wider pass may be filled (None: ``self.dips``); cost: the curve auto
        reads (None: the chooser's, ``pass_cost``)."""
        if k <= 0 or self.size.nodes - k <= 0:
            return [0] * max(k, 0), [], 0.0
        nodes, chain = self._ranked(k, stats)
        room = min(self.size.nodes - k, len(nodes))
        take = room  # a fixed size: all the room; auto: the count that pays most
        if self.size.auto:
            values = [n[0] for n in nodes[:room]]
            dips = self.dips if dips is None else dips
            take = paying(cost or pass_cost(self.chooser), k, chain, values, True, dips)
        return self._take(k, nodes[:take])

    def _ranked(self, k: int, stats: Stats, branches: bool = True) -> tuple[list[tuple], float]:
        """Every leaf and follower a chain of k could take, best first, as (value, depth,
        rank, m: the m-th follower of leaf (depth, rank); 0 the leaf), and the chain's own
        expected tokens (1 + a_1 + a_1 a_2 + ...). branches: False gives no nodes."""
        a = [_rate(stats.depth_accepted, stats.depth_tried, d, _DEPTH_PRIOR) for d in range(k)]
        # each rank's rate: the generation's own, from what the chooser's earlier tree rounds
        # kept (else _RANK_PRIOR): a weak draft's leaves, learned afresh in each short run,
        # filled a cheap wide pass run after run (BENCHMARKS.md, the distilled pair)
        learned = self.chooser.accept if isinstance(self.chooser, AdaptiveK) else None
        h = [_rate(stats.rank_kept, stats.rank_tried, s,
                   (learned and learned.rank_prior(s, _RANK_PRIOR[1])) or _RANK_PRIOR)
             for s in range(SIDE_MAX)]  # fmt: skip
        reach, chain, nodes = 1.0, 1.0, []
        for d in range(k):
            for s in range(SIDE_MAX if branches else 0):
                value = reach * (1.0 - a[d]) * h[s]
                nodes.append((value, d, s, 0))
                for m in range(1, k - d if self.runs else 1):
                    value *= a[d + m]
                    nodes.append((value, d, s, m))
            reach *= a[d]
            chain += reach
        # best first; a follower is worth less than what it follows, so any prefix of this
        # order holds every chosen node's parent (within a depth, rank order is value order)
        nodes.sort(key=lambda n: (-n[0], n[3], n[2]))
        return nodes, chain

    @staticmethod
    def _take(k: int, nodes: list[tuple]) -> tuple[list[int], list[int], float]:
        """The plan that takes ``nodes`` (a prefix of ``_ranked``'s): (side leaves by depth,
        continuations by leaf, their summed value)."""
        sides, follow = [0] * max(k, 0), {}
        for _, d, s, m in nodes:
            if m == 0:
                sides[d] += 1
            else:
                follow[d, s] = m
        runs = [follow.get((d, s), 0) for d in range(k) for s in range(sides[d])]
        return sides, runs if any(runs) else [], sum(n[0] for n in nodes)

    def _batch_count(
        self, k: int, ranked: list[tuple[list[tuple], float]], most: int, dips: bool
    ) -> int:
        """How many leaves each row of a batch takes (auto): see ``plan_rows``. ranked: each
        row's ``_ranked``; most: the cap; dips: every row greedy (CostCurve.tree_curve)."""
        cost = pass_cost(self.chooser)
        b, tokens = len(ranked), sum(chain for _, chain in ranked)
        curve = cost.tree_curve(b * (k + 1 + most) - 1, dips)  # by a pass's tokens, less one
        best, best_rate = 0, 0.0
        for n in range(most + 1):
            tokens += sum(nodes[n - 1][0] for nodes, _ in ranked if 0 < n <= len(nodes))
            rate = tokens / curve[b * (k + 1 + n) - 1]
            if rate > best_rate:
                best, best_rate = n, rate
        return best


def paying(
    cost: CostCurve, k: int, tokens: float, values: list[float], drafting=False, dips=True
) -> int:
    """How many more nodes (their values: expected tokens each adds, best first) a pass that
    already verifies k drafts for ``tokens`` expected tokens should verify: the count that
    maximizes expected tokens per second, by the pass-cost curve ``cost`` (a chooser's:
    ``pass_cost``). drafting: add the k drafts' drafting time (a model's, where timed;
    lookup's is free); dips: a greedy row's (CostCurve.tree_curve)."""
    curve = cost.tree_curve(TREE_MAX, dips)  # seconds by drafts verified (a pass's, untimed)
    spent = k * (cost.t_draft or 0.0) if drafting else 0.0
    best, best_rate, gained = 0, 0.0, 0.0
    for n in range(min(len(values), TREE_MAX - k) + 1):
        gained += values[n - 1] if n else 0.0
        t = spent + curve[k + n]
        rate = (tokens + gained) / t if t > 0 else 0.0
        if rate > best_rate:
            best, best_rate = n, rate
    return best


def _seeded(row) -> CostCurve | None:
    """The guessed curve for a sampled row with a fixed k (its text then depends on its seed
    and settings alone, not on a probe that differs by machine and run); None for the rest:
    the chooser's curve."""
    drawn = row.process is not None
    return CostCurve() if drawn and not row.k_setting.auto else None


def pass_cost(chooser: KChooser) -> CostCurve:
    """The pass-cost curve a tree is sized by: the chooser's own (an AdaptiveK's, learned from
    rounds; a FixedK's, the target's probe where the session ran one), else CostCurve's
    guessed shape (+10% a token; SharedK over ranks: every rank plans alike)."""
    cost = getattr(chooser, "cost", None)
    return cost if isinstance(cost, CostCurve) else CostCurve()


def _rate(hits: list[int], tries: list[int], i: int, prior: tuple[float, float]) -> float:
    """hits[i] / tries[i] with ``prior`` (hits, tries) added (counts may be shorter than i)."""
    h, t = (hits[i], tries[i]) if i < len(tries) else (0, 0)
    return (h + prior[0]) / (t + prior[1])
