"""One speculative round for B >= 1 rows: propose -> verify -> accept -> keep -> settle.

A lone generation (engine.py) is a round of one row; a batch (batch.py) is a round of B
rows. Both call ``one_round``: there is no second round. What differs is around it:

- who verifies (a ``Verifier``): a lone generation's target is its Cursor (every cache kind,
  a queued plain pass); a batch's is the rows' batch caches (core.rows) and its recorder;
- who drafts (a drafting.row_drafters.RowDrafter): the draft model, a chained head (MTP,
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

from ..core.acceptance import Rule, accept_proposal
from ..core.sampling import Processor, round_keys
from ..core.stats import RoundReport, Stats, TokenEvent
from ..drafting.choosers import K
from ..drafting.row_drafters import Drafts, RowDrafter
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
    logits, feats = target.verify(rows, drafts.tokens)  # (B, k + 1, V), (B, k + 1, F)
    outs = []
    for i, r in enumerate(rows):  # each row by its own rule, sampler, keys and k
        ki = ks[i]
        if not k and r.process is None:  # a greedy plain step (as cheap as target-only's)
            nxt = mx.argmax(logits[i, 0], axis=-1).astype(mx.uint32)
            outs.append(mx.concatenate([mx.zeros((1,), dtype=mx.uint32), nxt.reshape(1)]))
            continue
        di = drafts.tokens[i, :ki] if k else mx.zeros((0,), dtype=mx.uint32)
        qi = drafts.q[i][:ki] if drafts.q[i] is not None else None
        n, nxt = accept_proposal(logits[i, : ki + 1], di, qi, r.process, r.rule, *keys[i][1:])
        pad = [mx.zeros((k - ki,), dtype=mx.uint32)] if k > ki else []
        outs.append(mx.concatenate([n.astype(mx.uint32).reshape(1), di, nxt.reshape(1), *pad]))
    if plain_next is not None and not k and rows[0].stops.room > 0 and plain_next():
        mx.async_eval(outs[0])  # (a lone row) its next plain pass runs while the host reads
        target.queue(nxt)
    out = outs[0][None] if len(outs) == 1 else mx.stack(outs)  # (B, k + 2)
    got = out.tolist()  # the round's one host sync
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
    seconds, out = time.perf_counter() - t0, []
    for i, r in enumerate(rows):
        how = drafts.how[i]
        report = RoundReport(
            ks[i], accepted[i], seconds, how.draft_s if how.draft_s is not None else draft_s,
            how.match, how.confidences, how.made,
        )  # fmt: skip
        r.stats.record(report, r.stops.count)
        out.append(([TokenEvent(t, j < accepted[i]) for j, t in enumerate(new[i])], report))
    return out
