"""The server's generation thread: the one thread that runs MLX, one generation at a time,
from a bounded FIFO queue, with the prompt cache and the adaptive-k choosers.

It knows nothing of HTTP: a job comes in as a session.Request with an ``emit`` callback, and its
text, its end and any error go out through that callback (the server hands them to its event
loop). A job that is cancelled (its client hung up) stops within one round and frees the slot.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import mlx.core as mx

from ..core.kvstate import KVState
from ..core.stats import Stats
from ..decoding.session import Pair, Request, Session
from ..distributed.ranks import (
    Cancelled,
    Lockstep,
    RankFailure,
    Watchdog,
    World,
    lost_peer,
    ranks_stopped,
    said,
)
from ..distributed.wire import IDLE, BatchOps, receive, send, send_ops
from ..drafting.choosing.choosers import ChooserStore
from ..drafting.choosing.tree_size import AUTO, TreeSize
from ..drafting.lookup.memory import LookupMemory
from ..errors import SpecmlxError
from ..models.loading import Loaded
from ..paths import Warn
from .access_log import SERVER
from .batcher import RESUME_GRACE, Batcher
from .follower import FollowerBatch
from .jobs import Emit, Job, Jobs, Totals
from .joining import can_batch
from .prompt_cache import PromptCache
from .warmups import WarmUps

_log = logging.getLogger(SERVER)

# with ranks, between requests: seconds between rank 0's idle ticks (a request waits at most
# this long for the followers; they spin a tenth of it)
IDLE_TICK = 0.1


class QueueFull(SpecmlxError):
    """The queue holds --max-queue requests already (HTTP 503, with Retry-After)."""


class ShuttingDown(SpecmlxError):
    """The server is stopping; queued requests are not started."""


class Worker:
    """Owns the loaded pair and the MLX thread.

    target, draft: the loaded models (draft None: target alone); shared: ids the draft may
    propose; max_queue: requests that may wait while every row runs; cache_budget: bytes of KV
    caches the prompt cache may keep; persist: keep adaptive-k state under $SPECMLX_HOME;
    warn: gets one line when state cannot be saved; world: the ranks the target is split
    over: rank 0 serves and sends each request to the others, which ``follow``;
    lookup_memory: lookup requests also search the outputs of earlier ones (and, with
    persist, of earlier runs: lookup.LookupMemory; never with ranks, whose stores differ);
    draft_stop: auto-k requests with a draft model stop drafting per token (engine);
    watchdog: with ranks, bounds a generation that makes no progress (a rank that hangs);
    fatal: with ranks, called with one line when a generation failed after the ranks
    started it (they may be out of step): it must end this rank (the CLI exits 1);
    max_batch: up to this many requests decode together, one target pass a round
    (batcher.py), where the pair can batch (``batch_refused`` says why not: then one at a
    time); cache_reuse: the prompt cache moves cached runs of at least this many tokens to
    where a prompt has them (0: off; ``cache.refused`` says why a pair cannot); tree: the
    token trees its requests ask for (a batch sizes its rows' trees by it)."""

    def __init__(
        self,
        target: Loaded,
        draft: Loaded | None,
        shared: int,
        *,
        max_queue: int = 16,
        cache_budget: int = 0,
        persist: bool = True,
        warn: Warn | None = None,
        world: World | None = None,
        lookup_memory: bool = True,
        draft_stop: bool = False,
        watchdog: Watchdog | None = None,
        fatal: Callable[[str], None] | None = None,
        max_batch: int = 1,
        cache_reuse: int = 0,
        tree: TreeSize = AUTO,
    ):
        self.watchdog, self.fatal, self.tree = watchdog, fatal, tree
        self.target, self.draft, self.shared = target, draft, shared
        self.draft_stop = draft_stop
        self.max_queue = max_queue
        self.world = world or World(None)
        models = (target.model, draft.model if draft else None) if cache_reuse else ()
        self.cache = PromptCache(cache_budget, cache_reuse, *models)
        self.choosers = ChooserStore(persist=persist and self.world.leader, warn=warn)
        self.memory = None
        if lookup_memory and not self.world.distributed:
            where = LookupMemory.directory_for(target.tokenizer) if persist else None
            self.memory = LookupMemory(where, vocab_size=target.vocab_size, warn=warn)
        pair = Pair.of(target, draft, shared)
        self.session = Session(pair, choosers=self.choosers, memory=self.memory, world=self.world)
        self.totals = Totals()
        self.last: Stats | None = None
        self.busy = False
        self.queue = Jobs()
        self._lock = threading.Lock()
        self._numbered = 0  # requests submitted so far (a job's number, for the log)
        self.stopping = False
        self._current: Job | None = None
        self._warmups = WarmUps(
            self.totals, self.count
        )  # one at a time: warm-ups wait for the queue (_run)
        self.max_batch, self.batch_refused, self._batcher = max_batch, None, None
        self._follower: FollowerBatch | None = None  # a rank other than 0: rank 0's batch
        if max_batch > 1:
            self.batch_refused = can_batch(self.session.pair)
            if self.batch_refused is None:
                self._batcher = Batcher(self, max_batch)
        # requests that run at once, and how many the MLX thread holds now (taken off the queue,
        # not yet ended)
        self.slots = max_batch if self._batcher is not None else 1
        self.holding = 0
        self._loop = self._batcher.run if self._batcher is not None else self._run
        self._thread = threading.Thread(target=self._mlx_thread, name="specmlx-mlx", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def queued(self) -> int:
        """Requests waiting (the running one excluded)."""
        return self.queue.qsize()

    def submit(self, request: Request, emit: Emit, editor: bool = False) -> Job:
        """Queue a generation; QueueFull past max_queue, ShuttingDown once stopping.
        editor: an editor's request (see Job). A request for the pair's draft where none is
        loaded drafts without it."""
        if self.draft is None and request is not None:
            request = request.without_draft()
        job = Job(request, emit, editor)
        with self._lock:
            self._numbered += 1
            job.number = self._numbered
            if self.stopping:
                raise ShuttingDown("the server is shutting down")
            # up to max_queue wait beyond the rows free now (--max-queue 0: served while a
            # row is free, refused while every row runs); ``holding`` counts from the moment
            # the MLX thread takes a job, before its prefill, so none is counted twice or not
            # at all
            waiting = self.queue.qsize()
            if waiting >= self.max_queue + max(0, self.slots - self.holding):
                self.totals.rejected += 1
                raise QueueFull(f"{self.max_queue} requests are already waiting; retry shortly")
            self.queue.put(job)
        return job

    def drain(self) -> None:
        """Refuse new jobs and answer the queued ones with ShuttingDown; the running one goes
        on (a server stopping lets it finish within its grace)."""
        with self._lock:
            self.stopping = True
            while True:
                try:
                    job = self.queue.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job.cancel()
                    job.emit("error", ShuttingDown("the server is shutting down"))

    def running(self) -> list[Job]:
        """The jobs generating now (one, or a batch's rows), and those the MLX thread holds
        set aside (parked editor requests, warm-ups waiting)."""
        jobs = self._batcher.jobs() if self._batcher is not None else list(self._warmups.waiting)
        return jobs + ([self._current] if self._current is not None else [])

    def interrupt(self) -> None:
        """End the running jobs now: each client gets ShuttingDown (a final error event)."""
        for job in self.running():
            job.emit("error", ShuttingDown("the server is shutting down"))
            job.cancel()

    def refuse(self, job: Job) -> None:
        """Answer a job taken off the queue as the server began to stop."""
        job.emit("error", ShuttingDown("the server is shutting down"))

    def stop(self, timeout: float = 30.0) -> None:
        """Refuse new jobs, cancel the queued and running ones, and wait for the thread."""
        self.drain()
        for job in self.running():
            job.cancel()
        self.queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------ the MLX thread

    def _mlx_thread(self) -> None:
        try:
            self._loop()
        finally:
            # MLX asks each thread that used it to destroy its streams before it ends: left to
            # the thread's own teardown they can abort the process at exit ("terminate called
            # without an active exception", signal 6, after a clean stop)
            mx.clear_streams()

    def follow(self) -> None:
        """On ranks other than 0: run the generations rank 0 sends, in step, until it says
        stop. Nothing is emitted; rank 0 answers the clients. RankFailure when rank 0 went
        away or a generation failed here: this rank's caches and collectives may no longer
        match rank 0's, so it stops (and rank 0, whose collectives then fail, stops too)."""
        while True:
            try:
                request = receive(self.world, Request)
            except RuntimeError as e:
                raise RankFailure(f"lost rank 0 ({lost_peer(e) or e})") from None
            if request is None:
                return
            if request is IDLE:  # rank 0 has nothing yet: wait asleep, not in a collective
                time.sleep(IDLE_TICK * 0.9)
                continue
            try:
                if isinstance(request, BatchOps):  # rank 0's batch: the same, in step
                    if self._follower is None:
                        self._follower = FollowerBatch(self)
                    self._follower.apply(request.leave, request.join, request.k)
                    continue
                self._generate(Job(request, lambda _kind, _value: None))
            except Exception as e:  # noqa: BLE001 - whatever it was, the ranks are apart now
                self.totals.failed += 1
                raise RankFailure(f"a generation failed on this rank: {said(e)}") from None
            finally:
                if self.watchdog is not None:
                    self.watchdog.idle()

    def stop_followers(self) -> None:
        """Rank 0: the other ranks stop following (serving is over)."""
        send(self.world, None)

    def send_ops(self, leave: list[int], join: Request | None, k: list[int] | None) -> None:
        """Rank 0 with a batch: tell the other ranks what its batch does next (see BatchOps),
        before it does it."""
        send_ops(self.world, BatchOps(leave, join, k))

    def fail(self, message: str) -> None:
        """Answer the running request with ``message`` (a 503) and give the answer a moment
        to go out: the watchdog calls this before it ends the process."""
        for job in self.running():
            job.emit("error", RankFailure(message))
        if self.running():
            time.sleep(1.0)

    def _run(self) -> None:
        """One job at a time, in order, except an editor's warm-up: it runs once nothing
        waits in the queue and no editor request ended within RESUME_GRACE (its client's
        next request may be coming), so its prefill never holds up a suggestion."""
        warmups = self._warmups
        while True:
            warmups.drop_gone()
            held = False  # (a warm-up taken off the waiting list: its turn now)
            if warmups.waiting and self.queue.empty():
                wait = warmups.until_quiet()
                if wait == 0:
                    job, held = warmups.take(), True
                else:
                    try:
                        job = self.queue.get(timeout=wait)
                    except queue.Empty:
                        continue
            else:
                job = self.next_job()
            if job is None:
                if self.world.distributed:
                    send(self.world, None)  # the other ranks stop following
                return
            if job.request.warm_up and not held:
                warmups.add(job)  # after what waits (the loop takes it when nothing does)
                self.holding = len(warmups.waiting)
                continue
            self.holding = 1 + len(warmups.waiting)
            try:
                if self.serve_alone(job) is False:
                    return
            finally:
                self.holding = len(warmups.waiting)
            if job.editor and not job.request.warm_up:
                warmups.editor_ended(RESUME_GRACE)

    def serve_alone(self, job: Job) -> bool:
        """Run one job by itself; False when serving must stop (ranks out of step)."""
        if job.cancelled.is_set():
            self.totals.cancelled += 1
            return True
        if self.stopping:  # taken off the queue just as the server began to stop
            self.refuse(job)
            return True
        self._current, self.busy = job, True
        try:
            self._generate(job)
        except Exception as e:  # noqa: BLE001 - the job's client gets it; serving goes on
            self.totals.failed += 1
            if not self.world.distributed:
                job.emit("error", e)
                return True
            # the other ranks ran part of it: they may be out of step now, so stop all
            failure = ranks_stopped(e)
            job.emit("error", failure)
            if self.fatal is not None:
                time.sleep(1.0)  # the answer goes out first
                self.fatal(str(failure))
            return False
        finally:
            self._current, self.busy = None, False
            self.note_cache()  # after every job, failed ones too
            if self.watchdog is not None:
                self.watchdog.idle()
        return True

    def next_job(self) -> Job | None:
        """The next job. With ranks, while none comes, rank 0 sends an idle tick every
        IDLE_TICK seconds: a follower waiting inside a collective spins a core, so it waits
        for each tick asleep instead, and enters the collective just before it is due (a
        request then waits at most one tick for the followers)."""
        if not self.world.distributed:
            return self.queue.get()
        while True:
            try:
                return self.queue.get(timeout=IDLE_TICK)
            except queue.Empty:
                if self.watchdog is not None:  # a follower that hangs while idle: bounded
                    self.watchdog.beat("waiting for the other ranks")
                send(self.world, IDLE)
                if self.watchdog is not None:
                    self.watchdog.idle()

    def _generate(self, job: Job) -> None:
        r, stats, world = job.request, job.stats, self.world
        if world.distributed and world.leader:
            r.seed = r.seed if r.seed is not None else int.from_bytes(os.urandom(6), "little")
            send(world, r)
        lockstep = None
        if world.distributed:  # every round: the tokens compared, rank 0's cancel shared
            stop = job.cancelled.is_set if world.leader else None
            beat = None
            if self.watchdog is not None:
                self.watchdog.beat("generating")
                beat = self.watchdog.beat
            lockstep = Lockstep(world, stoppable=True, cancelled=stop, beat=beat)
        self.label(job)
        # a time limit would stop the ranks at different tokens: with ranks it is not applied
        time_limit = None if world.distributed else r.time_limit_s
        request = replace(r, draft_stop=self.draft_stop, time_limit_s=time_limit)
        kv = self.caches_for(r)
        cancelled = False
        try:
            gen = self.session.start(request, kv=kv, stats=stats, lockstep=lockstep)
            if r.warm_up:  # the prompt cache only
                gen.prefill()
                stats.finish_reason = "length"
            else:
                cancelled = self._stream(job, gen.text())
        except Exception as e:
            self.failed(job, kv.sources, e)
            raise
        self.cache.put(kv)  # the engine leaves kv holding exactly what it says
        if not r.warm_up:
            gen.finish()
        self.count(stats, cancelled)
        if cancelled:
            return
        self.last = stats
        job.emit("done", stats)

    def caches_for(self, r: Request) -> KVState:
        """The caches ``r`` starts from: the prompt cache's best for its prompt, or fresh
        ones where it asked for no cached prompt (llama-server's ``cache_prompt: false``)."""
        return self.cache.take(r.prompt_ids) if r.cache_prompt else KVState()

    def _stream(self, job: Job, events) -> bool:
        """Send a generation's text events to its client; True when it was cancelled."""
        try:
            for event in events:
                # with ranks, the cancel travels with the next round's lockstep check
                if job.cancelled.is_set() and not self.world.distributed:
                    return True
                job.emit("piece", event)
        except Cancelled:
            return True
        finally:
            events.close()  # (the engine settles its caches)
        return False

    def failed(self, job: Job, sources: tuple[int, ...], e: Exception) -> None:
        """A generation failed after it took caches from the prompt cache: the entries they
        came from go (whatever broke it may be in them: the next request for that prompt
        prefills afresh), and the log says which request it was (the error itself is
        logged where its client is answered: api_errors)."""
        dropped = self.cache.forget(sources)
        if dropped:
            _log.warning(
                "request %d (%d prompt tokens%s) failed (%s): dropped the %d prompt-cache "
                "entr%s it came from", job.number, len(job.request.prompt_ids),
                ", an editor's" if job.editor else "", type(e).__name__, dropped,
                "y" if dropped == 1 else "ies",
            )  # fmt: skip

    def label(self, job: Job) -> None:
        """What the response reports of ``job``: its k setting and its drafter (the draft's
        alias, "lookup" or "none")."""
        r = job.request
        job.k_label = str(r.k)
        job.drafter_name = self.draft.spec.alias if r.uses_draft else str(r.drafter)

    def note_cache(self) -> None:
        """The prompt cache's figures into the totals, for /metrics: the cache is this
        thread's alone (PromptCache is not thread-safe), so the server reads these."""
        t, c = self.totals, self.cache
        t.cache_bytes, t.cache_entries, t.moved_tokens = c.nbytes, len(c.entries), c.moved_tokens

    def count(self, stats: Stats, cancelled: bool) -> None:
        """A request has ended: its figures into the server's totals (/metrics).

        stats: the request's; cancelled: it ended because its client hung up."""
        t = self.totals
        t.requests += 1
        t.cancelled += cancelled
        t.prompt_tokens += stats.prompt_tokens
        t.cached_tokens += stats.cached_tokens
        t.cache_hits += stats.cached_tokens > 0
        t.generated += stats.generated
        t.drafted += stats.drafted
        t.accepted += stats.accepted
        t.rounds += stats.rounds
        t.tree_rounds += stats.tree_rounds
        t.decode_s += stats.decode_s
        t.prefill_s += stats.prefill_s
        mx.clear_cache()  # between requests: give the allocator's free blocks back
