"""The worker's MLX loop when requests batch (``specmlx serve --max-batch N``, N > 1): the
running requests are the rows of one decoding.batch.Batch, each round one target pass for
all of them. A request joins at the next round (its prompt prefilled alone, from the prompt
cache's prefix), leaves when it is done, cancelled or its client hung up (its caches go back
to the prompt cache), and its text, stop strings and editor limits are its own.

A row that asked for a fixed k drafts it; the others draft the batch's choice (batch_k.BatchK:
what rounds of each k made per second at this many rows, measured as they run). A request
that cannot be a row (prompt lookup, per-token stopping) runs alone between two rounds, as
the serial worker runs it; an editor's warm-up too, but only once no editor request runs or
waits (warmups.py), so its prefill never holds up a suggestion. Every other request is a row
from its first round to its last: one that runs alone is a batch of one (a round costs what
the engine's does), and a row that asked for adaptive k drafts its own chooser's k while it
is alone, as the serial worker's request would (the store's, saved when it leaves); when
others join, nothing about it is converted: it keeps its row, and BatchK picks for all.

With the target split over ranks, rank 0's batch travels to the other ranks as what it does
(wire.BatchOps: the rows that left, a request that joins, each row's k), sent before it
does it, and each round's tokens are compared across ranks (one Lockstep check a round); the
other ranks run the same batch (follower.FollowerBatch). Rank 0 decides everything a rank could
decide differently (k from its timings, cancels, editor limits, unseeded requests' seeds),
and nothing runs alone through the engine except what the serial worker would also send
(lookup, stopping per token, warm-ups), after the rows that left are sent.

Editors ask again at every pause (llama.vim: a suggestion, then a speculative one for the
position after it), and on a machine where a pass over two rows costs nearly two passes, an
older editor request beside the newest makes the suggestion the user waits for twice as
slow. So the newest editor request (/infill) goes first: the editor requests running when
it arrives step aside (``_park``: their caches go to the prompt cache, where the newer one,
which shares most of its prompt, finds them; their clients' streams stay open) and resume,
newest first, once no editor request has run for RESUME_GRACE. Not with ranks (a parked row
would have to travel): there they batch as any request.
"""

from __future__ import annotations

import os
import queue
import time
from dataclasses import dataclass, field, replace

from ..core.stats import TokenEvent
from ..decoding.batch import Batch, Row
from ..decoding.driver import DraftClock
from ..decoding.stream import EditorLimits, TextStream
from ..distributed.ranks import Lockstep, ranks_stopped
from ..drafting.choosing.adaptive import AdaptiveK
from ..drafting.choosing.choosers import for_drafter
from .batch_k import BatchK, KeptBatchK
from .jobs import Host
from .joining import join_row
from .warmups import WarmUps

# seconds a parked editor request waits, after an editor request ends, before it resumes:
# an editor sends its next request as soon as it has an answer (llama.vim's follow-up), and
# a resume begun just before it arrives would hold it up for the resume's prefill
RESUME_GRACE = 0.25


@dataclass
class _Live:
    """A running request: its job, row, text stream and editor limits; the adaptive chooser
    its row drafts by while it is alone (None: a fixed k, or with ranks), with where that
    chooser's estimates came from, and its rounds' DraftClock (which time the draft apart,
    as a lone generation's do)."""

    job: object
    row: Row | None
    text: TextStream
    limits: EditorLimits | None
    ended: bool = field(default=False)
    own_k: AdaptiveK | None = None
    origin: str = ""
    clock: DraftClock = field(default_factory=DraftClock)
    was_alone: bool = False  # its last round ran alone (its report is its chooser's to read)
    parked: _Parked | None = None  # set aside for a newer editor request (Batcher._park)
    sources: tuple[int, ...] = ()  # the prompt-cache entries it came from (KVState.sources)


@dataclass
class _Parked:
    """Where a parked request goes on from: its context (prompt + tokens made), its decode
    as asked (the whole budget, its own seed: a round's keys come from the seed and the
    round's position, so it draws from where it stopped) and how many tokens it made (its
    caches wait in the prompt cache)."""

    ids: list[int]
    decode: object
    made: int


class Batcher:
    """Runs a Worker's queue as batches of up to ``max_batch`` rows (see the module).

    worker: what it reads and calls of the worker (jobs.Host); max_batch: the most rows;
    k: the batch's k chooser (None: what this machine measured for the pair, or fresh)."""

    def __init__(self, worker: Host, max_batch: int, k: BatchK | None = None):
        pair = worker.session.pair
        self.w, self.max_batch = worker, max_batch
        self.batch = Batch(pair.target, pair.draft, pair.shared, tree=worker.tree)
        self.live: list[_Live] = []
        # editor requests set aside for newer ones, oldest first: not rows, so they hold no
        # KV of the batch's (theirs is in the prompt cache, within its budget)
        self.parked: list[_Live] = []
        self._quiet_from = 0.0  # (monotonic) when a parked request may resume
        # editors' warm-ups, run once the editors are quiet
        self.warmups = WarmUps(worker.totals, worker.count)
        store = worker.choosers
        self.kept = KeptBatchK(pair.target_id, pair.draft_id, store.persist, store.warn, k)
        self.k = self.kept.k
        self.ranks = worker.world.distributed
        self.left: list[int] = []  # with ranks: rows left since the last BatchOps
        self.lockstep = Lockstep(worker.world, every=1) if self.ranks else None
        self.curve: list[float] | None = None  # the target's probed pass costs, once known

    def run(self) -> None:
        w = self.w
        while True:
            job = False  # (nothing new: go on with the rows there are)
            self._unpark()
            self._warm_up()
            if not self.live:
                self.kept.save()
                if self.ranks and w.watchdog is not None:
                    w.watchdog.idle()  # nothing is expected of the other ranks until a job
                if self.parked or self.warmups.waiting:
                    # one resumes (or warms up) in a moment, unless a newer request comes
                    try:
                        job = w.queue.get(timeout=RESUME_GRACE)
                    except queue.Empty:
                        continue
                else:
                    job = w.next_job()  # (with ranks, idle ticks while none comes)
            elif len(self.live) < self.max_batch or w.stopping:
                try:  # (past max_batch, requests wait in the queue, up to --max-queue)
                    job = w.queue.get_nowait()
                except queue.Empty:
                    pass
            if job is None:  # stop: the running requests were cancelled by Worker.stop
                self._end_all(None)
                self.kept.save()
                if self.ranks:
                    w.stop_followers()
                return
            if job is not False:
                w.holding = self._held() + 1
                self._admit(job)
                if len(self.live) < self.max_batch and not w.queue.empty():
                    continue  # take what waits before the next round
            if self.live:
                self._round()
            w.totals.batch_rows, w.busy = len(self.live), bool(self.live)
            w.holding = self._held()

    def _admit(self, job) -> None:
        w, r = self.w, job.request
        if job.cancelled.is_set():
            w.totals.cancelled += 1
            return
        if w.stopping:
            w.refuse(job)
            return
        if r.warm_up:  # it waits until the editors are quiet (_warm_up); it parks nothing
            self.warmups.add(job)
            return
        lone = self.batch.drafter is not None and self.batch.drafter.lone  # (Medusa heads)
        if r.uses_lookup or w.draft_stop or (r.uses_draft and lone):
            if self._send_left(job):
                w.serve_alone(job)  # (between two rounds: the rows wait for it)
            return
        if len(self.live) >= self.max_batch:  # (run() admits only while there is room)
            raise RuntimeError("the batch is full")
        if job.editor and not self.ranks:  # the newest editor request first (see the module)
            for lv in [lv for lv in self.live if lv.job.editor]:
                self._park(lv)
        w.label(job)
        row, own_k, origin, sources = None, None, "", ()
        try:
            if self.ranks:  # the other ranks join it too, with rank 0's seed
                r.seed = r.seed if r.seed is not None else int.from_bytes(os.urandom(6), "little")
                w.send_ops(self.left, r, None)
                self.left = []
            kv = w.caches_for(r)
            sources = kv.sources
            if r.k.auto and self._drafts(r) and not self.ranks and w.choosers is not None:
                # its own chooser while it runs alone (with ranks, rank 0's BatchK for all)
                own_k = w.session.adaptive(r)
                for_drafter(own_k, w.session.pair.draft)  # (a block drafter's k, an exit's prior)
                origin = w.choosers.origin(own_k)
            self._look_for_curve()
            row = join_row(w.session, w.cache, self.batch, r, job.stats, kv)
        except Exception as e:  # noqa: BLE001 - this request's error; the batch goes on
            w.totals.failed += 1
            w.failed(job, sources, e)
            if self.ranks:  # the other ranks failed it too, or are apart now: all stop
                e = ranks_stopped(e)
                self._end_all(e)
            job.emit("error", e)
            if self.ranks:
                self._fatal(e)
            return
        limits = None
        if r.time_limit_s is not None or r.min_indent:
            limits = EditorLimits(r.time_limit_s, r.min_indent, job.stats)
        text = TextStream(w.session.pair.tokenizer, r.stop, job.stats)
        self.live.append(_Live(job, row, text, limits, own_k=own_k, origin=origin, sources=sources))

    def _send_left(self, job) -> bool:
        """With ranks, before a request runs alone: the other ranks put the caches of the
        rows that left back first. False when a rank went away (then all stop, and ``job``
        hears why)."""
        if not (self.ranks and self.left):
            return True
        try:
            self.w.send_ops(self.left, None, None)
        except Exception as e:  # noqa: BLE001 - a rank went away: all stop
            failure = ranks_stopped(e)
            self._end_all(failure)
            job.emit("error", failure)
            self._fatal(failure)
            return False
        self.left = []
        return True

    def _editors_busy(self) -> bool:
        """Whether an editor request runs, is set aside, waits in the queue, or may come
        next (one ended within RESUME_GRACE: its client's follow-up)."""
        if any(lv.job.editor for lv in self.live) or self.parked:
            return True
        if time.monotonic() < self._quiet_from:
            return True
        return self.w.queue.editor_waiting()

    def _warm_up(self) -> None:
        """Run the newest waiting warm-up alone, when the editors are quiet: a warm-up fills
        the prompt cache for later, and must never delay a suggestion someone is waiting
        for. Not a row, not an editor request that ends (``_quiet_from`` stays), so it
        parks nothing and holds no parked one back."""
        self.warmups.drop_gone()
        if not self.warmups.waiting or self._editors_busy():
            return
        job = self.warmups.take()
        self.w.holding = self._held() + 1
        if self._send_left(job):
            self.w.serve_alone(job)

    def _drafts(self, r) -> bool:
        """Whether request ``r``'s row drafts (it asked for the pair's draft, and there is
        one)."""
        return r.uses_draft and self.batch.drafter is not None

    def _held(self) -> int:
        """Requests the MLX thread holds (Worker.holding): the live ones, the parked and
        the waiting warm-ups."""
        return len(self.live) + len(self.parked) + len(self.warmups.waiting)

    def _park(self, lv: _Live) -> None:
        """Set a running editor request aside for a newer one: its caches go to the prompt
        cache (a budget of 0 keeps none: it is prefilled again when it resumes), its
        client's stream stays open; ``_unpark`` resumes it from its context, drawing what it
        would have drawn had it not stopped (the same seed, the same positions)."""
        row = lv.row
        decode = self.w.session.decode(replace(lv.job.request, seed=row.seed))
        p = _Parked(list(row.ctx), decode, row.stops.count)
        kv, lv.row = self.batch.leave(row), None
        self.live.remove(lv)
        self.w.cache.put(kv)
        lv.parked = p
        self.parked.append(lv)

    def _unpark(self) -> None:
        """Drop the parked requests whose clients left; when no editor request runs and
        none waits, the newest parked one joins the batch again, from where it stopped (its
        caches from the prompt cache: a prefill of what a newer one took, if any)."""
        for lv in [lv for lv in self.parked if lv.job.cancelled.is_set()]:
            self.parked.remove(lv)
            self.w.count(lv.job.stats, True)
        if not self.parked or any(lv.job.editor for lv in self.live):
            return
        if not self.w.queue.empty() or time.monotonic() < self._quiet_from:
            return  # what waits, or what an editor sends next, may be newer: its turn first
        lv = self.parked.pop()
        p, lv.parked = lv.parked, None
        drafts = lv.job.request.uses_draft
        try:
            kv = self.w.cache.take(p.ids)
            lv.sources = kv.sources
            lv.row = self.batch.join(p.ids, p.decode, kv, lv.job.stats, drafts, p.made)
            self.w.cache.keep_branch(kv)
        except Exception as e:  # noqa: BLE001 - this request's error; serving goes on
            self.w.totals.failed += 1
            self.w.failed(lv.job, lv.sources, e)
            lv.job.emit("error", e)
            return
        self.live.append(lv)

    def _round(self) -> None:
        self._price_trees()
        # a row that asked for a fixed k drafts it (its text then does not depend on what
        # runs beside it); the rest draft what BatchK picks for this width
        alone = self.live[0] if len(self.live) == 1 and self.live[0].own_k is not None else None
        auto = [lv for lv in self.live if lv.row.drafts and lv.row.k_setting.auto]
        k = self.k(len(self.live)) if auto and alone is None else None
        ks = [_k_of(lv.row, k) for lv in self.live]
        timed = False
        if alone is not None:  # a row alone drafts its own chooser's k (see the module)
            row = alone.row
            # (a round beside others is no lone round's report: its time is theirs too)
            last = self.batch.reports[0] if alone.was_alone and self.batch.reports else None
            ks = [max(0, min(alone.own_k(last), row.stops.room))]
            timed = alone.clock.timed(ks[0], last)
        t0 = time.perf_counter()
        try:
            if self.ranks:
                if self.w.watchdog is not None:
                    self.w.watchdog.beat("generating")
                self.w.send_ops(self.left, None, ks)
                self.left = []
            events = self.batch.round(ks, timed=timed)
            if self.lockstep is not None:  # every rank made the same tokens, or all stop
                self.lockstep([e.token for evs in events for e in evs])
        except Exception as e:  # noqa: BLE001 - every row's client hears it; serving goes on
            if self.ranks:  # the ranks may be apart now: all stop, and the clients hear why
                e = ranks_stopped(e)
            self._end_all(e)
            if self.ranks:
                self._fatal(e)
            return
        width = len(self.live)
        for lv in self.live:
            lv.was_alone = lv is alone
        self.w.totals.batch_rounds += 1
        self.w.totals.batch_tree_rounds += self.batch.tree_pass
        if k is not None:  # (rows that keep their own k tell BatchK nothing of its choice)
            self.k.observe(width, k, sum(len(ev) for ev in events), time.perf_counter() - t0)
        for lv, evs in zip(list(self.live), events, strict=True):
            if lv.job.cancelled.is_set():
                self._leave(lv, cancelled=True)
                continue
            if self._emit(lv, evs) or lv.row.done:
                tail = lv.text.end() if not lv.ended else None
                if tail is not None:
                    lv.job.emit("piece", tail)
                self._leave(lv, cancelled=False)

    def _emit(self, lv: _Live, evs: list[TokenEvent]) -> bool:
        """Send a request's new tokens as text; True when its stop string or an editor limit
        ended it (``ended``)."""
        for ev in evs:
            out = lv.text.add(ev)
            if lv.limits is not None and not lv.text.stopped:
                out = lv.limits.add(out)
            lv.job.emit("piece", out)
            if lv.text.stopped or (lv.limits is not None and lv.limits.stopped):
                lv.ended = True
                return True
        return False

    def _fatal(self, e: Exception) -> None:
        """With ranks, a failed join or round leaves the ranks apart: stop them all."""
        if self.w.fatal is not None:
            time.sleep(1.0)  # the answers go out first
            self.w.fatal(str(e))

    def _leave(self, lv: _Live, cancelled: bool) -> None:
        w = self.w
        self.live.remove(lv)
        if lv.job.editor:
            self._quiet_from = time.monotonic() + RESUME_GRACE
        if self.ranks and lv.row is not None:  # (sent with the next BatchOps)
            self.left.append(self.batch.rows.index(lv.row))
        w.cache.put(self.batch.leave(lv.row))
        if lv.own_k is not None:  # what its chooser learned, saved as a lone run's is
            w.session.finish(lv.own_k, lv.job.stats, lv.origin)
        w.count(lv.job.stats, cancelled)
        w.note_cache()
        if not cancelled:
            w.last = lv.job.stats
            lv.job.emit("done", lv.job.stats)

    def _end_all(self, error: Exception | None) -> None:
        """Every running request ends: with ``error`` (a failed round), or as cancelled."""
        for lv in self.parked:
            if error is not None:
                self.w.totals.failed += 1
                lv.job.emit("error", error)
        self.parked = []
        for job in self.warmups.waiting:
            if error is not None:
                self.w.totals.failed += 1
                job.emit("error", error)
        self.warmups.waiting = []
        for lv in list(self.live):
            if error is not None:
                self.w.totals.failed += 1
                self.w.failed(lv.job, lv.sources, error)
                lv.job.emit("error", error)
            self.live.remove(lv)
            self.batch.leave(lv.row)
        b = self.batch
        self.batch = Batch(b.target, b.draft, b.vocab, b.pass_ratio, b.tree)

    def _price_trees(self) -> None:
        """A lone row's auto trees are sized from the target's probed pass costs, as a lone
        generation's are; a wider batch's from the guessed curve (+10% a token). The probe
        times one row's passes up to k_max + 1 tokens, and a batch's pass is its rows'
        tokens together, past that: sized from the probe there, 4 clients made 2.19-2.23x
        serial's tok/s against 2.39x with the guess; a lone row sized from the guess made
        0.68x serial's, from the probe 0.98x (bench_serve, CPU pair, greedy, 1fd18fe). With
        ranks, the guess always: every rank plans the same trees."""
        if not self.ranks:  # (a batch starts from the guess)
            self.batch.price_trees(self.curve if len(self.live) == 1 else None)

    def _look_for_curve(self) -> None:
        """Take the target's probed pass-cost curve once a probe has run (a lone adaptive
        request's, or one saved on this machine): ``curve``, for ``_price_trees``."""
        if self.curve is None and not self.ranks:
            self.curve = self.w.choosers.known_curve(self.w.session.pair.target_id)

    def jobs(self) -> list:
        return [lv.job for lv in self.live + self.parked] + self.warmups.waiting


def _k_of(row: Row, auto: int | None) -> int:
    """A row's drafts this round: none when it asked for no draft, its own fixed k, or the
    batch's choice ``auto`` for a row that asked for adaptive k."""
    if not row.drafts:
        return 0
    return auto if row.k_setting.auto else row.k_setting.fixed
