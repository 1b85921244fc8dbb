"""Adaptive draft length: each round, pick the k that maximizes expected tokens per second.

Model: each draft token is accepted with probability a given the ones before it, so a round
drafting k tokens yields E[tokens] = 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a) and costs
k * t_draft + t_verify(k). All three are estimated live from the engine's per-round stats.
k only changes how many tokens are drafted, never which tokens come out: it stays lossless.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .engine import Stats


def expected_tokens(a: float, k: int) -> float:
    """Tokens one target pass yields when each draft is accepted with probability a."""
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def best_k(a: float, t_draft: float, verify: list[float], k_max: int) -> int:
    """argmax over k in 0..k_max of E[tokens | a, k] / (k * t_draft + verify[k]).
    ``verify[k]`` is the time of a target pass over k + 1 tokens."""
    rates = [expected_tokens(a, k) / (k * t_draft + verify[k]) for k in range(k_max + 1)]
    return max(range(k_max + 1), key=rates.__getitem__)


@dataclass
class AdaptiveK:
    """A per-generation chooser: call it with the live Stats each round, get k back.

    ``verify_ratio[k]`` optionally seeds t_verify(k) / t_verify(0) (e.g. from a probe);
    otherwise verification is assumed to cost 10% more per extra token until measured.
    """

    k_max: int = 8
    decay: float = 0.9  # weight of history, per draft token for a and per round for times
    reprobe_every: int = 16  # after this many k = 0 rounds, draft once to re-measure a
    verify_ratio: list[float] | None = None
    a: float = 0.6  # prior acceptance, worth ``prior_weight`` observed draft tokens
    prior_weight: float = 1.0
    t_draft: float | None = None
    _verify: dict[int, float] = field(default_factory=dict)
    _wins: float = 0.0
    _tries: float = 0.0
    _zeros: int = 0
    _seen_rounds: int = 0

    def __call__(self, stats: Stats) -> int:
        if stats.rounds > self._seen_rounds:
            self._seen_rounds = stats.rounds
            self.update(stats.last_k, stats.last_accepted, stats.last_draft_s, stats.last_target_s)
        if not self._verify:
            return min(2, self.k_max)  # measure something first
        k = best_k(self.acceptance, self.t_draft or 0.0, self.verify_curve(), self.k_max)
        self._zeros = self._zeros + 1 if k == 0 else 0
        if self._zeros >= self.reprobe_every:  # the text may have become easier
            self._zeros = 0
            return 1
        return k

    @property
    def acceptance(self) -> float:
        return (self.a * self.prior_weight + self._wins) / (self.prior_weight + self._tries)

    def update(self, k: int, n: int, draft_s: float, target_s: float) -> None:
        """Fold one round in: n of k drafts accepted, timings in seconds."""
        if k > 0:
            # n successes, then one failure unless all k were accepted; history fades per
            # draft token seen, so a change in the text shows within ~10 drafts
            trials = n + (n < k)
            fade = self.decay**trials
            self._wins = fade * self._wins + n
            self._tries = fade * self._tries + trials
            if draft_s > 0:
                step = draft_s / k
                self.t_draft = (
                    step if self.t_draft is None else _ewma(self.t_draft, step, self.decay)
                )
        old = self._verify.get(k)
        self._verify[k] = target_s if old is None else _ewma(old, target_s, self.decay)

    def verify_curve(self) -> list[float]:
        """t_verify(k) for k in 0..k_max: measured where seen, else scaled from the nearest
        measured k by the seed ratio (or +10% per token), and never cheaper than a smaller k."""
        ratio = self.verify_ratio or [1.0 + 0.1 * k for k in range(self.k_max + 1)]
        curve = []
        for k in range(self.k_max + 1):
            if k in self._verify:
                t = self._verify[k]
            else:
                near = min(self._verify, key=lambda j: abs(j - k))
                t = self._verify[near] * ratio[k] / ratio[near]
            curve.append(max(t, curve[-1]) if curve else t)
        return curve


def _ewma(old: float, new: float, decay: float) -> float:
    return decay * old + (1.0 - decay) * new
