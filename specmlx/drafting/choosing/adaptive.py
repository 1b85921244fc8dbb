"""Adaptive draft length: each round, pick the k that maximizes expected tokens per second.

Model: the first draft token is accepted with probability a, each later one with probability
a_later given the ones before it, so a round drafting k tokens yields
E[tokens] = 1 + a (1 + a_later + ... + a_later^(k-1)) and costs k * t_draft + t_verify(k).
A block drafter (DFlash) drafts all k in one forward: its round costs t_draft + t_verify(k),
t_draft then being the seconds of a block (nearly flat in k), so long blocks are not charged
per token.
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
pass-cost curve is flat enough to pay for it (copied text tends to go on being copied).

By concern: the model (expected_tokens, best_k); Acceptance, what drafts score; CostCurve
(cost_curve.py), what rounds cost; AdaptiveK, the choices that read both (k, the per-token
stopping plan, the lookup length), holding one of each, and the one object the engine and
drafters call.
probe.py times the target for the curve's first shape: it runs models, nothing here does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from ...core.stats import KChooser, RoundReport, count_ranks
from .cost_curve import CostCurve

CONF_BINS = 10  # per-token stopping: acceptance is learned per tenth of draft confidence
# per-token stopping drafts one token, then one more, then two at a time (a host sync per
# chunk): the first drafts are where stopping saves most, and pairs keep the syncs below one
# a token. BENCHMARKS.md ("Per-token draft stopping") has the replays that chose this
# schedule over starting with the chooser's k or with pairs (experiments/stop_sim.py).
DRAFT_CHUNKS = (1, 1, 2)
LOOKUP_MAX = 15  # the longest n-gram lookup proposal: a target pass over 16 tokens
# the longest suffix lookup proposal: a pass over 32 tokens. SuffixDecoding sizes a proposal
# by its match, with no short cap: a file copied whole keeps 95% of its drafts, and 15 was
# the cap that bound (BENCHMARKS.md, "Suffix lookup and lookahead"). A rollback of 31 stays
# within a window cache's ROLLBACK_SLACK, and the probe times passes this long.
SUFFIX_MAX = 31
TREE_MAX = 64  # the most drafted tokens one pass may verify, a token tree's (trees.py)
# what side leaves add to a chain of k: (expected tokens, drafted tokens verified)
Widen = Callable[[int], tuple[float, int]]


def expected_tokens(a: float, k: int, a_later: float | None = None) -> float:
    """Tokens one target pass yields with k drafts: the first accepted with probability a,
    each later one with probability a_later given those before it (default a: independent)."""
    c = a if a_later is None else a_later
    run = float(k) if c >= 1.0 else (1.0 - c**k) / (1.0 - c)  # 1 + c + ... + c^(k-1)
    return 1.0 + a * run


def draft_seconds(k: int, t_draft: float, block: bool = False) -> float:
    """Seconds of drafting k tokens: k steps of t_draft, or one block forward of t_draft."""
    return (t_draft if k > 0 else 0.0) if block else k * t_draft


def best_k(
    a: float,
    t_draft: float,
    verify: list[float],
    k_max: int,
    k_min: int = 0,
    a_later: float | None = None,
    block: bool = False,
) -> int:
    """argmax over k in k_min..k_max of E[tokens | a, a_later, k] / (drafting k + verify[k]).

    a: first-draft acceptance; t_draft: seconds per draft token (a block's seconds, for a
    ``block`` drafter); ``verify[k]``: seconds of a target pass over k + 1 tokens; a_later:
    acceptance of later drafts (default a)."""
    ks = range(k_min, k_max + 1)
    return max(
        ks,
        key=lambda k: (
            expected_tokens(a, k, a_later) / (draft_seconds(k, t_draft, block) + verify[k])
        ),
    )


def _bin(confidence: float) -> int:
    """The confidence bin (a tenth of [0, 1]) of a draft the draft model gave that probability."""
    return min(int(confidence * CONF_BINS), CONF_BINS - 1)


@dataclass
class Acceptance:
    """What drafts score, learned from rounds: decayed [accepted, tried] counts (``decay`` per
    round counted, ~20 rounds of memory) on top of a prior worth ``prior_weight`` trials that
    fades like old data. (Not the acceptance rule: acceptance.py decides which drafts pass,
    this learns how often they do.)

    decay: weight of the history, per round counted; prior: the first position's prior
    acceptance; prior_weight: the prior's worth in trials. The counts (None: none yet, as a
    fresh chooser has): first, at the first draft position, prior included (a); later, at the
    positions after it, each tried when all before it passed (a_later, shrunk towards a while
    it has few trials); conf, per-token stopping, per confidence bin (a draft tried once all
    before it were accepted); lookup, prompt lookup by match length, [accepted, tried] at the
    first position and then after it; ranks, a token tree's side leaves by rank, [kept,
    tried] where the chain was rejected (what tree_size.SideSizer's rates start from).
    """

    decay: float = 0.95
    prior: float = 0.6
    prior_weight: float = 2.0
    first: list[float] | None = None
    later: list[float] | None = None
    conf: list[list[float]] | None = None
    lookup: dict[int, list[float]] | None = None
    ranks: list[list[float]] | None = None

    def __post_init__(self) -> None:
        if self.first is None:
            self.first = [self.prior * self.prior_weight, self.prior_weight]
        if self.later is None:
            self.later = [0.0, 0.0]
        self.lookup = {int(n): list(v) for n, v in (self.lookup or {}).items()}  # JSON: str keys
        self.conf = [[float(w), float(t)] for w, t in self.conf or []]
        self.ranks = [[float(w), float(t)] for w, t in self.ranks or []]
        if len(self.conf) != CONF_BINS:  # none yet, or saved with other bins: start afresh
            self.conf = [[0.0, 0.0] for _ in range(CONF_BINS)]

    @property
    def first_rate(self) -> float:
        """a: the chance that the first draft token is accepted."""
        wins, tries = self.first
        return wins / tries

    @property
    def later_rate(self) -> float:
        """a_later: the chance that a later draft token is accepted when all before it were."""
        wins, tries = self.later
        return (self.first_rate * self.prior_weight + wins) / (self.prior_weight + tries)

    def optimistic(self, explore: float) -> float:
        """a, ``explore`` standard errors up (a binomial's, over the trials counted)."""
        a, n = self.first_rate, self.first[1]
        return min(1.0, a + explore * (a * (1 - a) / n) ** 0.5)

    def confident(self, confidence: float) -> float:
        """The chance that a draft the draft model gave probability ``confidence`` is
        accepted when those before it were: learned per bin, a_later as the prior."""
        wins, tries = self.conf[_bin(confidence)]
        return (self.later_rate * self.prior_weight + wins) / (self.prior_weight + tries)

    def lookup_first(self, match: int, explore: float = 0.0) -> float:
        """The chance that the first token of a lookup proposal found by a ``match``-token
        n-gram is accepted (prior: 0.5 for a 1-gram, up to 0.8), ``explore`` standard errors
        up (0: the point estimate)."""
        wins, tries = self.lookup.get(match, [0.0] * 4)[:2]
        prior = min(0.8, 0.4 + 0.1 * match)
        a = (prior * self.prior_weight + wins) / (self.prior_weight + tries)
        if explore:
            a += explore * (a * (1 - a) / (self.prior_weight + tries)) ** 0.5
        return min(1.0, a)

    def lookup_later(self, match: int, explore: float = 0.0) -> float:
        """a_later for lookup after a ``match``-token n-gram: copied text tends to go on
        being copied, more so after a long match. Shrunk towards lookup_first(match,
        ``explore``) while it has few trials: an untried match is as hopeful past its first
        token as at it (with the point estimate there, the later tokens of a verbatim copy
        would look no better than 0.8 each, a near-linear pass-cost curve would say no, and
        a lookup never verified would never learn otherwise)."""
        wins, tries = self.lookup.get(match, [0.0] * 4)[2:]
        prior = self.lookup_first(match, explore)
        return (prior * self.prior_weight + wins) / (self.prior_weight + tries)

    def count(self, k: int, n: int) -> None:
        """Fold in a draft model's round: n of its k drafts accepted."""
        self._fold(self.first, self.later, k, n)

    def count_lookup(self, match: int, k: int, n: int) -> None:
        """Fold in a lookup round: n of k proposed tokens accepted, after a ``match``-token
        n-gram."""
        counts = self.lookup.setdefault(match, [0.0] * 4)
        first, later = counts[:2], counts[2:]
        self._fold(first, later, k, n)
        counts[:] = first + later

    def observe(self, confidences: Sequence[float], n: int) -> None:
        """Fold in a round's confidences: drafts 1..n were accepted, draft n + 1 was not."""
        for i, c in enumerate(confidences[: n + 1]):
            counts = self.conf[_bin(c)]
            counts[0] = self.decay * counts[0] + (i < n)
            counts[1] = self.decay * counts[1] + 1

    def count_tree(self, report: RoundReport) -> None:
        """Fold in a tree round's side leaves (stats.count_ranks: the ranks tried where the
        chain was rejected, and the one kept), decayed as the rest."""
        tried: list[int] = []
        kept: list[int] = []
        count_ranks(tried, kept, report)
        for s, (t, h) in enumerate(zip(tried, kept, strict=True)):
            if s == len(self.ranks):
                self.ranks.append([0.0, 0.0])
            counts = self.ranks[s]
            counts[0] = self.decay * counts[0] + h
            counts[1] = self.decay * counts[1] + t

    def rank_prior(self, s: int, weight: float) -> tuple[float, float] | None:
        """(kept, tried) worth ``weight`` trials for side leaves of rank s, as earlier tree
        rounds kept them (None: that rank was never tried)."""
        if s >= len(self.ranks) or self.ranks[s][1] <= 0:
            return None
        kept, tried = self.ranks[s]
        return kept / tried * weight, weight

    def _fold(self, first: list[float], later: list[float], k: int, n: int) -> None:
        """Decayed acceptance counts: position 1 was tried once; positions 2..min(n + 1, k)
        were tried when the one before passed."""
        tried_later = (n - 1, min(n + 1, k) - 1) if n > 0 else (0, 0)
        for counts, (wins, tries) in ((first, (n > 0, 1)), (later, tried_later)):
            counts[0] = self.decay * counts[0] + wins
            counts[1] = self.decay * counts[1] + tries


def _chunk(m: int) -> int:
    """Per-token stopping: how many to draft next after m drafts (DRAFT_CHUNKS, then pairs)."""
    return DRAFT_CHUNKS[min(m, len(DRAFT_CHUNKS) - 1)]


# the saved state's format: bump when LEARNED or a field's meaning changes (old files are then
# ignored, with one warning, and relearned)
STATE_VERSION = 2
# what a saved state holds: the estimates learned from rounds and the measured pass-cost curve.
# Each is (its key in the file, where it is kept: AdaptiveK's part "accept" or "cost", or
# "own" for AdaptiveK itself, its name there); the keys are the file format's own names, apart
# from where the parts keep them, so a file of this version loads whatever the parts call them.
LEARNED = (
    ("verify_ratio", "cost", "pass_ratio"), ("t_draft", "cost", "t_draft"),
    ("level", "cost", "level"), ("t_plain", "cost", "t_plain"), ("_first", "accept", "first"),
    ("_later", "accept", "later"), ("_fix", "cost", "fix"), ("_conf", "accept", "conf"),
    ("_lookup", "accept", "lookup"), ("_drafting_rounds", "own", "_drafting_rounds"),
    ("_draft_timed", "cost", "draft_timed"), ("_zeros", "own", "_zeros"),
    ("_wait", "own", "_wait"), ("_ranks", "accept", "ranks"),
)  # fmt: skip


@dataclass
class AdaptiveK(KChooser):
    """A k chooser (stats.KChooser): call it with each round's report, get the next k back.
    Keep one per pair and sampler (choosers.ChooserStore does): the estimates carry over from
    one generation to the next.

    What it learns lives in two parts, ``accept`` (Acceptance: how often drafts pass) and
    ``cost`` (CostCurve: what a round costs), each built with its own settings
    (``AdaptiveK(cost=CostCurve(pass_ratio=ratio))``); this class makes the choices that
    read them: k for the next round, the per-token stopping plan (draft_plan) and the length
    of a lookup proposal (lookup_length).
    Calibration: the first round drafts to time something; the second ever is a plain one,
    since k = 0 is what speculation must beat. Choice: the best k >= 1 on the point estimate;
    drafting stops (k = 0) when even an optimistic a (``explore`` standard errors up) says
    plain decoding is faster. Every ``neighbor_every`` drafting rounds it tries k +- 1 to keep
    the curve near the optimum measured. Once stopped it stays stopped until, after
    ``reprobe_every`` plain rounds, it drafts once (k = 1) in case the text got easier,
    doubling the wait while drafts score nothing.
    """

    plans = True  # (not a field) draft_plan below: per-token stopping
    k_max: int = 8  # the most drafts from the draft model
    block: bool = False  # the drafter drafts k in one forward (DFlash): t_draft is per round
    lookup_max: int = LOOKUP_MAX  # the longest lookup proposal
    explore: float = 1.0  # standard errors of optimism before giving up on the draft
    reprobe_every: int = 8  # plain rounds before drafting once more
    neighbor_every: int = 8  # drafting rounds between tries of k +- 1 (0: never)
    accept: Acceptance = field(default_factory=Acceptance)  # how often drafts pass
    cost: CostCurve = field(default_factory=CostCurve)  # what rounds cost
    # where the choices stand (saved with what the parts learned): drafting rounds so far,
    # plain rounds since drafting stopped, plain rounds to wait before the next probe
    _drafting_rounds: int = 0
    _zeros: int = 0
    _wait: int = 0

    def __call__(
        self, last: RoundReport | None, widen: Widen | None = None, dips: bool = True
    ) -> int:
        """The next round's k, after folding in ``last`` (None: a generation starts; what
        was learned in earlier ones carries over). widen: for a generation that may branch,
        what side leaves add to a chain of k (tree_size.SideSizer.gain, read with the row's
        statistics: (expected tokens, drafted tokens verified)); dips: the sizer's (a
        cheaper wider pass may be filled)."""
        if last is not None:
            if last.chain is None:
                self.update(
                    last.k, last.accepted, last.seconds, last.draft_seconds, last.lookup, last.made
                )
            else:  # a tree: k sizes its chain; the pass verified all its nodes
                self.update(last.chain, last.chain_kept, last.seconds, last.draft_seconds,
                            lookup=last.lookup, nodes=last.k)  # fmt: skip
                self.accept.count_tree(last)
            self.accept.observe(last.confidences[: last.k], last.accepted)
        if self.cost.level is None:
            # measure something first: draft, unless even drafts that cost nothing lose to a
            # plain step at the hopeful a (a prior measured before any round, ``expect``,
            # can say so), judged in units of a one-token pass; the plain round then times
            untimed = replace(self.cost, level=1.0)
            return min(2, self.k_max) if self.best_now(untimed, widen, dips) else 0
        if self.cost.t_plain is None:
            return 0  # then what it must beat
        # once it has stopped, only a probe restarts drafting: plain rounds alone make the
        # estimates no better, and the probe's outcome is what the next choice should see
        k = 0 if self._zeros else self.best_now(widen=widen, dips=dips)
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

    def expect(self, a: float, trials: float) -> None:
        """Start from an acceptance measured before any round (self-drafting's exit agreement
        on auto's passage): the first position's estimate becomes ``trials`` trials of ``a``,
        where nothing was learned yet (a chooser the store resumed keeps what it learned).
        Fewer than one expected acceptance in them: probes back off fully from the start, as
        after a run of probes that scored nothing (what more probes of such a drafter learn
        is mostly that it still does not pay)."""
        if self.cost.level is not None or self._drafting_rounds:
            return
        self.accept.first = [a * trials, trials]
        if a * trials < 1:
            self._wait = 8 * self.reprobe_every

    def best_now(
        self, cost: CostCurve | None = None, widen: Widen | None = None, dips: bool = True
    ) -> int:
        """The k the estimates favour now, before probing and neighbour exploration: the best
        on the point estimate of a, or 0 when even a, ``explore`` standard errors up, says a
        plain step yields more tokens per second. cost: what rounds cost (default: ``cost``;
        the first round's choice passes an untimed one in units of a pass); widen, dips: as for
        ``__call__``."""
        cost = cost or self.cost
        td, later = cost.t_draft or 0.0, self.accept.later_rate
        curve = cost.curve(max(self.k_max, self.lookup_max))
        k = best_k(self.accept.first_rate, td, curve, self.k_max, k_min=1, a_later=later,
                   block=self.block)  # fmt: skip
        extra = 0.0, 0
        if widen is not None:  # with side leaves a k may pay that alone would not
            curve = cost.tree_curve(TREE_MAX, dips)  # (nodes, the chain's, <= TREE_MAX)
            k, extra = self._widest(td, curve, later, widen)
        hopeful = self.accept.optimistic(self.explore)
        tokens = expected_tokens(hopeful, k, later) + extra[0]
        rate = tokens / (
            draft_seconds(k, td, self.block) + curve[min(k + extra[1], len(curve) - 1)]
        )
        return k if rate > 1.0 / cost.plain_seconds() else 0

    def _widest(
        self, td: float, curve: list[float], later: float, widen: Widen
    ) -> tuple[int, tuple]:
        """The k >= 1 whose chain and side leaves (``widen``) yield the most tokens a second
        on the point estimate, and what its leaves add."""
        best = (0.0, 1, (0.0, 0))
        for k in range(1, self.k_max + 1):
            extra = widen(k)
            tokens = expected_tokens(self.accept.first_rate, k, later) + extra[0]
            t = draft_seconds(k, td, self.block) + curve[min(k + extra[1], len(curve) - 1)]
            best = max(best, (tokens / t if t > 0 else 0.0, k, extra), key=lambda b: b[0])
        return best[1], best[2]

    def draft_plan(self, confidences: Sequence[float], drafted: int = 0) -> tuple[int, int]:
        """Per-token stopping, after drafting len(confidences) tokens (the draft's
        probability of each): (L, more) = keep the first L drafts, or first draft ``more``
        and ask again; with nothing drafted, (0, the round's first chunk).

        After j drafts the round goes on while some longer round, j + e drafts for any e,
        is expected to yield more tokens per second than stopping at j: with R = P(drafts
        1..j all accepted), from what drafts at each confidence scored before, and the
        unseen drafts accepted at a_later each, E[tokens | j + e] = E[tokens | j] +
        R (a_later + ... + a_later^e), for (j + e) t_draft + curve[j + e]. Looking past the
        next draft matters where the pass-cost curve is steep at first and flat later (one
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
        if self.cost.level is None:  # nothing timed yet: verify what was drafted, and time it
            return m, 0
        td, curve, later = self.cost.t_draft or 0.0, self.pass_curve(), self.accept.later_rate

        def cost(n: int) -> float:  # a round verifying n drafts; the first ``drafted`` sunk
            return max(n, drafted) * td + curve[n]

        run = total = 1.0  # P(drafts 1..j accepted); expected tokens of a round with j drafts
        for j in range(1, m + 1):
            run *= self.accept.confident(confidences[j - 1])
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

    def lookup_length(
        self, match: int, available: int, k: int, draft: bool, longest: int | None = None
    ) -> int:
        """How many of ``available`` lookup tokens (found by a ``match``-token n-gram) to
        verify this round: the length with the most expected tokens per second, or 0 when the
        alternative is worth more: drafting k tokens with the draft model (``draft``, k > 0),
        else a plain step. Optimistic by ``explore`` standard errors, at the first token and
        the later ones, as for stopping: a match length never verified is tried wherever the
        pass-cost curve is below one pass a token, and what it scores then decides.
        Before anything is timed it is judged in units of a one-token pass: the choice
        depends on the curve's shape only, as the rival scales with the same level.
        longest: the most this lookup may propose (default ``lookup_max``; suffix lookup's
        SUFFIX_MAX)."""
        top = self.lookup_max if longest is None else longest
        lengths = range(1, min(available, top) + 1)
        if not lengths:
            return 0
        # (untimed, verifying everything on offer cost a first round of a steep CPU curve
        # 12 passes' time for one token when the match was wrong)
        cost = self.cost if self.cost.level is not None else replace(self.cost, level=1.0)
        curve = cost.curve(max(self.k_max, top))
        a = self.accept.lookup_first(match, self.explore)
        later = self.accept.lookup_later(match, self.explore)
        best = max(lengths, key=lambda n: expected_tokens(a, n, later) / curve[n])
        value = expected_tokens(a, best, later) / curve[best]
        if draft and k > 0:
            td = cost.t_draft or 0.0
            a_draft, later_draft = self.accept.first_rate, self.accept.later_rate
            rival = expected_tokens(a_draft, k, later_draft) / (
                draft_seconds(k, td, self.block) + curve[k]
            )
        else:
            rival = 1.0 / cost.plain_seconds()
        return best if value > rival else 0

    def update(
        self,
        k: int,
        n: int,
        round_s: float,
        draft_s: float | None = None,
        lookup: int = 0,
        made: int | None = None,
        nodes: int | None = None,
    ) -> None:
        """Fold one round in: n of k drafts accepted in ``round_s`` seconds, of which
        ``draft_s`` drafting when it was timed apart; ``lookup`` > 0: prompt lookup proposed
        them from a match that long (its acceptance is learned apart, its drafting is free);
        ``made``: drafts made, when more than k (per-token stopping verified fewer than it
        drafted: the unverified ones cost draft time, not target time); ``nodes``: the drafted
        tokens the target's pass verified, when more than k (a tree: its side leaves)."""
        made = k if made is None else max(made, k)
        made = min(made, 1) if self.block else made  # a block: one forward drafted them all
        if k > 0 and lookup:
            self.accept.count_lookup(lookup, k, n)
            self.cost.time(nodes or k, round_s)  # nothing to draft: the round is the pass
            self.cost.passed(nodes or k, round_s)
            return
        if k == 0 and nodes:  # a pass of drafts that were no chain (lookahead's window)
            self.cost.time(nodes, round_s)
            self.cost.passed(nodes, round_s)
            return
        if k == 0:  # (no pass evidence: a plain pass may start in the round before it)
            self.cost.time_plain(round_s)
        else:
            self.accept.count(k, n)
            if n > 0:
                self._wait = self.reprobe_every  # the draft scored: no backing off
            timed = draft_s is not None
            if not timed:
                draft_s = self.cost.draft_share(nodes or k, made, round_s)
            if draft_s is not None:
                self.cost.time_draft(draft_s / made, timed)
            if timed:  # (a split-off draft share is an estimate: the rest may be less)
                self.cost.passed(nodes or k, max(round_s - draft_s, 1e-9))
        self.cost.time(nodes or k, max(round_s - (draft_s or 0.0), 1e-9))

    def pass_curve(self) -> list[float]:
        """t_verify(k) for k in 0..max(k_max, lookup_max), never cheaper than a smaller k."""
        return self.cost.curve(max(self.k_max, self.lookup_max))

    def summary(self) -> dict:
        """Where its choices stand, JSON-ready, for --json: its acceptance estimates (a at the
        first draft, a_later after it), the seconds it predicts (a draft token; a target
        pass over 1 token and over k_max + 1, from its curve), its plain step as timed,
        whether drafting has stopped (it then drafts once every few plain rounds), its
        drafting rounds so far (carried over from earlier runs of the pair), and the
        pass-cost shape as probed and as the rounds corrected it (``pass_cost``)."""
        curve = self.pass_curve()
        seconds = lambda t: round(t, 6) if t is not None else None  # noqa: E731
        return {
            "a": round(self.accept.first_rate, 4),
            "a_later": round(self.accept.later_rate, 4),
            "t_draft_s": seconds(self.cost.t_draft),
            "t_pass_s": seconds(curve[0] if self.cost.level is not None else None),
            f"t_pass_{self.k_max + 1}_s": seconds(
                curve[self.k_max] if self.cost.level is not None else None
            ),
            "t_plain_s": seconds(self.cost.t_plain),
            "stopped": self._zeros > 0,
            "drafting_rounds": self._drafting_rounds,
            "pass_cost": self._pass_cost(len(curve)),
        }

    def _pass_cost(self, widest: int) -> dict:
        """The pass-cost shape its choices read, t(n) / t(1) at a few token counts n up to
        ``widest``: as probed (None: never probed, the guess of +10% a token) and as the
        rounds have corrected it since (what a busy probe, or a wrong guess, came to)."""
        ns = [n for n in (2, 4, 8, 16, 32) if n <= widest]
        probed = self.cost.pass_ratio is not None
        return {
            "probed": {str(n): round(self.cost.ratio(n - 1), 3) for n in ns} if probed else None,
            "now": {str(n): round(self.cost.shape(n - 1) / self.cost.shape(0), 3) for n in ns},
        }

    def state(self) -> dict:
        """What was learned, JSON-ready, with the format's version; ``AdaptiveK.resume``
        resumes it. The settings (k_max, the decays, explore, ...) are not saved, so a
        changed default reaches machines that already have a state file."""
        holders = {"accept": self.accept, "cost": self.cost, "own": self}
        learned = {key: getattr(holders[part], name) for key, part, name in LEARNED}
        return {"version": STATE_VERSION, **learned}

    @classmethod
    def resume(cls, state: dict, **settings) -> AdaptiveK:
        """The chooser ``state()`` described (a key it lacks starts afresh), with the caller's
        settings, not the saved ones. ``settings``: AdaptiveK's own (k_max, explore, ...) to use instead; the
        parts' settings (decays, prior) are their defaults. ValueError for a state of another
        format version."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(f"not a version {STATE_VERSION} chooser state")
        kept: dict[str, dict] = {"accept": {}, "cost": {}, "own": {}}
        for key, part, name in LEARNED:
            if key in state:
                kept[part][name] = state[key]
        accept, cost = Acceptance(**kept["accept"]), CostCurve(**kept["cost"])
        return cls(**settings, **kept["own"], accept=accept, cost=cost)
