"""The round loop: prefill, draft, verify, accept, roll back; yields token events.

Bookkeeping, in one place: ``ctx`` is every token so far (prompt + generated). Between rounds
the target cache holds ctx[:-1] (the last token is fed at the start of the next pass), or all
of ctx when a plain round already queued the next plain pass (``head``, see below), and the
draft cache holds ctx[:d_len] for some d_len <= len(ctx) - 1; the draft is fed ctx[d_len:]
before it drafts, which covers the 2-token catch-up after a fully accepted round and whatever
prompt lookup accepted while the draft model sat idle. When generation ends, the target cache
holds ctx[:-1].

Plain rounds (k = 0) overlap like target-only decoding: when the chooser says the next round
is plain too (``plain_next``), the next target pass is queued before this round is read back,
so the host's work between rounds runs while the target computes.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from .acceptance import accept_greedy, accept_sampled, point_mass
from .drafters import draft_model_propose, lookup_propose
from .errors import BadInput, IncompatiblePair
from .sampling import SamplingParams, make_processor, sample

_STREAM = mx.new_stream(mx.default_device())
# drafting rounds: the first and then one in 8 get a second host sync, to time the draft apart
TIME_DRAFT_EVERY = 8


@dataclass
class TokenEvent:
    """One generated token; ``from_draft`` is True when the drafter proposed it."""

    token: int
    from_draft: bool


@dataclass
class Stats:
    """Live and final generation statistics. The engine writes, everyone else reads."""

    prompt_tokens: int = 0
    prefill_s: float = 0.0
    generated: int = 0
    decode_s: float = 0.0
    rounds: int = 0  # target passes after prefill
    drafted: int = 0
    accepted: int = 0
    accept_hist: list[int] = field(default_factory=list)  # rounds by accepted count
    timed_rounds: int = 0  # drafting rounds whose drafting was timed apart (1 in TIME_DRAFT_EVERY)
    timed_drafted: int = 0  # tokens drafted in those rounds
    timed_draft_s: float = 0.0  # their drafting time
    peak_memory: int = 0  # bytes
    last_k: int = 0  # the last round, read by adaptive-k choosers
    last_accepted: int = 0
    last_round_s: float = 0.0
    last_draft_s: float | None = None  # None when the round's drafting was not timed apart
    finish_reason: str | None = None  # "stop", "length", or None while running

    @property
    def decode_tps(self) -> float:
        return self.generated / self.decode_s if self.decode_s else 0.0

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_pass(self) -> float:
        return self.generated / self.rounds if self.rounds else 0.0

    @property
    def draft_s(self) -> float:
        """Seconds spent drafting, estimated from the timed rounds' time per drafted token."""
        return self.timed_draft_s / self.timed_drafted * self.drafted if self.timed_drafted else 0.0

    @property
    def target_s(self) -> float:
        """Seconds of decoding not spent drafting: verification, acceptance, bookkeeping."""
        return max(self.decode_s - self.draft_s, 0.0)

    def as_dict(self) -> dict:
        d = asdict(self)
        names = ("decode_tps", "prompt_tps", "acceptance_rate", "tokens_per_pass")
        for name in (*names, "draft_s", "target_s"):
            d[name] = getattr(self, name)
        return d


KChoice = int | str | Callable[[Stats], int]


def generate_tokens(
    target: nn.Module,
    draft: nn.Module | None,
    prompt_ids: Sequence[int],
    *,
    num_draft: KChoice = 4,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    max_tokens: int = 256,
    seed: int | None = None,
    eos_ids: Sequence[int] = (),
    stop_ids: Sequence[Sequence[int]] = (),
    lookup: bool = False,
    vocab_size: int | None = None,
    stats: Stats | None = None,
    prefill_step: int = 512,
    caches: tuple[list, list | None] | None = None,
) -> Iterator[TokenEvent]:
    """Generate from ``target``, speculating with ``draft`` (a model), prompt lookup
    (``lookup=True``), both (lookup first), or neither (plain target decoding).

    Output is exactly the target's: token-identical when greedy, the same distribution when
    sampling. ``num_draft`` is k: an int, "auto" (adaptive), or a callable Stats -> k.
    ``vocab_size`` is the number of ids the draft may propose (default: the smaller of the
    two models' logit widths). ``stats`` is updated live; ``caches`` lets callers inspect state.
    """
    params = SamplingParams(temperature, top_p, top_k, min_p)
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise BadInput("the prompt is empty")
    if max_tokens <= 0:
        raise BadInput(f"max tokens must be > 0, got {max_tokens}")
    choose_k = _k_chooser(num_draft)
    stats = stats if stats is not None else Stats()
    stats.prompt_tokens = len(prompt)
    tcache, dcache = caches or (make_prompt_cache(target), None)
    if draft is not None and dcache is None:
        dcache = make_prompt_cache(draft)
    speculating = draft is not None or lookup
    for c in (tcache, dcache) if speculating else ():
        if c is not None and not can_trim_prompt_cache(c):
            # rollback is an offset move; sliding-window or recurrent state cannot undo tokens
            raise IncompatiblePair("speculation needs trimmable KV caches (not sliding-window)")
    stops = _Stops(eos_ids, stop_ids, max_tokens)
    key = mx.random.key(seed if seed is not None else random.getrandbits(63))
    mx.reset_peak_memory()

    with mx.stream(_STREAM):
        t0 = time.perf_counter()
        _prefill(target, tcache, prompt[:-1], prefill_step)
        if draft is not None:
            _prefill(draft, dcache, prompt[:-1], prefill_step)
        stats.prefill_s = time.perf_counter() - t0
        if not speculating:
            loop = _plain(target, tcache, prompt, params, key, stops, stats)
        else:
            spec = _Speculation(target, tcache, draft, dcache, params, vocab_size, lookup)
            loop = spec.run(prompt, choose_k, key, stops, stats)
        try:
            yield from loop
        finally:
            stats.peak_memory = mx.get_peak_memory()


def _k_chooser(num_draft: KChoice) -> Callable[[Stats], int]:
    if callable(num_draft):
        return num_draft
    if num_draft == "auto":
        from .adaptive import AdaptiveK

        return AdaptiveK()
    if not isinstance(num_draft, int) or num_draft < 0:
        raise BadInput(
            f"k (number of draft tokens) must be an integer >= 0 or 'auto', got {num_draft!r}"
        )
    return _Fixed(num_draft)


class _Fixed:
    """A fixed k, as a chooser."""

    def __init__(self, k: int):
        self.k = k

    def __call__(self, _stats: Stats) -> int:
        return self.k

    def plain_next(self) -> bool:
        """Whether the next round is plain whatever this one brings (see AdaptiveK)."""
        return self.k == 0


def _prefill(model: nn.Module, cache: list, tokens: list[int], step: int) -> None:
    """Run the prompt through a model in chunks, evaluating each so memory stays bounded."""
    for i in range(0, len(tokens), step):
        model(mx.array(tokens[i : i + step], dtype=mx.uint32)[None], cache=cache)
        mx.eval([c.state for c in cache])


class _Stops:
    """EOS ids, token-id stop sequences and the token budget. EOS is not emitted; a stop
    sequence is emitted (the text layer strips stop strings)."""

    def __init__(self, eos: Sequence[int], seqs: Sequence[Sequence[int]], max_tokens: int):
        self.eos, self.seqs, self.max_tokens = set(eos), [list(s) for s in seqs if s], max_tokens

    def cut(self, generated: list[int], new: list[int]) -> tuple[list[int], str | None]:
        """Keep the prefix of ``new`` up to the first stop; return it and the finish reason."""
        for i, t in enumerate(new):
            if t in self.eos:
                return new[:i], "stop"
            out = generated + new[: i + 1]
            if any(out[-len(s) :] == s for s in self.seqs):
                return new[: i + 1], "stop"
            if len(out) >= self.max_tokens:
                return new[: i + 1], "length"
        return new, None


def _plain(target, cache, prompt, params, key, stops, stats) -> Iterator[TokenEvent]:
    """Target-only decoding, overlapping the next step with the host like mlx-lm's
    generate_step: step i+1 is queued (async_eval) before token i is read back."""
    process = None if params.greedy else make_processor(params)

    def step(y: mx.array) -> mx.array:
        nonlocal key
        key, sub = mx.random.split(key)
        logits = target(y.reshape(1, -1), cache=cache)[0, -1]  # (V,)
        if process is None:
            return mx.argmax(logits, axis=-1).astype(mx.uint32)
        return sample(process(logits), sub)

    t0 = time.perf_counter()
    y = step(mx.array(prompt[-1:], dtype=mx.uint32))
    mx.async_eval(y)
    fed = len(prompt)  # tokens the cache has seen, queued steps included
    generated: list[int] = []
    while True:
        if len(generated) + 1 < stops.max_tokens:
            nxt = step(y)
            mx.async_eval(nxt)
            fed += 1
        new, reason = stops.cut(generated, [y.item()])
        generated += new
        stats.rounds += 1
        stats.generated = len(generated)
        elapsed = time.perf_counter() - t0
        stats.decode_s += elapsed
        stats.last_round_s = elapsed
        if reason and can_trim_prompt_cache(cache):
            # drop what queued steps fed past the kept context: the cache holds ctx[:-1]
            trim_prompt_cache(cache, fed - (len(prompt) + len(generated) - 1))
            stats.finish_reason = reason
        if new:
            yield TokenEvent(new[0], False)
        if reason:
            return
        t0 = time.perf_counter()
        y = nxt


class _Speculation:
    """State of one speculative generation: models, caches and the sampling setup."""

    def __init__(self, target, tcache, draft, dcache, params, vocab_size, lookup):
        self.target, self.tcache, self.draft, self.dcache = target, tcache, draft, dcache
        self.process = None if params.greedy else make_processor(params)
        self.lookup = lookup
        self.head: mx.array | None = None  # (1, V_target) logits of a queued plain pass
        if draft is not None and vocab_size is None:
            # logit widths are known from shapes alone: this builds a graph, evaluates nothing
            probe = mx.array([[0]], dtype=mx.uint32)
            vocab_size = min(target(probe).shape[-1], draft(probe).shape[-1])
        self.vocab_size = vocab_size

    def run(self, prompt, choose_k, key, stops, stats) -> Iterator[TokenEvent]:
        ctx = list(prompt)
        self.d_len = len(ctx) - 1
        generated: list[int] = []
        drafting_rounds = 0
        plain_next = getattr(choose_k, "plain_next", lambda: False)
        while True:
            t0 = time.perf_counter()
            # a round emits up to k + 1 tokens: never draft past the budget
            k = max(0, min(choose_k(stats), stops.max_tokens - len(generated) - 1))
            # a queued pass would be waited for inside the draft's timing: skip, time the next
            time_draft = k > 0 and drafting_rounds % TIME_DRAFT_EVERY == 0 and self.head is None
            drafting_rounds += k > 0 and self.head is None
            queue = k == 0 and len(generated) + 1 < stops.max_tokens and plain_next()
            key, sub = mx.random.split(key)
            n, tokens, k, t_draft = self.round(ctx, k, sub, time_draft, queue)
            new, reason = stops.cut(generated, tokens[:n] + [tokens[k]])
            self.rollback(ctx, k, n_kept=len(new) - 1 if reason else n, done=reason is not None)
            ctx += new
            generated += new
            _record(stats, k, n, len(generated), time.perf_counter() - t0, t_draft)
            stats.finish_reason = reason
            for i, t in enumerate(new):
                yield TokenEvent(t, i < n)
            if reason:
                return

    def round(
        self, ctx: list[int], k: int, key: mx.array, time_draft: bool = False, queue: bool = False
    ) -> tuple[int, list[int], int, float | None]:
        """Draft -> verify -> accept as one lazy graph, read back with one host sync.
        Returns (n accepted, [d_1..d_k, next], k used, draft seconds or None). ``time_draft``
        adds a second sync after drafting, to time the draft apart from the target: the
        engine asks for it on one drafting round in TIME_DRAFT_EVERY, for the statistics
        and for adaptive k. ``queue``: if this round is plain, queue the next plain pass."""
        t0 = time.perf_counter()
        kd, ku, kr = mx.random.split(key, 3)
        proposal = lookup_propose(ctx, k) if self.lookup else []
        d, q = mx.array(proposal, dtype=mx.uint32), None
        if not proposal and self.draft is not None and k > 0:
            pending = ctx[self.d_len :]
            x = mx.array(pending, dtype=mx.uint32)[None]  # (1, L)
            d, q = draft_model_propose(
                self.draft, self.dcache, x, k, self.vocab_size, self.process, kd
            )
            d, q = d[0], (None if q is None else q[0])  # (k,), (k, vocab)
            self.d_len += len(pending) + k - 1
        k = d.shape[0]
        t_draft = None
        if time_draft and k > 0:
            mx.eval(d if q is None else [d, q])
            t_draft = time.perf_counter() - t0

        if self.head is None:
            x = mx.concatenate([mx.array(ctx[-1:], dtype=mx.uint32), d])[None]  # (1, k+1)
            logits = self.target(x, cache=self.tcache)[0]  # (k+1, V_target)
        else:  # the last round fed ctx[-1] already: its logits are the first row
            logits, self.head = self.head, None
            if k > 0:  # the chooser broke its word: correct, if a pass slower
                logits = mx.concatenate([logits, self.target(d[None], cache=self.tcache)[0]])
        if self.process is None:
            n, nxt = accept_greedy(logits, d)
        elif k == 0:
            n, nxt = mx.array(0), sample(self.process(logits[0]), kr)
        else:
            width = logits.shape[-1]
            p = self.process(logits)  # (k+1, V_target)
            q = point_mass(d, width) if q is None else _pad(q, width)  # (k, V_target)
            u = mx.random.uniform(shape=(k,), key=ku)
            n, nxt = accept_sampled(p, q, d, u, kr)
        out = mx.concatenate([n.astype(mx.uint32).reshape(1), d, nxt.reshape(1)])
        if queue and k == 0:
            # as target-only decoding does: the next pass runs while the host reads this one
            mx.async_eval(out)
            self.head = self.target(nxt.reshape(1, 1), cache=self.tcache)[0]  # (1, V_target)
            mx.async_eval(self.head)
        out = out.tolist()
        return out[0], out[1:], k, t_draft

    def rollback(self, ctx: list[int], k: int, n_kept: int, done: bool = False) -> None:
        """Trim both caches to the kept context; ``ctx`` is the context before this round.
        The target fed ctx[-1] + k drafts and keeps n_kept of them (plus the next token, if
        a plain pass was queued: undone when generation is ``done``); the draft keeps the
        longest prefix of what it has seen that is still right."""
        queued = done and self.head is not None
        if queued:
            self.head = None
        trim_prompt_cache(self.tcache, k - n_kept + queued)
        if self.draft is not None:
            keep = min(self.d_len, len(ctx) + n_kept)
            trim_prompt_cache(self.dcache, self.d_len - keep)
            self.d_len = keep


def _pad(q: mx.array, width: int) -> mx.array:
    """Draft probabilities (k, vocab) -> (k, width): ids the draft cannot propose get q = 0."""
    extra = width - q.shape[-1]
    return q if extra == 0 else mx.concatenate([q, mx.zeros((q.shape[0], extra))], axis=-1)


def _record(stats: Stats, k: int, n: int, generated: int, round_s: float, draft_s: float | None):
    stats.rounds += 1
    stats.drafted += k
    stats.accepted += n
    if len(stats.accept_hist) <= n:
        stats.accept_hist += [0] * (n + 1 - len(stats.accept_hist))
    stats.accept_hist[n] += 1
    stats.generated = generated
    stats.decode_s += round_s
    if draft_s is not None:
        stats.timed_rounds += 1
        stats.timed_drafted += k
        stats.timed_draft_s += draft_s
    stats.last_k, stats.last_accepted = k, n
    stats.last_round_s, stats.last_draft_s = round_s, draft_s
