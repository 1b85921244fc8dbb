"""What a generation reports: token events, live statistics, the per-round report, and the
protocol of the objects that pick k from those reports (a leaf module: the engine writes,
choosers, the CLI, the bench and the server read)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol, runtime_checkable


@dataclass
class TokenEvent:
    """One generated token; ``from_draft`` is True when the drafter proposed it. Above the
    engine (the text stream, the server, a remote client) it also carries the text the token
    completed: often "", or several characters; token None for text without a token of its
    own (the detokenizer's final flush, a chunk from a server that sent no ids)."""

    token: int | None
    from_draft: bool
    text: str = ""


@dataclass(frozen=True)
class RoundReport:
    """One finished round, as a k chooser sees it."""

    k: int  # tokens drafted and verified (0: a plain target step); a tree's nodes
    accepted: int  # drafts the target accepted (a tree: the kept path's length)
    seconds: float  # the whole round: drafting, verification, acceptance, rollback
    draft_seconds: float | None = None  # drafting alone, when it was timed apart
    lookup: int = 0  # > 0: prompt lookup proposed this round's drafts, from a match this long
    confidences: tuple[float, ...] = ()  # per-token stopping: the draft's q of each draft
    # per-token stopping: drafts made, when more than k (a chunk can end past where the plan
    # stops); draft_seconds covers all of them, the unverified ones included
    made: int | None = None
    # a token tree (drafting.trees): the drafter's chain within the k nodes (None: k is a
    # chain), its side leaves at each depth, and the rank of the side leaf the kept path
    # ended on (-1: none; the path then followed the chain)
    chain: int | None = None
    sides: tuple[int, ...] = ()
    side: int = -1
    on_chain: int | None = None  # a tree: the kept path's nodes on the chain

    @property
    def chain_kept(self) -> int:
        """A tree's drafts kept on its chain (a kept side leaf is the chain's rejection)."""
        return self.on_chain if self.on_chain is not None else self.accepted - (self.side >= 0)


@runtime_checkable
class KChooser(Protocol):
    """Picks the number of tokens to draft in the next round, and may offer three abilities
    the engine asks for by name (subclass this to inherit the defaults below):

    - ``plain_next``: the next round is plain whatever this one brings (the engine then queues
      that pass before this round is read back);
    - ``lookup_length``: how many of the tokens a lookup match offers to verify;
    - ``draft_plan``: per-token stopping within a round, where ``plans`` is True.

    Called with None when a generation starts and with the last round's report after each.
    """

    plans: bool = False  # whether draft_plan may be asked (per-token stopping)

    def __call__(self, last: RoundReport | None) -> int: ...

    def plain_next(self) -> bool:
        """True when the next call returns 0 whatever the current round brings."""
        return False

    def lookup_length(
        self, match: int, available: int, k: int, draft: bool, longest: int | None = None
    ) -> int:
        """How many of ``available`` lookup tokens (after a ``match``-token n-gram) to verify
        this round, given the round's k and whether a draft model would draft instead
        (``draft``); 0 declines them; ``longest``: the most this lookup may propose (an
        adaptive chooser's cap, where it has one). By default up to k, as a fixed k drafts."""
        return min(available, k)

    def draft_plan(self, confidences: Sequence[float], drafted: int = 0) -> tuple[int, int]:
        """Per-token stopping after drafting len(confidences) tokens: (keep, more) = keep the
        first ``keep`` drafts, or draft ``more`` and ask again (see adaptive.AdaptiveK)."""
        raise NotImplementedError(f"{type(self).__name__} does not plan drafts (plans=False)")


@dataclass
class Stats:
    """Live and final generation statistics. The engine writes, everyone else reads."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV entries came from a prompt cache
    prefill_s: float = 0.0
    generated: int = 0
    decode_s: float = 0.0
    rounds: int = 0  # target passes after prefill
    drafted: int = 0
    accepted: int = 0
    accept_hist: list[int] = field(default_factory=list)  # rounds by accepted count
    k_hist: list[int] = field(default_factory=list)  # rounds by drafts verified (a tree: nodes)
    # -k auto: what it decided from (its state's origin: ``from``) and where its estimates
    # stood at the end (adaptive.AdaptiveK.summary); None: a fixed k
    auto: dict | None = None
    # by draft position d (0: the first draft): rounds that verified a draft there with every
    # draft before it accepted, and of those the rounds that accepted it (acceptance by depth)
    depth_tried: list[int] = field(default_factory=list)
    depth_accepted: list[int] = field(default_factory=list)
    # token trees: rounds that verified a tree, and by sibling rank (0: the draft's best after
    # the chain's token) the side leaves tried where the chain was rejected, and those kept
    tree_rounds: int = 0
    tree_off: str | None = None  # why trees were asked for (auto) and chains verified
    rank_tried: list[int] = field(default_factory=list)
    rank_kept: list[int] = field(default_factory=list)
    timed_rounds: int = 0  # drafting rounds whose drafting was timed apart
    timed_drafted: int = 0  # tokens drafted in those rounds
    timed_draft_s: float = 0.0  # their drafting time
    unverified: int = 0  # per-token stopping: drafts made but not verified
    peak_memory: int = 0  # bytes
    # layer cache kinds by model ("target", "draft"): class name -> layers, as in caches.py
    caches: dict[str, dict[str, int]] = field(default_factory=dict)
    replayed: int = 0  # tokens fed to the target again to roll back recurrent state
    last: RoundReport | None = None  # the latest round
    finish_reason: str | None = None  # "stop", "length", or None while running

    @property
    def accept_by_depth(self) -> list[float]:
        """P(draft d accepted | drafts before it accepted), d = 1, 2, ... as far as tried."""
        return [a / t for a, t in zip(self.depth_accepted, self.depth_tried, strict=True) if t]

    @property
    def decode_tps(self) -> float:
        return self.generated / self.decode_s if self.decode_s else 0.0

    @property
    def prompt_tps(self) -> float:
        """Prompt tokens prefilled per second (tokens served from a cache excluded)."""
        fed = self.prompt_tokens - self.cached_tokens
        return fed / self.prefill_s if self.prefill_s else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_pass(self) -> float:
        return self.generated / self.rounds if self.rounds else 0.0

    @property
    def verified_per_pass(self) -> float:
        """Drafted tokens a target pass verified, on average (a tree's nodes count)."""
        return self.drafted / self.rounds if self.rounds else 0.0

    @property
    def accept_by_rank(self) -> list[float]:
        """P(side leaf of rank s kept | the chain rejected at its depth), s = 0, 1, ..."""
        return [a / t for a, t in zip(self.rank_kept, self.rank_tried, strict=True) if t]

    @property
    def draft_s(self) -> float:
        """Seconds spent drafting, estimated from the timed rounds' time per drafted token."""
        if not self.timed_drafted:
            return 0.0
        return self.timed_draft_s / self.timed_drafted * (self.drafted + self.unverified)

    @property
    def target_s(self) -> float:
        """Seconds of decoding not spent drafting: verification, acceptance, bookkeeping."""
        return max(self.decode_s - self.draft_s, 0.0)

    def record(self, report: RoundReport, generated: int) -> None:
        """Fold in one round; ``generated`` is the number of tokens emitted so far."""
        k, n = report.k, report.accepted
        self.rounds += 1
        self.drafted += k
        self.accepted += n
        made = k if report.made is None else report.made
        self.unverified += made - k
        if len(self.accept_hist) <= n:
            self.accept_hist += [0] * (n + 1 - len(self.accept_hist))
        self.accept_hist[n] += 1
        if len(self.k_hist) <= k:
            self.k_hist += [0] * (k + 1 - len(self.k_hist))
        self.k_hist[k] += 1
        if report.chain is None:
            count_depths(self.depth_tried, self.depth_accepted, k, n)
        else:  # a tree: its chain's acceptance (a kept side leaf is its chain's rejection)
            count_depths(self.depth_tried, self.depth_accepted, report.chain, report.chain_kept)
        if report.chain is not None:
            self.tree_rounds += 1
            count_ranks(self.rank_tried, self.rank_kept, report)
        self.generated = generated
        self.decode_s += report.seconds
        if report.draft_seconds is not None:
            self.timed_rounds += 1
            self.timed_drafted += made
            self.timed_draft_s += report.draft_seconds
        self.last = report

    def as_dict(self) -> dict:
        """The fields and the derived figures, JSON-ready."""
        d = asdict(self)
        for name in ("decode_tps", "prompt_tps", "acceptance_rate", "tokens_per_pass",
                     "accept_by_depth", "verified_per_pass", "accept_by_rank"):  # fmt: skip
            d[name] = getattr(self, name)
        d["draft_s"], d["target_s"] = self.draft_s, self.target_s
        return d


def count_depths(tried: list[int], accepted: list[int], k: int, n: int) -> None:
    """Fold a round that accepted n of k drafts into per-position counts (grown as needed):
    positions 0..min(n, k - 1) were verified with all before them accepted; 0..n-1 passed."""
    if len(tried) < k:
        tried += [0] * (k - len(tried))
        accepted += [0] * (k - len(accepted))
    for d in range(min(n + 1, k)):
        tried[d] += 1
        accepted[d] += d < n


def count_ranks(tried: list[int], kept: list[int], report: RoundReport) -> None:
    """Fold a tree round into per-rank counts (grown as needed): where its chain was rejected
    at a depth with side leaves, ranks up to the one kept (all, if none was) were tried."""
    on_chain = report.accepted - (report.side >= 0)
    m = report.sides[on_chain] if on_chain < len(report.sides) else 0
    if len(tried) < m:
        tried += [0] * (m - len(tried))
        kept += [0] * (m - len(kept))
    for s in range(m if report.side < 0 else report.side + 1):
        tried[s] += 1
        kept[s] += s == report.side
