"""One speculative round for B >= 1 rows: propose -> verify -> accept -> keep -> settle.

A lone generation (engine.py) is a round of one row; a batch (batch.py) is a round of B
rows. Both call ``one_round``: there is no second round. What differs is around it:

- who verifies (a ``Verifier``): a lone generation's target is its Cursor (every cache kind,
  a queued plain pass); a batch's is the rows' batch caches (core.batch_caches) and its recorder;
- who drafts (a drafting.proposals.RowDrafter): the draft model, a chained head (MTP,
  EAGLE-3), a block drafter (DFlash), for any B; lookup, the lookup-first chain, a draft
  model with per-token stopping, or one whose caches have no batch kind, for one row only
  (row_drafters.LoneRows: a batch refuses them by name when a row joins).

A chain is a tree whose nodes each have one child: one verify and one keep serve both (the
verifier runs a chain's pass as a plain causal pass, bit for bit), and a row's kept path is
its accepted drafts (a chain's 1..n) or the path acceptance walked (a tree's).

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
    """One sequence in a round: its context (prompt + generated), the k setting it asked
    for, its stops, seed, sampler, acceptance rule and statistics. ``done``: it reached a stop."""

    ctx: list[int]
    # the k it asked for (a batch: a fixed k is the row's own; auto follows what the batch's
    # owner picks); a round's k is an int, its drafts
    k_setting: K
    stops: Stops
    seed: int
    process: Processor | None
    rule: Rule
    stats: Stats = field(default_factory=Stats)
    done: bool = False
    drafts: bool = True  # False: it asked for no draft (plain steps in a batch's passes)
    wants_trees: bool = (
        False  # it asked for trees: side leaves where the sizer plans them, or grown
    )
    draft_held: int = 0  # how much of ctx the draft's row holds (a prefix of ctx[:-1])
    # a head's row: the target's features at positions draft_held.. it has not been fed
    # yet (m, F), the pairs' hidden states; None: none (a one-token prompt's first round)
    waiting: mx.array | None = None
    own_cache: list | None = None  # a block drafter's row: its context cache, its own


class Verifier(Protocol):
    """The target's side of a round: one pass over every row's drafts (a chain, or a token
    tree: a chain is the tree whose nodes each have one child), then each row's kept path."""

    def verify(
        self, rows: Sequence[Row], drafts: mx.array | None, trees: Sequence[Tree] | None
    ) -> tuple[mx.array, mx.array | None]:
        """The pass over each row's last token and its drafts (B, k) (None: k = 0), a chain
        a row (trees None) or row i's first trees[i].size a token tree (then pads). Returns
        logits (B, k + 1, V) and, for a drafter that reads them, the tapped features
        (B, k + 1, F), both lazy and in pass order."""
        ...

    def queue(self, token: mx.array) -> None:
        """Feed a lone row's next token (1,) now, for the next plain round."""
        ...

    def keep(self, rows: Sequence[Row], fed: list[int], paths: Sequence[list[int]]) -> None:
        """Each row's caches to its ctx[:-1]: row i's pass started at fed[i] and it keeps
        the pass's paths[i] (0 the root, then its kept nodes; a chain's 0, 1, ..., in order)."""
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
    width = max(ks)  # drafts in the pass: no more than any row can use
    keys = [
        round_keys(r.seed, len(r.ctx)) if r.process is not None else (None,) * 3 for r in rows
    ]  # fmt: skip (per row: draft, u, draw)
    drafts = Drafts.none(len(rows))
    if drafter is not None and (width or not drafter.needs_k):
        drafts = drafter.propose(rows, width, ks, [kk[0] for kk in keys])
    width, ks, trees = drafts.k, drafts.ks, drafts.trees  # (a tree's: its nodes)
    draft_s = None  # a model's drafting timed apart (lookup's costs nothing to time)
    if timed and any(h.source == "model" and h.draft_s is None for h in drafts.how):
        mx.eval(drafts.tokens, *[q for q in drafts.q if q is not None])
        draft_s = time.perf_counter() - t0
    logits, feats = target.verify(rows, drafts.tokens, trees)  # (B, width + 1, V), (.., F)
    plain = not width and all(r.process is None for r in rows)
    if plain:  # greedy plain steps: the argmax
        nxt = mx.argmax(logits[:, 0], axis=-1).astype(mx.uint32)  # alone, as cheap as
        out = nxt[:, None]  # target-only decoding (B, 1)
    else:  # each row by its own rule, sampler, keys, drafts and tree: (B, 2 + width), each
        # row's [last node kept (a chain's: its drafts accepted), next token, drafts]
        heads = [_accept(logits[i], drafts, i, r, keys[i]) for i, r in enumerate(rows)]
        out = mx.stack(heads) if not width else mx.concatenate([mx.stack(heads), drafts.tokens], 1)
        nxt = out[0, 1]
    argmax = trees is not None and drafter.reads_argmax  # (a lone row: lookahead's window,
    # always a tree, learns from the target's argmax at the root and every node, same sync)
    if argmax:
        out = mx.concatenate([out, mx.argmax(logits[0], axis=-1).astype(mx.uint32)[None]], 1)
    if plain_next is not None and not width and rows[0].stops.room > 0 and plain_next():
        mx.async_eval(out)  # (a lone row) its next plain pass runs while the host reads
        target.queue(nxt.reshape(1))
    got = out.tolist()  # the round's one host sync
    if argmax:
        drafter.observe(got[0][2 + width :])
    # keep: each row its kept path's tokens and the target's token, up to a stop
    fed, paths, told, new, reports = [], [], [], [], []
    for i, (r, row) in enumerate(zip(rows, got, strict=True)):
        at, nxt_i, tokens = (0, row[0], []) if plain else (row[0], row[1], row[2:])
        path = trees[i].path(at) if trees is not None else list(range(1, at + 1))
        fed.append(len(r.ctx) - 1)  # where this round's pass started, in both models
        add, reason = r.stops.cut([tokens[j - 1] for j in path] + [nxt_i])
        r.ctx += add
        r.stats.finish_reason, r.done = reason, bool(reason)
        paths.append(([0] + path)[: len(r.ctx) - 1 - fed[-1]])  # (of the pass: 0 the root)
        on_chain, tree_stats = drafts.followed(i, path)
        told.append(on_chain)
        new.append(add)
        reports.append((len(path), tree_stats))
    target.keep(rows, fed, paths)
    if feats is not None and trees is not None:  # each row's kept positions' features, in
        m = max(len(p) for p in paths)  # order (B, m, F)
        at = mx.array([p + [0] * (m - len(p)) for p in paths], dtype=mx.int32)
        feats = mx.take_along_axis(feats, at[..., None], axis=1)
    if drafter is not None:  # each row's draft state to what its ctx confirms
        drafter.settle(rows, drafts.told, fed, told, feats)
    seconds = time.perf_counter() - t0
    return [_report(r, ks[i], n, new[i], drafts.how[i], seconds, draft_s, **tree_stats)
            for i, (r, (n, tree_stats)) in enumerate(zip(rows, reports, strict=True))]  # fmt: skip


def _accept(logits: mx.array, drafts: Drafts, i: int, r: Row, keys) -> mx.array:
    """Row i's [last node kept, next token] (2,) uint32, lazy, by its rule: a chain's by the
    token-wise rule (its node: its drafts accepted), a tree's by tree_acceptance's (the
    longest argmax path, or multi-step speculative sampling). logits (k + 1, V): the row's
    pass; keys: its (draft, u, draw) keys."""
    tree = drafts.trees[i] if drafts.trees is not None else None
    n = tree.size if tree is not None else drafts.ks[i]  # (a row's pads are never read)
    mine = drafts.tokens[i, :n] if n else mx.zeros((0,), dtype=mx.uint32)
    if tree is None or tree.parents == tuple(range(n)):  # a chain (other rows may branch):
        # its own rule, so a seeded row draws in a tree round what it draws in a chain round
        q = drafts.q[i][:n] if drafts.q[i] is not None else None
        at, nxt = accept_proposal(logits[: n + 1], mine, q, r.process, r.rule, *keys[1:])
    elif r.process is None:
        at, nxt = accept_tree_greedy(logits[: n + 1], mine, tree)
    else:
        p, q = r.process(logits[: n + 1]), drafts.q[i]  # (n + 1, V), (n, V_q)
        # q None: every node a point mass (a grown tree's: chosen, not drawn)
        q = q if q is not None else point_mass(mine, p.shape[-1]).astype(p.dtype)
        if q.shape[-1] < p.shape[-1]:  # a narrower draft: its q is 0 past its ids
            q = mx.pad(q, [(0, 0), (0, p.shape[-1] - q.shape[-1])])
        u = mx.random.uniform(shape=(n,), key=keys[1])
        at, nxt = accept_tree(p, q, mine, tree, u, keys[2])
    return mx.concatenate([at.astype(mx.uint32).reshape(1), nxt.astype(mx.uint32).reshape(1)])


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
