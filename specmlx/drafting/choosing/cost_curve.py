"""What a round costs, learned from rounds: the target's pass-cost curve by length and the
seconds of a draft token (adaptive.AdaptiveK reads it; trees.py and lookahead.py size trees
from it). probe.py times the target for the curve's first shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# the first timings of the draft are taken at their minimum, later ones averaged
EARLY_TIMES = 3
# token counts the pass-cost probe times (probe.py); the curve between them is interpolated
PROBE_SIZES = (*range(1, 10), 12, 16, 32)


@dataclass
class CostCurve:
    """What rounds cost, learned from rounds: t_draft seconds per draft token, and
    t_verify(k) = level * shape[k] for a target pass over k + 1 tokens. Every round updates the
    level (so no k keeps a stale or spiked time); the shape is the probed ``pass_ratio``
    corrected per k (``fix``) as rounds at that k come in. Observations are clipped to
    [1/2, 2] x the prediction before averaging, so one descheduled round does not move the
    plan. The engine times drafting apart on one drafting round in eight and on the first
    after plain rounds; the first EARLY_TIMES timings count at their minimum. Plain rounds are
    timed directly (t_plain): a plain round over one token can cost much less than the probe's
    shape says (a round with drafts also pays for the draft's catch-up, rollback and
    acceptance), and it is what speculation must beat.

    time_decay: weight of the level, t_draft and t_plain, per round; shape_decay: weight of a
    k's correction, per round at that k (the level takes most of any change); pass_ratio:
    the probe's t_verify(k) / t_verify(0) (None: +10% a token); t_draft, level (seconds of a
    target pass over one token), t_plain: None until timed; fix: per k, how far the probe's
    shape was off (None: nowhere yet); draft_timed: draft timings folded in.
    """

    time_decay: float = 0.8
    shape_decay: float = 0.98
    pass_ratio: list[float] | None = None
    t_draft: float | None = None
    level: float | None = None
    t_plain: float | None = None
    fix: dict[int, float] | None = None
    draft_timed: int = 0
    # per k, the fastest target pass over k + 1 tokens a round has shown (rounds that hold
    # the whole pass: lookup, drafting timed apart; not plain rounds, whose pass may start in
    # the round before, round.py): what lowers the probe's curve on disk (ChooserStore.save)
    fastest: dict[int, float] = field(default_factory=dict, repr=False, compare=False)
    # (the last curve built and what it was built from: never saved)
    _memo: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.fix = {int(k): v for k, v in (self.fix or {}).items()}  # JSON keys are strings

    def curve(self, k_last: int) -> list[float]:
        """t_verify(k) for k in 0..k_last, never cheaper than a smaller k. Built once per
        change of what it depends on (a round asks for it several times)."""
        key = (self.level, tuple(self.fix.items()), id(self.pass_ratio), k_last)
        if self._memo is not None and self._memo[0] == key:
            return self._memo[1]
        curve = []
        for k in range(k_last + 1):
            t = (self.level or 0.0) * self.shape(k)
            curve.append(max(t, curve[-1]) if curve else t)
        self._memo = (key, curve)
        return curve

    def tree_curve(self, k_last: int, dips: bool = True) -> list[float]:
        """t_verify(n) for n in 0..k_last where the drafter picks n (a token tree's nodes):
        ``curve``'s, except at the token counts the probe timed, where a pass is taken at
        what was measured even when that is less than a narrower pass's: some hardware runs
        a wider pass faster (this CPU's BLAS: 16 tokens in 0.75x the time of 9), and a
        tree can fill it with leaves. Between the timed counts an interpolated dip is not
        trusted. In units of a one-token pass until a round is timed (``level`` None).

        dips: False never lets a wider pass cost less (a sampled round's acceptance works
        over every node's whole distribution, a cost the probe does not time: a run that
        filled the dip there lost to the chain, BENCHMARKS.md "Token trees")."""
        level = self.level or 1.0
        clamped = [level * self.shape(0)]
        for n in range(1, k_last + 1):
            clamped.append(max(level * self.shape(n), clamped[-1]))
        timed = len(self.pass_ratio or ()) if dips else 0
        return [level * self.shape(n) if n + 1 in PROBE_SIZES and n < timed else t
                for n, t in enumerate(clamped)]  # fmt: skip

    def plain_seconds(self) -> float:
        """A plain step: the lower of the timed one and the curve's t_verify(0). A wrong stop
        re-measures itself (plain rounds follow), a wrong go would not."""
        t0 = (self.level or 0.0) * self.shape(0)
        return min(self.t_plain or t0, t0)

    def draft_share(self, k: int, made: int, round_s: float) -> float | None:
        """The drafting seconds of a round whose drafting was not timed apart (``made`` draft
        steps, k verified, ``round_s`` in all), split in the predicted proportions, so a
        machine-wide slowdown shows in both models' times (the timed rounds correct the
        split). None until both are timed."""
        if not (self.t_draft and self.level):
            return None
        draft = made * self.t_draft
        return round_s * draft / (draft + self.level * self.shape(k))

    def time_draft(self, step: float, timed: bool) -> None:
        """Fold in ``step`` seconds a draft token; ``timed``: measured apart, not split off a
        round by draft_share."""
        self.draft_timed += timed
        if self.t_draft is None:
            self.t_draft = step
        elif timed and self.draft_timed <= EARLY_TIMES:
            # the first few timings: noise only ever makes a draft look slower, and one slow
            # first timing (a busy machine) made auto stop drafting for good
            self.t_draft = min(self.t_draft, step)
        else:
            self.t_draft = self.blend(self.t_draft, step)

    def time_plain(self, round_s: float) -> None:
        """Fold in a plain round that took ``round_s`` seconds."""
        self.t_plain = round_s if self.t_plain is None else self.blend(self.t_plain, round_s)

    def time(self, k: int, target_s: float) -> None:
        """Fold in a target pass over k + 1 tokens that took ``target_s`` seconds."""
        shape = self.shape(k)
        if self.level is None:
            self.level = target_s / shape
            return
        predicted = self.level * shape
        self.level = self.blend(predicted, target_s) / shape
        # k = 0 anchors the shape; the rest learn how far the probe was off, but only from
        # ordinary rounds: a round the clip caught moves the level, never the shape
        if k > 0 and predicted / 2 < target_s < 2 * predicted:
            seen = target_s / (self.level * self.ratio(k))
            old = self.fix.get(k, 1.0)
            self.fix[k] = self.shape_decay * old + (1 - self.shape_decay) * seen

    def passed(self, k: int, target_s: float) -> None:
        """A round whose target pass over k + 1 tokens took at most ``target_s`` seconds
        (its time holds nothing else that could be mistaken for the pass: only ever more)."""
        self.fastest[k] = min(target_s, self.fastest.get(k, target_s))

    def ratio(self, k: int) -> float:
        """The probe's t_verify(k) / t_verify(0)."""
        r = self.pass_ratio
        if r and k < len(r):
            return r[k]
        # +10% a token past what was probed (a saved curve may end at 8, short of a long lookup)
        return (r[-1] if r else 1.0) + 0.1 * (k - (len(r) - 1 if r else 0))

    def shape(self, k: int) -> float:
        """t_verify(k) / level: the probe's ratio, as corrected by the rounds at k."""
        return self.ratio(k) * self.fix.get(k, 1.0)

    def blend(self, old: float, new: float) -> float:
        """EWMA with the new value clipped to [old / 2, 2 old]: robust to one slow round."""
        new = min(max(new, old / 2), 2 * old)
        return self.time_decay * old + (1 - self.time_decay) * new
