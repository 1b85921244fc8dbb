"""Editors' warm-ups (llama.vim's n_predict 0), held until no editor request runs or waits.

A warm-up fills the prompt cache for a later suggestion; its prefill, run between two rounds
of a suggestion someone is waiting for (or just before the follow-up an editor sends as soon
as it has an answer), delayed that suggestion by the whole prefill. So the worker keeps them
here and runs one only once the editors are quiet (batcher.Batcher._warm_up; one at a time,
Worker._run).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..core.stats import Stats
from .jobs import Totals

MAX_WAITING = 4  # warm-ups held at once; past it the oldest is answered at once, unrun


class WarmUps:
    """The warm-ups waiting, oldest first, and when the editors were last busy.

    totals: the server's counters (a warm-up whose client left counts as cancelled); count:
    counts a request that ended (jobs.Host.count: one answered unrun, past MAX_WAITING)."""

    def __init__(self, totals: Totals, count: Callable[[Stats, bool], None]):
        self.totals, self.count = totals, count
        self.waiting: list = []  # the jobs
        self.quiet_from = 0.0  # (monotonic) an editor request ended: its follow-up first

    def add(self, job) -> None:
        """Hold ``job``. A newer warm-up carries the newer context (llama.vim's ring of
        chunks only grows and turns over), so past MAX_WAITING the oldest is answered at
        once with nothing filled (its client reads nothing of the answer)."""
        self.waiting.append(job)
        while len(self.waiting) > MAX_WAITING:
            old = self.waiting.pop(0)
            old.stats.finish_reason = "length"
            self.count(old.stats, False)
            old.emit("done", old.stats)

    def drop_gone(self) -> None:
        """Forget the warm-ups whose clients hung up (counted as cancelled)."""
        for job in [j for j in self.waiting if j.cancelled.is_set()]:
            self.waiting.remove(job)
            self.totals.cancelled += 1

    def take(self):
        """The newest waiting warm-up (its context is the freshest), taken off the list."""
        return self.waiting.pop()

    def editor_ended(self, grace: float) -> None:
        """An editor request was answered: its client may send the next one within
        ``grace`` seconds, and a warm-up begun meanwhile would hold that one up."""
        self.quiet_from = time.monotonic() + grace

    def until_quiet(self) -> float:
        """Seconds until the editors' grace is over (0: it is)."""
        return max(0.0, self.quiet_from - time.monotonic())
