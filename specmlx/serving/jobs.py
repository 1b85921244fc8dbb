"""What the worker hands the MLX thread's loops: a job (a request, where its events go, its
live figures), the FIFO they wait in, the server's counters, and ``Host``: the one typed
interface through which the batch loop (batcher.py), the ranks' follower (follower.py) and
a joining row reach the Worker that runs them, so none of them reads the worker whole."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from ..core.kvstate import KVState
from ..core.stats import Stats
from ..decoding.session import Request, Session
from ..distributed.ranks import Watchdog, World
from ..drafting.choosing.choosers import ChooserStore
from ..drafting.choosing.tree_size import TreeSize
from .prompt_cache import PromptCache

# ("piece", TokenEvent with its text) | ("done", Stats) | ("error", exc)
Emit = Callable[[str, object], None]


@dataclass
class Job:
    """A request in the worker's hands: what it asks (``request``, the same on every rank),
    where its events go (``emit``), whether its client left (``cancelled``), its live
    figures (``stats``) and what the response reports of it. editor: an editor's request
    (/infill): the newest runs first when batched, and a warm-up waits until the editors are
    quiet (rank 0's scheduling only: it does not travel to the other ranks)."""

    request: Request
    emit: Emit
    editor: bool = False
    cancelled: threading.Event = field(default_factory=threading.Event)
    stats: Stats = field(default_factory=Stats)
    k_label: str = ""  # the k setting, for the response
    drafter_name: str = ""  # the draft's alias, "lookup" or "none"
    number: int = 0  # the worker numbers the jobs it is given, for its log lines

    def cancel(self) -> None:
        """Stop generating (within one round) or, if still queued, never start."""
        self.cancelled.set()


@dataclass
class Totals:
    """Counters since the server started, for /metrics (written by the worker thread)."""

    requests: int = 0
    cancelled: int = 0
    failed: int = 0
    rejected: int = 0  # 503: the queue was full
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated: int = 0
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    decode_s: float = 0.0
    prefill_s: float = 0.0
    cache_hits: int = 0
    # the prompt cache's size after the last job (the cache itself is the worker thread's
    # alone: PromptCache is not thread-safe, so /metrics reads these instead)
    cache_bytes: int = 0
    cache_entries: int = 0
    moved_tokens: int = 0  # prompt tokens taken from runs moved to new positions
    batch_rows: int = 0  # requests decoding together now (--max-batch > 1)
    batch_rounds: int = 0  # batched target passes (one a round, whatever the rows)
    batch_tree_rounds: int = 0  # of those, passes that verified a token tree a row
    tree_rounds: int = 0  # target passes that verified a tree, per request (as ``rounds``)


class Jobs(queue.Queue):
    """The worker's FIFO of jobs (None: stop), and the one look inside it a scheduler needs."""

    def editor_waiting(self) -> bool:
        """Whether an editor's request (not a warm-up) waits."""
        with self.mutex:  # (a peek: what waits stays where it is)
            return any(j is not None and j.editor and not j.request.warm_up for j in self.queue)


class Host(Protocol):
    """What the batch loop and the ranks' follower read and call of the Worker that runs
    them (serving.worker.Worker is the one implementation). Read: the pair's ``session``,
    its ``cache`` (the prompt cache), ``choosers``, the ``tree`` setting, ``draft_stop``,
    the ranks (``world``, ``watchdog``, ``fatal``: ends this rank with a line), the ``queue``
    and ``stopping``. Written, for /metrics and admission: ``totals``, ``holding`` (requests
    the MLX thread holds), ``busy``, ``last`` (the last finished request's stats)."""

    session: Session
    cache: PromptCache
    choosers: ChooserStore
    tree: TreeSize
    draft_stop: bool
    world: World
    watchdog: Watchdog | None
    fatal: Callable[[str], None] | None
    queue: Jobs
    stopping: bool
    totals: Totals
    holding: int
    busy: bool
    last: Stats | None

    def next_job(self) -> Job | None:
        """The next job (None: stop), waiting for one."""
        ...

    def caches_for(self, r: Request) -> KVState:
        """The caches ``r`` starts from (the prompt cache's best, or fresh ones)."""
        ...

    def serve_alone(self, job: Job) -> bool:
        """Run ``job`` through the engine alone, now (lookup, per-token stopping, warm-ups)."""
        ...

    def refuse(self, job: Job) -> None:
        """Answer ``job`` with ShuttingDown, unrun."""
        ...

    def label(self, job: Job) -> None:
        """Set what the response reports of ``job``: its k setting and drafter."""
        ...

    def failed(self, job: Job, sources: tuple[int, ...], e: Exception) -> None:
        """``job`` failed after taking the prompt-cache entries ``sources``: they go."""
        ...

    def count(self, stats: Stats, cancelled: bool) -> None:
        """A request ended: its figures into ``totals``."""
        ...

    def note_cache(self) -> None:
        """The prompt cache's figures into ``totals``."""
        ...

    def send_ops(self, leave: list[int], join: Request | None, k: list[int] | None) -> None:
        """With ranks: tell the others what the batch does next (wire.BatchOps)."""
        ...

    def stop_followers(self) -> None:
        """With ranks: the others stop following."""
        ...
