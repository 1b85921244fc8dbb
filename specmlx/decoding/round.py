"""One speculative round for B >= 1 rows: propose -> verify -> accept -> keep -> settle.

A lone generation (engine.py) is a round of one row; a batch (batch.py) is a round of B
rows. Both call ``one_round``: there is no second round. What differs is around it:

- who verifies (a ``Verifier``): a lone generation's target is its Cursor (every cache kind,
  a queued plain pass); a batch's is the rows' batch caches (core.rows) and its recorder;
- who drafts (a drafting.proposals.RowDrafter): the draft model, a chained head (MTP,
  EAGLE-3), a block drafter (DFlash), for any B; lookup, the lookup-first chain, a draft
  model with per-token stopping, or one whose caches have no batch kind, for one row only
  (row_drafters.LoneRows: a batch refuses them by name when a row joins).

One lazy graph and one host sync a round (a second, when the driver asks to time the
draft apart). A sampled row's keys come from its seed and its length (sampling.round_keys),
so its randomness is its own whatever rows run beside it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import mlx.core as mx

from ..core.acceptance import Rule, accept_proposal, point_mass
from ..core.sampling import Processor, round_keys
from ..core.stats import RoundReport, Stats, TokenEvent
from ..core.tree_acceptance import Tree, accept_tree, accept_tree_greedy
from ..drafting.choosing.choosers import K
from ..drafting.proposals import Drafts, RowDrafter
from .stops import Stops


@dataclass
class Row:
    """One sequence in a round: its context (prompt + generated), the k it asked for, its
    stops, seed, sampler, acceptance rule and statistics. ``done``: it reached a stop."""

    ctx: list[int]
    k: K  # (a batch: a fixed k is the row's own; "auto" follows what the batch's owner picks)
    stops: Stops
    seed: int
    process: Processor | None
    rule: Rule
    stats: Stats = field(default_factory=Stats)
    done: bool = False
    drafts: bool = True  # False: it asked for no draft (plain steps in a batch's passes)
    tree: bool = False  # it asked for trees: side leaves where the sizer plans them, or grown
    draft_held: int = 0  # how much of ctx the draft's row holds (a prefix of ctx[:-1])
    # a head's row: the target's features at positions draft_held.. it has not been fed
    # yet (m, F), the pairs' hidden states; None: none (a one-token prompt's first round)
    waiting: mx.array | None = None
    own_cache: list | None = None  # a block drafter's row: its context cache, its own


class Verifier(Protocol):
    """The target's side of a round."""

    def verify(
        self, rows: Sequence[Row], drafts: mx.array | None
    ) -> tuple[mx.array, mx.array | None]:
        """The pass over each row's last token and its drafts (B, k) (None: k = 0). Returns
        logits (B, k + 1, V) and, for a drafter that reads them, the tapped features
        (B, k + 1, F); both lazy."""
        ...

    def queue(self, token: mx.array) -> None:
        """Feed a lone row's next token (1,) now, for the next plain round."""
        ...

    def keep(self, rows: Sequence[Row], fed: list[int], kept: list[int]) -> None:
        """Each row's caches to its ctx[:-1]: row i's pass started at fed[i] and it kept
        kept[i] of the k + 1 tokens fed."""
        ...

    def verify_tree(
        self, rows: Sequence[Row], nodes: mx.array, trees: Sequence[Tree]
    ) -> tuple[mx.array, mx.array | None]:
        """The pass over each row's last token and its token tree's nodes (B, N; row i's
        first trees[i].size, then pads): logits (B, N + 1, V) and, for a drafter that reads
        them, the tapped features (B, N + 1, F) in pass order; both lazy."""
        ...

    def keep_path(self, rows: Sequence[Row], paths: Sequence[list[int]]) -> None:
        """After ``verify_tree``: row i keeps its pass's paths[i] (0 the root, then its kept
        path)."""
        ...


def one_round(
    rows: Sequence[Row],
    target: Verifier,
    drafter: RowDrafter | None,
    asked: Sequence[int],
    *,
    timed: bool = False,
    plain_next: Callable[[], bool] | None = None,
) -> list[tuple[list[TokenEvent], RoundReport]]:
    """One round for every row; per row its new token events and its RoundReport (already
    recorded in its stats). A row that reached a stop is marked ``done``.

    rows: the rows (none done); target: the verifier; drafter: what drafts (None: plain
    steps); asked: each row's k, capped here by its room and the drafter's limit; timed: a
    second host sync after drafting, to time the draft apart; plain_next: a lone row's
    chooser says the next round is plain too: queue that pass before this one is read."""
    t0 = time.perf_counter()
    ks = [0] * len(rows)  # a row near its budget verifies fewer (the same keys as alone)
    if drafter is not None:
        for i, (r, ki) in enumerate(zip(rows, asked, strict=True)):
            top = drafter.limit(r)
            ks[i] = max(0, min(ki, r.stops.room, ki if top is None else top)) * r.drafts
    k = max(ks)  # no more drafts in the pass than any row can use
    keys = [
        round_keys(r.seed, len(r.ctx)) if r.process is not None else (None,) * 3 for r in rows
    ]  # fmt: skip (per row: draft, u, draw)
    drafts = Drafts.none(len(rows))
    if drafter is not None and (k or not drafter.needs_k):
        drafts = drafter.propose(rows, k, ks, [kk[0] for kk in keys])
    k, ks = drafts.k, drafts.ks
    draft_s = None  # a model's drafting timed apart (lookup's costs nothing to time)
    if timed and any(h.source == "model" and h.draft_s is None for h in drafts.how):
        mx.eval(drafts.tokens, *[q for q in drafts.q if q is not None])
        draft_s = time.perf_counter() - t0
    if drafts.trees is not None:  # a token tree a row: their own accept and keep
        return _tree_round(rows, target, drafter, drafts, keys, t0, draft_s)
    logits, feats = target.verify(rows, drafts.tokens)  # (B, k + 1, V), (B, k + 1, F)
    plain = not k and all(r.process is None for r in rows)  # greedy plain steps
    if plain:  # the argmax alone (B,): as cheap as target-only decoding
        out = nxt = mx.argmax(logits[:, 0], axis=-1).astype(mx.uint32)
    else:
        outs = []
        for i, r in enumerate(rows):  # each row by its own rule, sampler, keys and k
            ki = ks[i]
            di = drafts.tokens[i, :ki] if k else mx.zeros((0,), dtype=mx.uint32)
            qi = drafts.q[i][:ki] if drafts.q[i] is not None else None
            n, nxt = accept_proposal(logits[i, : ki + 1], di, qi, r.process, r.rule, *keys[i][1:])
            pad = [mx.zeros((k - ki,), dtype=mx.uint32)] if k > ki else []
            outs.append(mx.concatenate([n.astype(mx.uint32).reshape(1), di, nxt.reshape(1), *pad]))
        out = outs[0][None] if len(outs) == 1 else mx.stack(outs)  # (B, k + 2)
    if plain_next is not None and not k and rows[0].stops.room > 0 and plain_next():
        mx.async_eval(out)  # (a lone row) its next plain pass runs while the host reads
        target.queue(nxt)
    got = out.tolist()  # the round's one host sync
    if plain:  # as (accepted, token) rows
        got = [[0, t] for t in got]
    # keep: each row its accepted drafts and the target's token, up to a stop
    fed, kept, accepted, new = [], [], [], []
    for r, ki, (n, *tokens) in zip(rows, ks, got, strict=True):
        fed.append(len(r.ctx) - 1)  # where this round's pass started, in both models
        accepted.append(n)
        add, reason = r.stops.cut(tokens[:n] + [tokens[ki]])
        r.ctx += add
        r.stats.finish_reason, r.done = reason, bool(reason)
        kept.append(len(r.ctx) - 1 - fed[-1])  # of the k + 1 tokens the target was fed
        new.append(add)
    target.keep(rows, fed, kept)
    if drafter is not None:  # each row's draft state to what its ctx confirms
        drafter.settle(rows, k, fed, accepted, feats)
    seconds = time.perf_counter() - t0
    return [_report(r, ks[i], accepted[i], new[i], drafts.how[i], seconds, draft_s)
            for i, r in enumerate(rows)]  # fmt: skip


def _report(r: Row, k: int, accepted: int, new: list[int], how, seconds: float, draft_s,
            **tree) -> tuple[list[TokenEvent], RoundReport]:  # fmt: skip
    """A row's round, recorded in its stats: its token events and its RoundReport. how: its
    drafters.Proposal; tree: a tree round's chain, sides and side (stats.RoundReport)."""
    report = RoundReport(
        k, accepted, seconds, how.draft_s if how.draft_s is not None else draft_s,
        how.match, how.confidences, how.made, **tree,
    )  # fmt: skip
    r.stats.record(report, r.stops.count)
    return [TokenEvent(t, j < accepted) for j, t in enumerate(new)], report


def _tree_round(rows: Sequence[Row], target: Verifier, drafter: RowDrafter, drafts: Drafts,
                keys: list, t0: float, draft_s) -> list[tuple[list[TokenEvent], RoundReport]]:  # fmt: skip
    """The rest of a round over a token tree a row (drafts.trees; row i's first ks[i] of
    the N nodes): one pass over every row's root and nodes, each row's kept path by the
    tree's rule (tree_acceptance: the longest argmax path, or multi-step speculative
    sampling), its keys and values kept contiguous, then the drafter settled on how far
    each path followed its chain."""
    nodes = drafts.tokens  # (B, N)
    logits, feats = target.verify_tree(rows, nodes, drafts.trees)  # (B, N + 1, V), (B, N + 1, F)
    outs = []
    for i, (r, tree) in enumerate(zip(rows, drafts.trees, strict=True)):
        n, mine = tree.size, nodes[i, : tree.size]  # (a row's pads are never read)
        if tree.parents == tuple(range(n)):  # a chain (other rows branch): its own rule, so
            # a seeded row draws in a batch's tree round what it draws in a chain round
            q = drafts.q[i][:n] if drafts.q[i] is not None else None
            node, nxt = accept_proposal(
                logits[i, : n + 1], mine, q, r.process, r.rule, *keys[i][1:]
            )
        elif r.process is None:
            node, nxt = accept_tree_greedy(logits[i, : n + 1], mine, tree)
        else:
            p, q = r.process(logits[i, : n + 1]), drafts.q[i]  # (n + 1, V), (n, V_q)
            # q None: every node a point mass (a grown tree's: chosen, not drawn)
            q = q if q is not None else point_mass(mine, p.shape[-1]).astype(p.dtype)
            if q.shape[-1] < p.shape[-1]:  # a narrower draft: its q is 0 past its ids
                q = mx.pad(q, [(0, 0), (0, p.shape[-1] - q.shape[-1])])
            u = mx.random.uniform(shape=(n,), key=keys[i][1])
            node, nxt = accept_tree(p, q, mine, tree, u, keys[i][2])
        outs.append(mx.concatenate([node.astype(mx.uint32).reshape(1), nxt.reshape(1), nodes[i]]))
    # a drafter that learns from the pass (lookahead's Jacobi window, a lone row's): the
    # target's argmax at the root and every node (N + 1,), read in the same sync
    if drafter.reads_argmax:
        outs[0] = mx.concatenate([outs[0], mx.argmax(logits[0], axis=-1).astype(mx.uint32)])
    got = outs[0][None].tolist() if len(outs) == 1 else mx.stack(outs).tolist()  # one sync
    if drafter.reads_argmax:
        drafter.observe(got[0][2 + nodes.shape[1] :])
    fed, paths, on_chains, out = [], [], [], []
    for i, (r, tree, (at, nxt, *tokens)) in enumerate(zip(rows, drafts.trees, got, strict=True)):
        path = tree.path(at)
        fed.append(len(r.ctx) - 1)
        add, reason = r.stops.cut([tokens[j - 1] for j in path] + [nxt])
        r.ctx += add
        r.stats.finish_reason, r.done = reason, bool(reason)
        paths.append(([0] + path)[: len(r.ctx) - 1 - fed[-1]])
        on_chain, side, chain = _followed(path, tree, drafts.chains[i], drafts.sides[i])
        on_chains.append(on_chain)
        out.append((add, path, chain, side, on_chain))
    target.keep_path(rows, paths)
    if feats is not None:  # each row's kept positions' features, in order (B, 1 + path, F)
        m = max(len(p) for _, p, *_ in out)
        at = mx.array([[0, *p] + [0] * (m - len(p)) for _, p, *_ in out], dtype=mx.int32)
        feats = mx.take_along_axis(feats, at[..., None], axis=1)
    drafter.settle(rows, drafts.chain, fed, on_chains, feats)  # (Medusa: no chain)
    seconds = time.perf_counter() - t0
    return [_report(r, drafts.ks[i], len(path), add, drafts.how[i], seconds, draft_s,
                    chain=chain, sides=drafts.sides[i], side=side, on_chain=on_chain)
            for i, (r, (add, path, chain, side, on_chain)) in enumerate(zip(rows, out, strict=True))]  # fmt: skip


def _followed(path: list[int], tree: Tree, chain: int, sides: tuple) -> tuple[int, int, int]:
    """How a kept path went through a row's tree: (how far it followed the drafter's chain,
    nodes 1..chain; the rank of the side leaf it then took, -1: none; the chain's length,
    or the tree's depth for a tree of its own, Medusa's)."""
    if not chain:
        return len(path), -1, max(tree.depths())
    on_chain = next((j for j, u in enumerate(path) if u != j + 1), len(path))
    # a kept side leaf's rank: the leaves follow the chain, depth by depth, in rank order
    first = chain + sum(sides[:on_chain]) + 1  # its depth's first leaf
    width = sides[on_chain] if on_chain < len(sides) else 0
    side = (
        path[on_chain] - first
        if on_chain < len(path) and first <= path[on_chain] < first + width
        else -1
    )
    return on_chain, side, chain
