"""The round loop: prefill, then rounds of propose -> verify -> accept -> roll back; yields
token events.

Bookkeeping, in one place: ``ctx`` is every token so far (prompt + generated). Between rounds
the target cache holds ctx[:-1] (the last token is fed at the start of the next pass), or all
of ctx when a plain round already queued the next plain pass (``head``, see below); a draft
model's cache holds a prefix of ctx[:-1] that its drafter (drafters.ModelDrafter) tracks.
A drafter is anything with drafters.Drafter's three methods: the draft model, prompt lookup,
or a chain of them; the round sees only its Proposal. When generation ends, or the caller
closes the generator early, the target cache holds ctx[:-1] and KVState says so.

Plain rounds (k = 0) overlap like target-only decoding: when the chooser says the next round
is plain too (``plain_next``), the next target pass is queued before this round is read back,
so the host's work between rounds runs while the target computes.
"""

from __future__ import annotations

import random
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from .acceptance import DEFAULT_VERIFY, Rule, accept_greedy, sampled_rule
from .caches import (
    Snapshot,
    cache_kinds,
    can_rollback,
    check_kinds,
    make_caches,
    needs_replay,
    recurrent_layers,
    roll_back,
    snapshot,
    trim,
)
from .choosers import KSetting, make_chooser
from .drafters import (
    Chain,
    Drafter,
    HeadDrafter,
    Hidden,
    LookupDrafter,
    ModelDrafter,
    pair_tokens,
)
from .errors import BadInput
from .hidden import HiddenTap
from .lookup import Lookup, LookupMemory
from .mlx_lm_api import set_wired_limit
from .recurrent import PassRecorder
from .sampling import SamplingParams, make_processor, sample
from .stats import RoundReport, Stats, TokenEvent

__all__ = ["KVState", "Stats", "TokenEvent", "TIME_DRAFT_EVERY", "generate_tokens", "prefill"]

# MLX streams belong to a thread: the server generates on a worker thread of its own
_STREAM = getattr(mx, "new_thread_local_stream", mx.new_stream)(mx.default_device())
# drafting rounds: the first, the first after plain rounds (while drafting is rare, as when
# adaptive k has stopped and probes now and then, one in 8 would leave the draft's time
# unmeasured for a whole generation) and then one in 8 get a second host sync, to time the
# draft apart
TIME_DRAFT_EVERY = 8


@dataclass
class KVState:
    """Both models' KV caches and the tokens they hold. Between generations the target cache
    holds ``tokens`` and the draft cache tokens[:draft_len]. Pass one to generate_tokens to
    reuse its longest common prefix with the prompt (a prompt cache), or to inspect it after.
    ``target`` None means "make fresh caches"."""

    target: list | None = None
    draft: list | None = None
    tokens: list[int] = field(default_factory=list)
    draft_len: int = 0
    # a draft that reads the target's hidden states (an MTP head): its cache holds draft_len
    # pairs (h_j, t_{j+1}) and ``hidden`` (m, H) the confirmed hidden states at positions
    # draft_len..draft_len+m-1 it has not been fed yet (drafters.HeadDrafter)
    hidden: mx.array | None = None
    reads_hidden: bool = False

    def nbytes(self) -> int:
        """Bytes the caches hold now."""
        caches = (self.target or []) + (self.draft or [])
        return sum(getattr(c, "nbytes", 0) for c in caches)

    def drop(self) -> None:
        """Forget everything: the next generation starts from fresh caches."""
        self.target, self.draft, self.tokens, self.draft_len = None, None, [], 0
        self.hidden, self.reads_hidden = None, False


def generate_tokens(
    target: nn.Module,
    draft: nn.Module | None,
    prompt_ids: Sequence[int],
    *,
    sampling: SamplingParams | None = None,
    num_draft: KSetting = 4,
    max_tokens: int = 256,
    seed: int | None = None,
    eos_ids: Sequence[int] = (),
    stop_ids: Sequence[Sequence[int]] = (),
    lookup: bool = False,
    lookup_memory: LookupMemory | None = None,
    vocab_size: int | None = None,
    stats: Stats | None = None,
    prefill_step: int = 512,
    kv: KVState | None = None,
    lockstep: Callable[[list[int]], None] | None = None,
    verify: str = DEFAULT_VERIFY,
    draft_stop: bool = False,
) -> Iterator[TokenEvent]:
    """Generate from ``target``, speculating with ``draft`` (a model), prompt lookup
    (``lookup=True``), both (lookup first), or neither (plain target decoding).

    Output is exactly the target's: token-identical when greedy, the same distribution when
    sampling.

    target, draft: mlx-lm models (draft None: no draft model); the draft may instead be a
        head over the target's hidden states (mtp.MTPHead: anything with ``reads_hidden``).
    prompt_ids: the prompt's token ids (at least one).
    sampling: temperature, top-p, top-k, min-p (default greedy); the same processing makes
        the target's p and the draft's q, which is what keeps sampling exact.
    num_draft: k, the drafts per round: an int >= 0, "auto" (a fresh adaptive chooser) or a
        stats.KChooser, such as one kept across generations by choosers.ChooserStore.
    max_tokens: the most tokens to generate (> 0).
    seed: seeds the sampling (None: random).
    eos_ids: ids that end generation and are not emitted.
    stop_ids: token sequences that end generation; they are emitted (stream.py strips text).
    lookup: propose from earlier occurrences in the context first (prompt lookup).
    lookup_memory: with lookup, also propose from these earlier outputs; this generation's
        output is added to it at the end (lookup.LookupMemory; None: the context only).
    vocab_size: how many ids the draft may propose (default: the smaller logit width).
    stats: updated live (a fresh one if None).
    prefill_step: prompt tokens per prefill chunk (bounds prefill memory).
    kv: caches to reuse (their longest common prefix with the prompt is kept, the rest of the
        prompt is prefilled) and that hold the context afterwards; fresh ones if None.
    lockstep: called with each round's new tokens before they are yielded; it may raise to
        stop (distributed.Lockstep compares the ranks' tokens this way, now or, carried by
        the ranks' shared k, at the next round's start).
    verify: how a sampled round checks the drafts: "block" (the default: the drafted block
        jointly, Sun et al. 2024: the same distribution, never fewer tokens kept in
        expectation) or "token" (token by token, Leviathan et al.). Greedy decoding is the
        same under both.
    draft_stop: per-token stopping, with an adaptive chooser (num_draft "auto" or an
        AdaptiveK): a round the chooser gives k > 0 drafts in small chunks
        (adaptive.DRAFT_CHUNKS: 1, 1, then 2 at a time, a host sync each, up to the chooser's
        k_max) while its cost model says the next draft pays, and verifies the best prefix.
    """
    sampling = SamplingParams() if sampling is None else sampling
    if not isinstance(sampling, SamplingParams):
        raise BadInput(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise BadInput("the prompt is empty")
    if max_tokens <= 0:
        raise BadInput(f"max tokens must be > 0, got {max_tokens}")
    if draft_stop and _reads_hidden(draft):
        raise BadInput("per-token stopping needs a draft model: an MTP head drafts the chooser's k")
    next_k = make_chooser(num_draft)
    accept = sampled_rule(verify)
    stats = stats if stats is not None else Stats()
    kv = _ready(kv, target, draft, prompt, stats)
    speculating = draft is not None or lookup
    head = _reads_hidden(draft)
    for what, c in (("target", kv.target), ("draft", kv.draft)) if speculating else ():
        if c is not None:
            check_kinds(c, what)  # a layer cache no rollback is known for: refused by name
    stops = _Stops(eos_ids, stop_ids, max_tokens)
    key = mx.random.key(seed if seed is not None else random.getrandbits(63))
    mx.reset_peak_memory()

    with mx.stream(_STREAM), _wired():
        _fill(target, draft, prompt, kv, stats, prefill_step)
        process = None if sampling.greedy else make_processor(sampling)
        check = lockstep or (lambda _tokens: None)
        if not speculating:
            loop = _plain(target, kv, prompt, process, key, stops, stats, check)
        else:
            ctx = list(prompt)  # the context, grown each round (lookup indexes this list)
            drafters: list[Drafter] = []
            if lookup:
                length = getattr(next_k, "lookup_length", None)
                finder = Lookup(ctx, lookup_memory)
                drafters.append(LookupDrafter(finder, length, fallback=draft is not None))
            model_drafter = None
            if head:
                width = min(vocab_size or _logit_width(target), _logit_width(target))
                model_drafter = HeadDrafter(
                    draft, kv.draft, kv.draft_len, kv.hidden, width, process
                )
                drafters.append(model_drafter)
            elif draft is not None:
                rows, vocab = _draft_ids(target, draft, vocab_size)
                plan = getattr(next_k, "draft_plan", None) if draft_stop else None
                model_drafter = ModelDrafter(
                    draft, kv.draft, kv.draft_len, vocab, rows, process, plan
                )
                drafters.append(model_drafter)
            drafter = drafters[0] if len(drafters) == 1 else Chain(drafters)
            spec = _Speculation(target, kv, drafter, model_drafter, process, accept, stats)
            spec.tap = HiddenTap(target, draft.reads_hidden) if head else None
            loop = spec.run(ctx, next_k, key, stops, stats, check)
        try:
            yield from loop
        finally:
            stats.peak_memory = mx.get_peak_memory()


def prefill(
    target: nn.Module,
    draft: nn.Module | None,
    prompt_ids: Sequence[int],
    *,
    kv: KVState,
    stats: Stats | None = None,
    prefill_step: int = 512,
) -> None:
    """Put a prompt into ``kv`` and generate nothing (an editor's warm-up request): ``kv``
    then holds what generate_tokens would hold before its first round (the prompt minus its
    last token, reusing the longest common prefix), so a later request that shares the
    prompt prefills only what is new.

    target, draft: the models (draft None: the target's cache only); prompt_ids: at least
    one id; kv: the caches to fill (fresh ones are made where kv holds none); stats: gets
    the prompt and prefill figures (a fresh one if None); prefill_step: tokens per chunk."""
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise BadInput("the prompt is empty")
    stats = stats if stats is not None else Stats()
    kv = _ready(kv, target, draft, prompt, stats)
    with mx.stream(_STREAM), _wired():
        _fill(target, draft, prompt, kv, stats, prefill_step)


_WIDTHS: dict[int, tuple[weakref.ref, int]] = {}


def _logit_width(model: nn.Module) -> int:
    """The width of a model's logits, known from shapes alone: a graph on a dummy input is
    built (never evaluated) once per model object, not once per generation."""
    hit = _WIDTHS.get(id(model))
    if hit is not None and hit[0]() is model:
        return hit[1]
    width = model(mx.array([[0]], dtype=mx.uint32)).shape[-1]
    _WIDTHS[id(model)] = (weakref.ref(model), width)
    return width


def _draft_ids(target, draft, vocab_size: int | None) -> tuple[int, int]:
    """(ids the draft can embed, ids it may propose): the second is the smaller logit width
    unless ``vocab_size`` says fewer."""
    width = _logit_width(draft)
    rows = getattr(getattr(draft, "args", None), "vocab_size", None) or width
    if vocab_size is None:
        vocab_size = min(_logit_width(target), width)
    return rows, min(vocab_size, rows)


def _ready(kv: KVState | None, target, draft, prompt: list[int], stats: Stats) -> KVState:
    """``kv`` (a fresh KVState if None) with caches for both models, and the prompt's
    figures in ``stats``."""
    stats.prompt_tokens = len(prompt)
    kv = kv if kv is not None else KVState()
    if kv.target is None:
        kv.drop()
        kv.target = make_caches(target)
    head = _reads_hidden(draft)
    if draft is not None and (kv.draft is None or kv.reads_hidden != head):
        kv.draft, kv.draft_len, kv.hidden, kv.reads_hidden = make_caches(draft), 0, None, head
    stats.caches = {"target": cache_kinds(kv.target)}
    if draft is not None:
        stats.caches["draft"] = cache_kinds(kv.draft)
    return kv


def hidden_rows(tap: HiddenTap) -> mx.array:
    """The latest target pass's hidden states (L, H) at the tap's first place: row i is
    position start + i of the tokens that pass was fed."""
    return tap.final()[0]


def _reads_hidden(draft) -> bool:
    """Whether the draft is a head over the target's hidden states (not a model)."""
    return bool(getattr(draft, "reads_hidden", None))


def _fill(target, draft, prompt: list[int], kv: KVState, stats: Stats, step: int) -> None:
    """Prefill both models with the prompt minus its last token, reusing what kv holds. A
    head over the target's hidden states is fed each chunk's pairs as the target makes them,
    all but the newest, which waits in kv.hidden for the first proposal."""
    t0 = time.perf_counter()
    stats.cached_tokens = _reuse(kv, prompt[:-1], target, draft)
    if _reads_hidden(draft):
        tap = HiddenTap(target, draft.reads_hidden)

        def feed(rows: mx.array) -> None:  # rows (c, H): the chunk's hidden states
            rows = rows if kv.hidden is None else mx.concatenate([kv.hidden, rows])
            n, fed = rows.shape[0] - 1, kv.draft_len
            if n > 0:  # pairs (h_j, t_{j+1}) at positions fed..fed+n-1
                draft(rows[None, :n], pair_tokens(prompt, fed, n), kv.draft)
                mx.eval([c.state for c in kv.draft])
            kv.hidden, kv.draft_len = rows[n:], fed + n

        _prefill(target, kv.target, prompt[len(kv.tokens) : -1], step, tap, feed)
    else:
        _prefill(target, kv.target, prompt[len(kv.tokens) : -1], step)
    if draft is not None and not _reads_hidden(draft):
        _prefill(draft, kv.draft, prompt[kv.draft_len : -1], step)
        kv.draft_len = len(prompt) - 1
    kv.tokens = prompt[:-1]
    mx.clear_cache()  # prefill's temporaries: decoding needs the room
    stats.prefill_s = time.perf_counter() - t0


@contextmanager
def _wired() -> Iterator[None]:
    """Keep the weights wired (resident) on a Mac while generating, as mlx-lm's
    generate does; its own helper prints a warning on stdout, which carries our text."""
    old = set_wired_limit()  # None where the device reports no limit
    try:
        yield
    finally:
        if old is not None:
            mx.synchronize(_STREAM)
            mx.set_wired_limit(old)


def _reuse(kv: KVState, context: list[int], target: nn.Module, draft: nn.Module | None) -> int:
    """Keep the longest common prefix of what ``kv`` holds and ``context`` (the prompt minus
    its last token, which the first round feeds); returns its length. Caches that cannot be
    trimmed are kept only when they hold a prefix of the context, else replaced."""
    held = kv.tokens
    m = 0
    for a, b in zip(held, context, strict=False):
        if a != b:
            break
        m += 1
    keep = _head_keep(kv, m, _reads_hidden(draft)) if kv.reads_hidden else m
    if keep < len(held):
        if can_rollback(kv.target, len(held) - keep):
            trim(kv.target, len(held) - keep)
        else:  # recurrent state, or a window that dropped what the shorter prefix needs
            kv.target, keep = make_caches(target), 0
    m = min(m, keep)
    kv.tokens = held[:m]
    if kv.reads_hidden and kv.draft is not None:
        _trim_head(kv, m, keep, _reads_hidden(draft))
    elif kv.draft is not None:
        keep = min(kv.draft_len, m)
        if keep < kv.draft_len and can_rollback(kv.draft, kv.draft_len - keep):
            trim(kv.draft, kv.draft_len - keep)
        elif keep < kv.draft_len:
            kv.draft, keep = (make_caches(draft) if draft is not None else None), 0
        kv.draft_len = keep
    return m


def _head_keep(kv: KVState, m: int, using: bool) -> int:
    """How many tokens the target cache keeps when a head's state rides along in ``kv``
    and the new context shares m tokens with what the target holds. The head holds pairs
    j < fed and waits on hidden states for positions fed..avail-1. A generation that uses
    the head needs its pending rows to reach where the target resumes, so the target keeps
    min(m, avail) when that leaves the head's pairs inside the shared prefix, else both go
    back to m - 1 (the head's last pair reads token t_fed: it must be shared) and the target
    recomputes from there. One that does not use the head keeps m."""
    if not using:
        return m
    fed = kv.draft_len
    avail = fed + (0 if kv.hidden is None else kv.hidden.shape[0])
    if fed + 1 <= min(m, avail):
        return min(m, avail)
    return max(0, min(fed, m - 1))


def _trim_head(kv: KVState, m: int, keep: int, using: bool) -> None:
    """Bring a head's state to what is still right once the target keeps ``keep`` tokens
    and the new context shares m with them: a pair j reads token t_{j+1}, so pairs stay
    only where that token is shared; pending rows reach no further than the target resumes.
    A generation using the head needs it exactly at the target's length or with rows up to
    it (``_head_keep`` chose ``keep`` so)."""
    fed = kv.draft_len
    if using:
        p = min(fed, keep)
    else:
        p = fed if m > fed else max(0, m - 1)
    if p < fed:
        trim(kv.draft, fed - p)
        kv.draft_len, kv.hidden = p, None
    elif kv.hidden is not None:
        n = min(keep, m) - fed
        kv.hidden = kv.hidden[:n] if n > 0 else None


def _prefill(
    model: nn.Module,
    cache: list,
    tokens: list[int],
    step: int,
    tap: HiddenTap | None = None,
    feed: Callable[[mx.array], None] | None = None,
) -> None:
    """Run the prompt through a model in chunks, evaluating each so memory stays bounded;
    with a tap, each chunk's hidden states (c, H) go to ``feed``."""
    for i in range(0, len(tokens), step):
        model(mx.array(tokens[i : i + step], dtype=mx.uint32)[None], cache=cache)
        if tap is None:
            mx.eval([c.state for c in cache])
        else:
            rows = hidden_rows(tap)
            mx.eval([c.state for c in cache], rows)
            feed(rows)


class _Stops:
    """EOS ids, token-id stop sequences and the token budget. EOS is not emitted; a stop
    sequence is emitted (the text layer strips stop strings). Only the last few tokens are
    kept, so checking costs the same at the 10th token and the 10,000th."""

    def __init__(self, eos: Sequence[int], seqs: Sequence[Sequence[int]], max_tokens: int):
        self.eos, self.max_tokens = set(eos), max_tokens
        self.seqs = [list(s) for s in seqs if s]
        self.span = max((len(s) for s in self.seqs), default=0)
        self.recent: list[int] = []  # the last ``span`` tokens emitted
        self.count = 0  # tokens emitted

    def cut(self, new: list[int]) -> tuple[list[int], str | None]:
        """Keep the prefix of ``new`` up to the first stop; return it and the finish reason."""
        for i, t in enumerate(new):
            if t in self.eos:
                return new[:i], "stop"
            self.count += 1
            if self.span:
                self.recent = (self.recent + [t])[-self.span :]
                if any(self.recent[-len(s) :] == s for s in self.seqs):
                    return new[: i + 1], "stop"
            if self.count >= self.max_tokens:
                return new[: i + 1], "length"
        return new, None


def _plain(target, kv, prompt, process, key, stops, stats, check) -> Iterator[TokenEvent]:
    """Target-only decoding, overlapping the next step with the host like mlx-lm's
    generate_step: step i+1 is queued (async_eval) before token i is read back."""
    cache = kv.target

    def step(y: mx.array) -> mx.array:
        nonlocal key
        logits = target(y.reshape(1, -1), cache=cache)[0, -1]  # (V,)
        if process is None:
            return mx.argmax(logits, axis=-1).astype(mx.uint32)
        key, sub = mx.random.split(key)
        return sample(process(logits), sub)

    t0 = time.perf_counter()
    y = step(mx.array(prompt[-1:], dtype=mx.uint32))
    mx.async_eval(y)
    fed = len(prompt)  # tokens the cache has seen, queued steps included
    ctx = list(prompt)
    try:
        while True:
            if stops.count + 1 < stops.max_tokens:
                nxt = step(y)
                mx.async_eval(nxt)
                fed += 1
            new, reason = stops.cut([y.item()])
            ctx += new
            elapsed = time.perf_counter() - t0
            stats.record(RoundReport(0, 0, elapsed), stops.count)
            stats.finish_reason = reason
            check(new)
            if new:
                yield TokenEvent(new[0], False)
            if reason:
                return
            t0 = time.perf_counter()
            y = nxt
    finally:
        # undo what queued steps fed past the kept context: the cache holds ctx[:-1]
        extra = fed - (len(ctx) - 1)
        if extra and can_rollback(cache, extra):
            trim(cache, extra)
            kv.tokens = ctx[:-1]
        elif extra:  # recurrent state cannot give tokens back: start afresh next time
            kv.drop()
        else:
            kv.tokens = ctx[:-1]


class _Speculation:
    """One speculative generation: the target, its cache and its bookkeeping, a drafter,
    the sampling setup. A round is propose -> verify -> accept (one lazy graph, one host
    sync) -> roll back; the drafter is anything with drafters.Drafter's three methods."""

    def __init__(self, target, kv, drafter, model_drafter, process, accept: Rule, stats):
        self.target, self.tcache, self.kv, self.stats = target, kv.target, kv, stats
        self.drafter, self.model_drafter = drafter, model_drafter
        self.process, self.accept = process, accept
        self.head: mx.array | None = None  # (1, V_target) logits of a queued plain pass
        self.t_held = len(kv.tokens)  # tokens the target cache holds (queued passes included)
        # recurrent layers cannot be trimmed: the target's state is kept at each round's start
        # (and before a queued plain pass, ``head_snap``), and a rollback restores the latest
        # one at or before the kept length, feeding the target the kept tokens again
        # (caches.roll_back) -- or, where the verify pass was recorded from the snapshot it
        # started at (``rec_snap``), recomputes only the recurrence over the kept tokens
        self.t_recurrent = needs_replay(kv.target)
        self.t_snaps: list[Snapshot] = []
        self.head_snap: Snapshot | None = None
        self.rec_snap: Snapshot | None = None
        recorder = PassRecorder(target, recurrent_layers(kv.target)) if self.t_recurrent else None
        self.recorder = recorder if recorder is not None and recorder.supported else None
        self.tap: HiddenTap | None = None  # a drafter reads the target's hidden states
        self.hidden: Hidden | None = None  # the latest verify pass's, for that drafter

    def run(self, ctx, next_k, key, stops, stats, check) -> Iterator[TokenEvent]:
        drafting_rounds = 0
        plain_next = getattr(next_k, "plain_next", lambda: False)
        # a lookup match can turn up any round; a head reads every pass's hidden states
        if isinstance(self.drafter, (LookupDrafter, Chain)) or self.tap is not None:
            plain_next = lambda: False  # noqa: E731
        last, settled = None, True  # settled: the caches match ctx (not mid-round)
        try:
            while True:
                t0 = time.perf_counter()
                # a round emits up to k + 1 tokens: never draft past the budget
                room = stops.max_tokens - stops.count - 1
                k = max(0, min(next_k(last), room))
                settled = False  # (a chooser that raises leaves the caches as they were)
                if last is not None and last.k == 0:
                    drafting_rounds = 0  # a chooser's probe after plain rounds: time it
                # a queued pass would be waited for inside the draft's timing: skip, time the next
                timed = k > 0 and drafting_rounds % TIME_DRAFT_EVERY == 0 and self.head is None
                drafting_rounds += k > 0 and self.head is None
                queue = k == 0 and room > 0 and plain_next()
                keys = None  # greedy rounds draw nothing: no keys
                if self.process is not None:  # one split a round: the draft's, u's, the draw's
                    key, *keys = mx.random.split(key, 4)
                proposal, n, tokens = self.step(ctx, k, keys, timed, queue, room)
                k = proposal.k
                new, reason = stops.cut(tokens[:n] + [tokens[k]])
                n_kept = len(new) - 1 if reason else n
                self.rollback(ctx, new, k, n_kept, done=reason is not None)
                ctx += new
                self.drafter.settle(ctx, len(ctx) - len(new) + n_kept, self.hidden)
                settled = True
                last = RoundReport(
                    k, n, time.perf_counter() - t0, proposal.draft_s, proposal.match,
                    proposal.confidences, proposal.made,
                )  # fmt: skip
                stats.record(last, stops.count)
                stats.finish_reason = reason
                check(new)
                for i, t in enumerate(new):
                    yield TokenEvent(t, i < n)
                if reason:
                    return
        finally:
            self.drafter.close()
            if not settled:  # an exception mid-round: what the caches hold is unknown
                self.kv.drop()
            else:
                if self.head is not None:  # closed early with a plain pass queued: undo it
                    self.head = None
                    self.give_back(self.t_held - 1, ctx)
                self.kv.tokens = ctx[:-1]
                md = self.model_drafter
                if isinstance(md, HeadDrafter):
                    self.kv.draft_len, self.kv.hidden = md.fed, md.rows
                elif md is not None:
                    self.kv.draft_len = md.held

    def step(self, ctx, k, keys=None, timed=False, queue=False, room=None):
        """propose -> verify -> accept as one lazy graph, read back with one host sync.
        Returns (the proposal, n accepted, [d_1..d_k, next]). ``timed`` lets the drafter add
        a second sync after drafting, to time it apart from the target (one drafting round
        in TIME_DRAFT_EVERY, for the statistics and adaptive k). ``queue``: if this round is
        plain, queue the next plain pass. ``room``: the most drafts the token budget allows
        (default k); an adaptive chooser may verify that many lookup tokens instead of k."""
        draft_key, u_key, draw_key = keys if keys is not None else (None, None, None)
        proposal = self.drafter.propose(ctx, k, k if room is None else room, draft_key, timed)
        logits = self.verify(ctx, proposal.tokens)  # (k+1, V_target)
        n, nxt = self.accept_from(logits, proposal, u_key, draw_key)
        out = mx.concatenate([n.astype(mx.uint32).reshape(1), proposal.tokens, nxt.reshape(1)])
        if queue and proposal.k == 0:
            # as target-only decoding does: the next pass runs while the host reads this one
            mx.async_eval(out)
            if self.t_recurrent:
                self.head_snap = snapshot(self.tcache, self.t_held)
            self.head = self.target(nxt.reshape(1, 1), cache=self.tcache)[0]  # (1, V_target)
            self.t_held += 1
            mx.async_eval(self.head)
        out = out.tolist()  # the round's one host sync
        return proposal, out[0], out[1:]

    def verify(self, ctx: list[int], d: mx.array) -> mx.array:
        """The target's pass over ctx[-1] and the k drafts d (k,) -> logits (k+1, V_target),
        lazy. A queued plain pass already fed ctx[-1]: its logits are the first row."""
        self.t_snaps = [] if self.head_snap is None else [self.head_snap]
        self.head_snap = self.rec_snap = None
        if self.t_recurrent:
            self.t_snaps.append(snapshot(self.tcache, self.t_held))
        k = d.shape[0]
        fed = k + 1 if self.head is None else k
        start = self.t_held
        if self.recorder and fed:
            self.rec_snap = self.t_snaps[-1]
        with self.recorder.recording(fed) if self.rec_snap else nullcontext():
            if self.head is None:
                x = mx.concatenate([mx.array(ctx[-1:], dtype=mx.uint32), d])[None]  # (1, k+1)
                logits = self.target(x, cache=self.tcache)[0]
            else:
                logits, self.head = self.head, None
                if k > 0:  # the chooser broke its word: correct, if a pass slower
                    logits = mx.concatenate([logits, self.target(d[None], cache=self.tcache)[0]])
        if self.tap is not None:  # (never with a queued pass: plain_next is off for heads)
            self.hidden = Hidden(start, hidden_rows(self.tap))  # (k+1, H), lazy
        self.t_held += fed
        return logits

    def accept_from(self, logits: mx.array, proposal, u_key, draw_key) -> tuple[mx.array, mx.array]:
        """(n accepted, the next token), lazy: greedy, a plain sample, or the sampled rule
        (q None is a point mass: no one-hot rows; a narrower q needs no padding)."""
        d = proposal.tokens
        if self.process is None:
            return accept_greedy(logits, d)
        if proposal.k == 0:
            return mx.array(0), sample(self.process(logits[0]), draw_key)
        p = self.process(logits)  # (k+1, V_target)
        u = mx.random.uniform(shape=(proposal.k,), key=u_key)
        return self.accept(p, proposal.q, d, u, draw_key)

    def rollback(self, ctx: list[int], new: list[int], k: int, n_kept: int, done: bool) -> None:
        """Bring the target's cache back to the kept context; ``ctx`` is the context before
        this round, ``new`` the tokens it emits. The target fed ctx[-1] + k drafts and keeps
        n_kept of them (plus the next token, if a plain pass was queued: undone when
        generation is ``done``). The drafter settles its own state after this."""
        queued = done and self.head is not None
        if queued:
            self.head = None
        self.give_back(self.t_held - (k - n_kept + queued), ctx + new)

    def give_back(self, keep: int, context: list[int]) -> None:
        """Make the target's cache hold context[:keep] (caches.roll_back)."""

        def settle(snap: Snapshot, keep: int) -> bool:  # from the recorded verify pass
            return snap is self.rec_snap and self.recorder.settle(
                keep - snap.offset, snap.recurrent
            )

        self.stats.replayed += roll_back(
            self.target, self.tcache, self.t_held, keep, self.t_snaps, context, settle
        )
        self.t_held = keep
