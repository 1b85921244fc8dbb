"""The one driver of rounds: rows, the target's verifier and the drafter, a round at a time.

A lone generation (engine.py) and a batch (batch.py) are the same driver over the same
``Row`` state and the same row drafters (drafting.row_drafters): they differ in who verifies
(verifiers.LoneTarget: one row over its own Cursor, every cache kind, a queued plain pass;
verifiers.RowsTarget: the rows' batch caches) and in how rows come and go (a lone
generation's one row from prefill to its stop; a batch's join and leave between rounds).
What only a lone row can do is the verifier's or the drafter's to refuse by name: a
LoneTarget verifies one row, a lone drafter (lookup, per-token stopping) refuses to join a
batch.

``DraftClock`` is when a row's own adaptive chooser gets its draft timed apart (a second host
sync): the engine's lone row and a batching server's lone row keep one each.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..core.stats import RoundReport, TokenEvent
from ..drafting.proposals import RowDrafter
from .round import Row, Verifier, one_round

__all__ = ["DraftClock", "Driver", "TIME_DRAFT_EVERY"]

# drafting rounds: the first, the first after plain rounds (while drafting is rare, as when
# adaptive k has stopped and probes now and then, one in 8 would leave the draft's time
# unmeasured for a whole generation) and then one in 8 get a second host sync, to time the
# draft apart
TIME_DRAFT_EVERY = 8


@dataclass
class DraftClock:
    """Which of a row's drafting rounds time the draft apart, for its own adaptive chooser
    (see TIME_DRAFT_EVERY). drafting: drafting rounds since the count last restarted."""

    drafting: int = 0

    def timed(self, k: int, last: RoundReport | None, queued: bool = False) -> bool:
        """Whether the next round, drafting ``k``, times its draft apart. last: the row's
        previous round (None: none yet; a plain one restarts the count); queued: a plain
        pass is already queued (its wait would fall inside the draft's time: not this one)."""
        if last is not None and last.k == 0:
            self.drafting = 0
        if k <= 0 or queued:
            return False
        self.drafting += 1
        return (self.drafting - 1) % TIME_DRAFT_EVERY == 0


class Driver:
    """Rows decoded a round at a time by one verifier and one drafter: ``round(k)`` runs
    round.one_round over every row; ``reports`` holds the last round's RoundReports (a row
    each, in row order) and ``tree_pass`` whether it verified a token tree.

    verifier: the target's side (round.Verifier); drafter: what drafts for the rows (None:
    plain steps); rows: the rows to start with (a lone generation's one)."""

    def __init__(self, verifier: Verifier, drafter: RowDrafter | None, rows: Sequence[Row] = ()):
        self.verifier, self.drafter = verifier, drafter
        self.rows: list[Row] = list(rows)
        self.tree_pass = False  # the last round verified a tree a row
        self.reports: list[RoundReport] = []  # the last round's, a row each, in row order

    def round(
        self,
        k: int | Sequence[int],
        timed: bool = False,
        plain_next: Callable[[], bool] | None = None,
    ) -> list[list[TokenEvent]]:
        """One round for every row; each row's new token events, in row order (a row that
        reached a stop is marked ``done``; in a batch it must leave before the next round).
        k: drafts per row, one for all or one each (0, or no drafter: one plain step);
        timed: time the draft apart (a second host sync: for a row's own adaptive chooser,
        DraftClock); plain_next: a lone row's chooser says the next round is plain too, so
        its pass is queued before this one is read back (round.one_round)."""
        rows = self.rows
        if any(r.done for r in rows):
            raise RuntimeError("a finished row must leave before the next round")
        if not rows:
            return []
        asked = [k] * len(rows) if isinstance(k, int) else list(k)
        if len(asked) != len(rows):
            raise ValueError(f"{len(asked)} k for {len(rows)} rows")
        out = one_round(
            rows, self.verifier, self.drafter, asked, timed=timed, plain_next=plain_next
        )
        self.tree_pass = any(report.chain is not None for _, report in out)
        self.reports = [report for _, report in out]
        return [events for events, _ in out]

    def close(self) -> None:
        """The generation is over: the drafter lets go of what it holds."""
        if self.drafter is not None:
            self.drafter.close()
