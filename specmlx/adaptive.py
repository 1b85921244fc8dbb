"""Adaptive draft length: each round, pick the k that maximizes expected tokens per second.

Model: the first draft token is accepted with probability a, each later one with probability
a_later given the ones before it, so a round drafting k tokens yields
E[tokens] = 1 + a (1 + a_later + ... + a_later^(k-1)) and costs k * t_draft + t_verify(k).
Greedy acceptance is bursty (a_later > a: once the draft is on track it tends to stay there);
a_later = a is the independent case. All of it is estimated live from the engine's per-round
reports, and carried from one generation to the next (a pair's costs and rough acceptance do
not change per prompt).
k only changes how many tokens are drafted, never which tokens come out: it stays lossless.

With prompt lookup as well, each round also weighs the lookup proposal against the draft
model's (or a plain step): lookup drafting costs nothing, so its L tokens cost one target
pass over L + 1, and its acceptance is estimated per match length (a longer matched n-gram
predicts better), with its own a_later. The better expected tokens per second wins. A lookup
proposal may run past the draft model's k_max, up to LOOKUP_MAX, wherever the target's
verify curve is flat enough to pay for it (copied text tends to go on being copied).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from .caches import can_rollback, make_caches, trim
from .stats import RoundReport

CONF_BINS = 10  # per-token stopping: acceptance is learned per tenth of draft confidence
# per-token stopping drafts one token, then one more, then two at a time (a host sync per
# chunk): the first drafts are where stopping saves most, and pairs keep the syncs below one
# a token. BENCHMARKS.md ("Per-token draft stopping") has the replays that chose this
# schedule over starting with the chooser's k or with pairs (scripts/stop_sim.py).
DRAFT_CHUNKS = (1, 1, 2)
# the first timings of the draft are taken at their minimum, later ones averaged
EARLY_TIMES = 3
LOOKUP_MAX = 15  # the longest lookup proposal: a target pass over 16 tokens
# token counts a verify probe times; the curve between them is interpolated
PROBE_SIZES = (*range(1, 10), 12, 16)


def _chunk(m: int) -> int:
    """Per-token stopping: how many to draft next after m drafts (DRAFT_CHUNKS, then pairs)."""
    return DRAFT_CHUNKS[min(m, len(DRAFT_CHUNKS) - 1)]


def expected_tokens(a: float, k: int, a_later: float | None = None) -> float:
    """Tokens one target pass yields with k drafts: the first accepted with probability a,
    each later one with probability a_later given those before it (default a: independent)."""
    c = a if a_later is None else a_later
    run = float(k) if c >= 1.0 else (1.0 - c**k) / (1.0 - c)  # 1 + c + ... + c^(k-1)
    return 1.0 + a * run


def best_k(
    a: float,
    t_draft: float,
    verify: list[float],
    k_max: int,
    k_min: int = 0,
    a_later: float | None = None,
) -> int:
    """argmax over k in k_min..k_max of E[tokens | a, a_later, k] / (k t_draft + verify[k]).

    a: first-draft acceptance; t_draft: seconds per draft token; ``verify[k]``: seconds of a
    target pass over k + 1 tokens; a_later: acceptance of later drafts (default a)."""
    ks = range(k_min, k_max + 1)
    return max(ks, key=lambda k: expected_tokens(a, k, a_later) / (k * t_draft + verify[k]))


# the saved state's format: bump when LEARNED or a field's meaning changes (old files are then
# ignored, with one warning, and relearned)
STATE_VERSION = 2
# what a saved state holds: the estimates learned from rounds and the measured verify curve
LEARNED = (
    "verify_ratio", "t_draft", "level", "t_plain", "_first", "_later", "_fix", "_conf",
    "_lookup", "_drafting_rounds", "_draft_timed", "_zeros", "_wait",
)  # fmt: skip


@dataclass
class AdaptiveK:
    """A k chooser (stats.KChooser): call it with each round's report, get the next k back.
    Keep one per pair and sampler (choosers.ChooserStore does): the estimates carry over from
    one generation to the next.

    Acceptance: decayed counts (``decay`` per drafting round, ~20 rounds of memory), for the
    first position (a) and for the later ones (a_later, shrunk towards a while it has few
    trials),
    on top of a prior a worth ``prior_weight`` trials that fades like old data.
    Times: t_draft per token (the engine times drafting apart on one drafting round in eight
    and on the first after plain rounds; the first EARLY_TIMES timings count at their minimum),
    and t_verify(k) = level * shape[k]; every round updates the
    level (so no k keeps a stale or spiked time) and the shape is the probed ``verify_ratio``
    corrected per k as rounds at that k come in. Observations are clipped to [1/2, 2] x the
    prediction before averaging, so one descheduled round does not move the plan.
    Plain steps are timed directly (``t_plain``): the second round ever is a plain one, since a
    plain round over one token can cost much less than the probe's shape says (a round with
    drafts also pays for the draft's catch-up, rollback and acceptance), and k = 0 is what
    speculation must beat. Choice: the best k >= 1 on the point estimate; drafting stops (k = 0)
    when even an optimistic a (``explore`` standard errors up) says plain decoding is faster.
    Every ``neighbor_every`` drafting rounds it tries k +- 1 to keep the curve near the optimum
    measured. Once stopped it stays stopped until, after ``reprobe_every`` plain rounds, it
    drafts once (k = 1) in case the text got easier, doubling the wait while drafts score
    nothing.
    """

    k_max: int = 8  # the most drafts from the draft model
    lookup_max: int = LOOKUP_MAX  # the longest lookup proposal
    decay: float = 0.95  # weight of acceptance history, per drafting round
    time_decay: float = 0.8  # weight of the time level and t_draft, per round
    shape_decay: float = 0.98  # per round at that k: the level takes most of any change
    explore: float = 1.0  # standard errors of optimism before giving up on the draft
    reprobe_every: int = 8  # plain rounds before drafting once more
    neighbor_every: int = 8  # drafting rounds between tries of k +- 1
    verify_ratio: list[float] | None = None
    a: float = 0.6  # prior acceptance, worth ``prior_weight`` draft trials
    prior_weight: float = 2.0
    t_draft: float | None = None  # seconds per draft token
    level: float | None = None  # seconds of a target pass over one token
    t_plain: float | None = None  # seconds of a plain round, measured on k = 0 rounds
    _first: list[float] | None = None  # [accepted, tried] at the first position, prior included
    _later: list[float] = field(default_factory=lambda: [0.0, 0.0])  # the same after it
    _fix: dict[int, float] = field(default_factory=dict)
    # per-token stopping: [accepted, tried] by draft confidence bin (a draft tried once all
    # before it were accepted)
    _conf: list[list[float]] = field(default_factory=lambda: [[0.0, 0.0] for _ in range(CONF_BINS)])
    # prompt lookup, by match length: [accepted, tried] at the first position, then after it
    _lookup: dict[int, list[float]] = field(default_factory=dict)
    _drafting_rounds: int = 0
    _draft_timed: int = 0  # draft timings folded in
    _zeros: int = 0
    _wait: int = 0

    def __post_init__(self) -> None:
        if self._first is None:
            self._first = [self.a * self.prior_weight, self.prior_weight]
        self._fix = {int(k): v for k, v in self._fix.items()}  # JSON keys are strings
        self._lookup = {int(n): list(v) for n, v in self._lookup.items()}
        self._conf = [[float(w), float(t)] for w, t in self._conf]
        if len(self._conf) != CONF_BINS:  # saved with other bins: start them afresh
            self._conf = [[0.0, 0.0] for _ in range(CONF_BINS)]

    def __call__(self, last: RoundReport | None) -> int:
        """The next round's k, after folding in ``last`` (None: a generation starts; what
        was learned in earlier ones carries over)."""
        if last is not None:
            self.update(
                last.k, last.accepted, last.seconds, last.draft_seconds, last.lookup, last.made
            )
            self._observe(last.confidences[: last.k], last.accepted)
        if self.level is None:
            return min(2, self.k_max)  # measure something first
        if self.t_plain is None:
            return 0  # then what it must beat
        # once it has stopped, only a probe restarts drafting: plain rounds alone make the
        # estimates no better, and the probe's outcome is what the next choice should see
        k = 0 if self._zeros else self.best_now()
        if k > 0:
            self._drafting_rounds += 1
            if self.neighbor_every and self._drafting_rounds % self.neighbor_every == 0:
                step = 1 if (self._drafting_rounds // self.neighbor_every) % 2 else -1
                k = min(self.k_max, max(1, k + step))
            return k
        self._zeros += 1
        if self._zeros > max(self._wait, self.reprobe_every):  # the text may have got easier
            self._zeros = 0
            self._wait = min(2 * max(self._wait, self.reprobe_every), 8 * self.reprobe_every)
            return 1
        return 0

    def plain_next(self) -> bool:
        """True when the next call returns 0 whatever the current round brings (it has
        stopped and the probe is not due): the engine then queues the next plain pass early."""
        return 0 < self._zeros < max(self._wait, self.reprobe_every)

    def best_now(self) -> int:
        """The k the estimates favour now, before probing and neighbour exploration."""
        td, curve, later = self.t_draft or 0.0, self.verify_curve(), self.continuation
        k = best_k(self.acceptance, td, curve, self.k_max, k_min=1, a_later=later)
        rate = expected_tokens(self.optimistic, k, later) / (k * td + curve[k])
        # the lower of the two plain-step estimates: a wrong stop re-measures itself (plain
        # rounds follow), a wrong go would not
        t0 = min(self.t_plain or curve[0], curve[0])
        return k if rate > 1.0 / t0 else 0

    @property
    def acceptance(self) -> float:
        """a: the chance that the first draft token is accepted."""
        wins, tries = self._first
        return wins / tries

    @property
    def continuation(self) -> float:
        """a_later: the chance that a later draft token is accepted when all before it were."""
        wins, tries = self._later
        return (self.acceptance * self.prior_weight + wins) / (self.prior_weight + tries)

    @property
    def optimistic(self) -> float:
        a, n = self.acceptance, self._first[1]
        return min(1.0, a + self.explore * (a * (1 - a) / n) ** 0.5)

    def draft_plan(self, confidences: Sequence[float], drafted: int = 0) -> tuple[int, int]:
        """Per-token stopping, after drafting len(confidences) tokens (the draft's
        probability of each): (L, more) = keep the first L drafts, or first draft ``more``
        and ask again; with nothing drafted, (0, the round's first chunk).

        After j drafts the round goes on while some longer round, j + e drafts for any e,
        is expected to yield more tokens per second than stopping at j: with R = P(drafts
        1..j all accepted), from what drafts at each confidence scored before, and the
        unseen drafts accepted at a_later each, E[tokens | j + e] = E[tokens | j] +
        R (a_later + ... + a_later^e), for (j + e) t_draft + curve[j + e]. Looking past the
        next draft matters where the verify curve is steep at first and flat later (one
        more draft does not pay, four do). ``drafted``: how many drafts the round committed
        to before reading any confidence; their drafting is sunk, so verifying one of them
        costs only its share of the target pass.

        Whether draft j is kept depends only on the confidences of drafts 1..j-1, as if the
        draft had stopped there, never on its own: keeping drafts for their own q would
        favour some tokens over others and bias sampling (tests/test_distribution.py). The
        same rule serves greedy decoding, where it is not needed for exactness but keeps the
        learning honest: a rule that dropped doubtful drafts for their own confidence would
        stop seeing how often such drafts pass, and kept too few (BENCHMARKS.md, "Per-token
        draft stopping", has the figures)."""
        m = len(confidences)
        if m == 0:
            return 0, min(_chunk(0), self.k_max)
        if self.level is None:  # nothing timed yet: verify what was drafted, and time it
            return m, 0
        td, curve, later = self.t_draft or 0.0, self.verify_curve(), self.continuation

        def cost(n: int) -> float:  # a round verifying n drafts; the first ``drafted`` sunk
            return max(n, drafted) * td + curve[n]

        run = total = 1.0  # P(drafts 1..j accepted); expected tokens of a round with j drafts
        for j in range(1, m + 1):
            run *= self.confident(confidences[j - 1])
            total += run
            if j >= self.k_max:
                return j, 0
            best, gain, step = total / cost(j), total, run
            for n in range(j + 1, self.k_max + 1):  # the unseen drafts: a_later each
                step *= later
                gain += step
                if gain / cost(n) > best:
                    break
            else:
                return j, 0
        return m, min(_chunk(m), self.k_max - m)

    def confident(self, confidence: float) -> float:
        """The chance that a draft the draft model gave probability ``confidence`` is
        accepted when those before it were: learned per bin, a_later as the prior."""
        wins, tries = self._conf[min(int(confidence * CONF_BINS), CONF_BINS - 1)]
        return (self.continuation * self.prior_weight + wins) / (self.prior_weight + tries)

    def _observe(self, confidences: Sequence[float], n: int) -> None:
        """Fold in a round's confidences: drafts 1..n were accepted, draft n + 1 was not."""
        for i, c in enumerate(confidences[: n + 1]):
            counts = self._conf[min(int(c * CONF_BINS), CONF_BINS - 1)]
            counts[0] = self.decay * counts[0] + (i < n)
            counts[1] = self.decay * counts[1] + 1

    def lookup_length(self, match: int, available: int, k: int, draft: bool) -> int:
        """How many of ``available`` lookup tokens (found by a ``match``-token n-gram) to
        verify this round: the length with the most expected tokens per second, or 0 when the
        alternative is worth more: drafting k tokens with the draft model (``draft``, k > 0),
        else a plain step. Optimistic by ``explore`` standard errors, as for stopping."""
        lengths = range(1, min(available, self.lookup_max) + 1)
        if not lengths or self.level is None:  # nothing timed yet: try it, and time it
            return len(lengths)
        curve = self.verify_curve()
        a, later = self.lookup_acceptance(match, optimistic=True), self.lookup_continuation(match)
        best = max(lengths, key=lambda n: expected_tokens(a, n, later) / curve[n])
        value = expected_tokens(a, best, later) / curve[best]
        if draft and k > 0:
            td = self.t_draft or 0.0
            rival = expected_tokens(self.acceptance, k, self.continuation) / (k * td + curve[k])
        else:
            rival = 1.0 / min(self.t_plain or curve[0], curve[0])
        return best if value > rival else 0

    def lookup_acceptance(self, match: int, optimistic: bool = False) -> float:
        """The chance that the first token of a lookup proposal found by a ``match``-token
        n-gram is accepted (prior: 0.5 for a 1-gram, up to 0.8; worth ``prior_weight``)."""
        wins, tries = self._lookup.get(match, [0.0] * 4)[:2]
        prior = min(0.8, 0.4 + 0.1 * match)
        a = (prior * self.prior_weight + wins) / (self.prior_weight + tries)
        if optimistic:
            a += self.explore * (a * (1 - a) / (self.prior_weight + tries)) ** 0.5
        return min(1.0, a)

    def lookup_continuation(self, match: int) -> float:
        """a_later for lookup after a ``match``-token n-gram: copied text tends to go on
        being copied, more so after a long match."""
        wins, tries = self._lookup.get(match, [0.0] * 4)[2:]
        prior = self.lookup_acceptance(match)
        return (prior * self.prior_weight + wins) / (self.prior_weight + tries)

    def update(
        self,
        k: int,
        n: int,
        round_s: float,
        draft_s: float | None = None,
        lookup: int = 0,
        made: int | None = None,
    ) -> None:
        """Fold one round in: n of k drafts accepted in ``round_s`` seconds, of which
        ``draft_s`` drafting when it was timed apart; ``lookup`` > 0: prompt lookup proposed
        them from a match that long (its acceptance is learned apart, its drafting is free);
        ``made``: drafts made, when more than k (per-token stopping verified fewer than it
        drafted: the unverified ones cost draft time, not target time)."""
        made = k if made is None else max(made, k)
        timed = draft_s is not None
        if k > 0 and lookup:
            counts = self._lookup.setdefault(lookup, [0.0] * 4)
            first, later = counts[:2], counts[2:]
            self._count(first, later, k, n)
            counts[:] = first + later
            self._time(k, round_s)  # nothing to draft: the round is the target's pass
            return
        if k == 0:
            self.t_plain = round_s if self.t_plain is None else self._blend(self.t_plain, round_s)
        if k > 0 and draft_s is None and self.t_draft and self.level:
            # not timed apart: split the round in the predicted proportions, so a machine-wide
            # slowdown shows in both models' times; the timed rounds correct the split
            draft = made * self.t_draft
            draft_s = round_s * draft / (draft + self.level * self._shape(k))
        if k > 0:
            self._count(self._first, self._later, k, n)
            if n > 0:
                self._wait = self.reprobe_every  # the draft scored: no backing off
            if draft_s is not None:
                step = draft_s / made
                self._draft_timed += timed
                if self.t_draft is None:
                    self.t_draft = step
                elif timed and self._draft_timed <= EARLY_TIMES:
                    # the first few timings: noise only ever makes a draft look slower, and one
                    # slow first timing (a busy machine) made auto stop drafting for good
                    self.t_draft = min(self.t_draft, step)
                else:
                    self.t_draft = self._blend(self.t_draft, step)
        self._time(k, max(round_s - (draft_s or 0.0), 1e-9))

    def _count(self, first: list[float], later: list[float], k: int, n: int) -> None:
        """Decayed acceptance counts: position 1 was tried once; positions 2..min(n + 1, k)
        were tried when the one before passed."""
        tried_later = (n - 1, min(n + 1, k) - 1) if n > 0 else (0, 0)
        for counts, (wins, tries) in ((first, (n > 0, 1)), (later, tried_later)):
            counts[0] = self.decay * counts[0] + wins
            counts[1] = self.decay * counts[1] + tries

    def _time(self, k: int, target_s: float) -> None:
        """Fold in a target pass over k + 1 tokens that took ``target_s`` seconds."""
        shape = self._shape(k)
        if self.level is None:
            self.level = target_s / shape
            return
        predicted = self.level * shape
        self.level = self._blend(predicted, target_s) / shape
        # k = 0 anchors the shape; the rest learn how far the probe was off, but only from
        # ordinary rounds: a round the clip caught moves the level, never the shape
        if k > 0 and predicted / 2 < target_s < 2 * predicted:
            seen = target_s / (self.level * self._ratio(k))
            old = self._fix.get(k, 1.0)
            self._fix[k] = self.shape_decay * old + (1 - self.shape_decay) * seen

    def verify_curve(self) -> list[float]:
        """t_verify(k) for k in 0..max(k_max, lookup_max), never cheaper than a smaller k.
        Built once per change of what it depends on (a round asks for it several times)."""
        key = (self.level, tuple(self._fix.items()), id(self.verify_ratio), self.k_max)
        key += (self.lookup_max,)
        memo = self.__dict__.get("_curve_memo")  # (not a field: never saved)
        if memo is not None and memo[0] == key:
            return memo[1]
        curve = []
        for k in range(max(self.k_max, self.lookup_max) + 1):
            t = (self.level or 0.0) * self._shape(k)
            curve.append(max(t, curve[-1]) if curve else t)
        self.__dict__["_curve_memo"] = (key, curve)
        return curve

    def state(self) -> dict:
        """What was learned, JSON-ready, with the format's version; ``AdaptiveK.resume``
        resumes it. The settings (k_max, the decays, explore, ...) are not saved, so a
        changed default reaches machines that already have a state file."""
        return {"version": STATE_VERSION, **{name: getattr(self, name) for name in LEARNED}}

    @classmethod
    def resume(cls, state: dict, **settings) -> AdaptiveK:
        """The chooser ``state()`` described, with today's settings (or ``settings``).
        ValueError for a state of another format version."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(f"not a version {STATE_VERSION} chooser state")
        return cls(**settings, **{name: state[name] for name in LEARNED if name in state})

    def _ratio(self, k: int) -> float:
        r = self.verify_ratio
        if r and k < len(r):
            return r[k]
        # +10% a token past what was probed (a curve saved before lookup ran longer ends at 8)
        return (r[-1] if r else 1.0) + 0.1 * (k - (len(r) - 1 if r else 0))

    def _shape(self, k: int) -> float:
        return self._ratio(k) * self._fix.get(k, 1.0)

    def _blend(self, old: float, new: float) -> float:
        """EWMA with the new value clipped to [old / 2, 2 old]: robust to one slow round."""
        new = min(max(new, old / 2), 2 * old)
        return self.time_decay * old + (1 - self.time_decay) * new


def pass_times(model, ids: list[int], ns: list[int], reps: int = 3) -> dict[int, float]:
    """Seconds of one forward pass over n tokens after a prefill of ``ids``, for each n in
    ``ns``: the sizes take turns within each repetition, so drift hits them alike, and the
    fastest repetition is kept, since on a shared machine noise only ever adds time."""
    cache = make_caches(model)
    model(mx.array(ids, dtype=mx.uint32)[None], cache=cache)
    mx.eval([c.state for c in cache])
    best = dict.fromkeys(ns, float("inf"))
    for rep in range(reps + 1):  # the first is a warm-up
        for n in ns:
            x = mx.array((ids * n)[:n], dtype=mx.uint32)[None]
            t0 = time.perf_counter()
            mx.eval(model(x, cache=cache))
            if rep:
                best[n] = min(best[n], time.perf_counter() - t0)
            if can_rollback(cache, n):  # recurrent state just runs on: the timing is the same
                trim(cache, n)
    return best


def head_step_seconds(head, reps: int = 3) -> float:
    """Seconds of one step of a head over the target's hidden states (an MTP head: one pair
    in, one token's logits out), the fastest of ``reps`` after a warm-up."""
    cache = head.make_cache()
    hidden = mx.zeros((1, 1, head.norm.weight.shape[0]))
    token = mx.zeros((1, 1), dtype=mx.uint32)
    best = float("inf")
    for rep in range(reps + 1):
        t0 = time.perf_counter()
        mx.eval(head(hidden, token, cache))
        if rep:
            best = min(best, time.perf_counter() - t0)
        trim(cache, 1)
    return best


def curve_from(times: dict[int, float], k_max: int) -> list[float]:
    """t_verify(k) / t_verify(0) for k in 0..k_max from passes timed over some token counts
    (``times``: n tokens -> seconds, n = 1 among them): linear between the counts timed,
    flat past the largest."""
    ns = sorted(times)
    out = []
    for n in range(1, k_max + 2):
        lo = max(m for m in ns if m <= n)
        hi = min((m for m in ns if m >= n), default=lo)
        w = 0.0 if hi == lo else (n - lo) / (hi - lo)
        out.append(((1 - w) * times[lo] + w * times[hi]) / times[1])
    return out


def probe_verify(model, ids: list[int], k_max: int = LOOKUP_MAX, reps: int = 3) -> list[float]:
    """t_verify(k) / t_verify(0) for k in 0..k_max: a target pass over k + 1 tokens against
    one token, timed at PROBE_SIZES (and k_max + 1) and interpolated between. On Metal this
    curve is known not to be flat; adaptive k needs it."""
    sizes = sorted({n for n in PROBE_SIZES if n <= k_max + 1} | {k_max + 1})
    return curve_from(pass_times(model, ids[-64:] or [0], sizes, reps), k_max)
