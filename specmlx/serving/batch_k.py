"""k for a batch (``specmlx serve --max-batch N``): what rounds of each k made per second at
each width, measured as they run, so that at a width where verifying costs more than it
saves the batch backs off to k = 0; and where that is kept between servers.

What BatchK measured is kept per machine and pair under $SPECMLX_HOME/batchk (written
atomically when the batch empties and at stop, best effort: a read-only home costs a
warning; a damaged file is measured again), so a restarted server does not try every k at
every width again. Rank 0's only: it decides for all ranks.
"""

from __future__ import annotations

from pathlib import Path

from ..drafting.choosing.choosers import state_path
from ..paths import Warn, load_json, save_json

K_CHOICES = (0, 1, 2, 3, 4)  # what BatchK picks from


class BatchK:
    """k for a batch of B rows from the tokens per second measured at each (B, k): each k
    is judged on its mean at this width, or, until it has run here, at the nearest width
    where it has (a width the batch has not had yet starts from its neighbours' figures
    instead of trying every k again); a k never run at any width is tried first, and every
    ``explore_every`` rounds the k least tried at this width runs (acceptance changes as
    rows come and go). ``ks``: the candidates."""

    def __init__(self, ks=K_CHOICES, explore_every: int = 16):
        self.ks, self.explore_every = tuple(ks), explore_every
        self.seen: dict[tuple[int, int], list[float]] = {}  # (B, k) -> [tokens, seconds, n]
        self.rounds = 0

    def __call__(self, width: int) -> int:
        """The k for a round of ``width`` rows."""
        for k in self.ks:
            if not any(key[1] == k for key in self.seen):
                return k  # never run: measure it
        self.rounds += 1
        if self.rounds % self.explore_every == 0:
            return min(self.ks, key=lambda k: self.seen.get((width, k), (0, 0, 0))[2])
        return max(self.ks, key=lambda k: self.rate(width, k))

    def rate(self, width: int, k: int) -> float:
        """Tokens per second of k at this width, or at the nearest width it ran at."""
        widths = sorted((b for b, kk in self.seen if kk == k), key=lambda b: abs(b - width))
        tokens, seconds, _ = self.seen[(widths[0], k)]
        return tokens / max(seconds, 1e-9)

    def observe(self, width: int, k: int, tokens: int, seconds: float) -> None:
        """Fold in a round of ``width`` rows at ``k`` that made ``tokens`` in ``seconds``."""
        s = self.seen.setdefault((width, k), [0.0, 0.0, 0])
        decay = 0.9 if s[2] >= 8 else 1.0  # recent rounds weigh more once a few are in
        s[0], s[1], s[2] = s[0] * decay + tokens, s[1] * decay + seconds, s[2] + 1

    def state(self) -> dict:
        """What was measured, JSON-ready (``resume`` reads it back)."""
        return {"version": 1, "seen": {f"{b},{k}": v for (b, k), v in self.seen.items()}}

    def resume(self, state: dict | None) -> None:
        """Take what an earlier server measured on this machine and pair (``state()``'s);
        anything else (another format, garbage) is ignored: it is measured again."""
        try:
            seen = {}
            for key, (tokens, seconds, n) in (state or {}).get("seen", {}).items():
                b, k = (int(x) for x in key.split(","))
                seen[(b, k)] = [float(tokens), float(seconds), int(n)]
            if (state or {}).get("version") == 1:
                self.seen = seen
        except (AttributeError, TypeError, ValueError):
            pass


class KeptBatchK:
    """A BatchK kept on disk for one pair on this machine (see the module).

    target_id, draft_id: the pair's full identities; persist: read and write the file at
    all (False: measured afresh, never saved); warn: how a failed write is told; k: the
    BatchK to keep (a fresh one if None)."""

    def __init__(self, target_id: str, draft_id: str, persist: bool, warn: Warn,
                 k: BatchK | None = None):  # fmt: skip
        self.k = k or BatchK()
        self.path: Path = state_path("batchk", f"{target_id}|{draft_id}")
        self.persist, self.warn = persist, warn
        if persist:
            self.k.resume(load_json(self.path))
        self._saved = self.k.state()

    def save(self) -> None:
        """Write what was measured, when it changed since the last write (best effort)."""
        state = self.k.state()
        if self.persist and state != self._saved:
            save_json(self.path, state, self.warn)
            self._saved = state
