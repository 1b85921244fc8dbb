"""Adaptive draft length: each round, pick the k that maximizes expected tokens per second.

Model: each draft token is accepted with probability a given the ones before it, so a round
drafting k tokens yields E[tokens] = 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a) and costs
k * t_draft + t_verify(k). All three are estimated live from the engine's per-round stats.
k only changes how many tokens are drafted, never which tokens come out: it stays lossless.
"""

from __future__ import annotations

import hashlib
import json
import platform
import statistics
import time
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

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

    It plans with an optimistic acceptance (estimate + ``explore`` standard errors), so a draft
    is not written off after one unlucky round; after ``reprobe_every`` plain rounds it fades
    what it knows and drafts once more, doubling the wait each time the probe disappoints.
    ``verify_ratio[k]`` seeds t_verify(k) / t_verify(0) (see ``probe_verify``); otherwise
    verification is assumed to cost 10% more per extra token until measured.
    """

    k_max: int = 8
    decay: float = 0.9  # weight of history, per draft token for a and per round for times
    reprobe_every: int = 8  # plain rounds before drafting again to re-measure a
    explore: float = 0.5  # standard errors of optimism in the acceptance estimate
    verify_ratio: list[float] | None = None
    a: float = 0.6  # prior acceptance, worth ``prior_weight`` observed draft tokens
    prior_weight: float = 2.0
    t_draft: float | None = None
    _verify: dict[int, float] = field(default_factory=dict)
    _wins: float = 0.0
    _tries: float = 0.0
    _zeros: int = 0
    _wait: int = 0
    _seen_rounds: int = 0

    def __call__(self, stats: Stats) -> int:
        if stats.rounds > self._seen_rounds:
            self._seen_rounds = stats.rounds
            self.update(stats.last_k, stats.last_accepted, stats.last_draft_s, stats.last_target_s)
        if not self._verify:
            return min(2, self.k_max)  # measure something first
        k = best_k(self.optimistic, self.t_draft or 0.0, self.verify_curve(), self.k_max)
        if k > 0:
            self._zeros, self._wait = 0, self.reprobe_every
            return k
        self._zeros += 1
        if self._zeros >= max(self._wait, self.reprobe_every):  # the text may have got easier
            self._zeros, self._wait = 0, 2 * max(self._wait, self.reprobe_every)
            self._wins, self._tries = 0.5 * self._wins, 0.5 * self._tries
            return 1
        return 0

    @property
    def acceptance(self) -> float:
        return (self.a * self.prior_weight + self._wins) / (self.prior_weight + self._tries)

    @property
    def optimistic(self) -> float:
        a, n = self.acceptance, self.prior_weight + self._tries
        return min(1.0, a + self.explore * (a * (1 - a) / n) ** 0.5)

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


def pass_time(model, ids: list[int], n: int, reps: int = 3) -> float:
    """Median seconds of one forward pass over n tokens after a prefill of ``ids``."""
    cache = make_prompt_cache(model)
    model(mx.array(ids, dtype=mx.uint32)[None], cache=cache)
    mx.eval([c.state for c in cache])
    x = mx.array((ids * n)[:n], dtype=mx.uint32)[None]
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        mx.eval(model(x, cache=cache))
        times.append(time.perf_counter() - t0)
        trim_prompt_cache(cache, n)
    return statistics.median(times[1:])  # the first is a warm-up


def probe_verify(model, ids: list[int], k_max: int = 8, reps: int = 1) -> list[float]:
    """t_verify(k) / t_verify(0) for k in 0..k_max: a target pass over k + 1 tokens against
    one token. On Metal this curve is known not to be flat; adaptive k needs it."""
    ids = ids[-64:] or [0]
    t1 = pass_time(model, ids, 1, reps)
    return [1.0] + [pass_time(model, ids, k + 1, reps) / t1 for k in range(1, k_max + 1)]


def cached_probe(model, identity: str, ids: list[int], k_max: int = 8) -> list[float]:
    """probe_verify, cached on disk per machine, backend and model (``identity``)."""
    from .bench import blas_in_use
    from .registry import specmlx_home

    machine = f"{platform.node()}|{platform.machine()}|{mx.default_device()}|{blas_in_use()}"
    key = hashlib.sha1(f"{machine}|mlx {mx.__version__}|{identity}|{k_max}".encode()).hexdigest()
    path = specmlx_home() / "probes" / f"{key[:16]}.json"
    try:
        return json.loads(path.read_text())["ratio"]
    except (OSError, ValueError, KeyError):
        pass
    ratio = probe_verify(model, ids, k_max)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"identity": identity, "machine": machine, "ratio": ratio}))
    return ratio
