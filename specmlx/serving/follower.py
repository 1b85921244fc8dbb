"""A rank other than 0 when the server batches over ranks: it runs rank 0's batch in
step, from the messages rank 0 sends before it acts (wire.BatchOps: the rows that left, a
request that joins, each row's k for the round), so both ranks make the same collective
calls in the same order; each round's tokens are compared (one Lockstep check a round).
Nothing is emitted here: rank 0 answers the clients."""

from __future__ import annotations

from ..core.stats import Stats
from ..decoding.batch import Batch, Row
from ..distributed.ranks import Lockstep
from .jobs import Host
from .joining import join_row


class FollowerBatch:
    """A rank other than 0 running rank 0's batch in step, from its BatchOps (see the
    module): the same leaves (caches back to this rank's prompt cache), joins and rounds,
    each round's tokens compared. Nothing is emitted: rank 0 answers the clients."""

    def __init__(self, worker: Host):
        pair = worker.session.pair
        self.w = worker
        self.batch = Batch(pair.target, pair.draft, pair.shared, tree=worker.tree)
        self.rows: list[Row] = []
        self.lockstep = Lockstep(worker.world, every=1)

    def apply(self, leave: list[int], join, k: list[int] | None) -> None:
        """Do what rank 0's batch does: rows ``leave`` (indices, in order), ``join`` (a
        session.Request or None), then a round of ``k`` drafts per row (None: no round)."""
        for i in leave:
            self.w.cache.put(self.batch.leave(self.rows.pop(i)))
        if join is not None:
            taken = self.w.caches_for(join)
            row = join_row(self.w.session, self.w.cache, self.batch, join, Stats(), taken)
            self.rows.append(row)
        if k is not None:
            if self.w.watchdog is not None:
                self.w.watchdog.beat("generating")
            events = self.batch.round(k)
            self.lockstep([e.token for evs in events for e in evs])
