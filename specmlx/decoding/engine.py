"""The round loop: prefill, then rounds of propose -> verify -> accept -> keep -> settle;
yields token events.

Bookkeeping, in one place: ``ctx`` is every token so far (prompt + generated). The target's
position is its Cursor's (cursor.py): between rounds it holds ctx[:-1] (the last token is fed
at the start of the next pass), or all of ctx when a plain round already queued the next
plain pass; a draft holds a prefix of ctx[:-1]. A drafter is anything with drafters.Drafter's
three methods: the draft model, a head over the target's hidden states or a block drafter
(the batch's row drafters as one row: row_drafters.OneRow), prompt lookup, the draft model
with per-token stopping, or a chain; the round sees only its Proposal. When generation ends,
or the caller closes the generator early, the target holds ctx[:-1] and KVState says so
(the draft's caches given back as solo ones).

Plain rounds (k = 0) overlap like target-only decoding: when the chooser says the next round
is plain too (``plain_next``), the next target pass is queued before this round is read back,
so the host's work between rounds runs while the target computes.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn

from ..core.acceptance import Rule, accept_proposal, sampled_rule
from ..core.caches import cache_kinds, check_kinds, make_caches
from ..core.cursor import Cursor
from ..core.hidden import HiddenTap
from ..core.kvstate import KVState, reads_hidden, reuse_prefix
from ..core.mlx_lm_api import set_wired_limit
from ..core.sampling import make_processor, round_keys, sample
from ..core.stats import KChooser, RoundReport, Stats, TokenEvent
from ..core.vocab import draft_ids
from ..drafting.choosers import make_chooser
from ..drafting.drafters import Chain, Drafter, LookupDrafter, ModelDrafter, Proposal
from ..drafting.lookup import Lookup
from ..drafting.row_drafters import OneRow, fits_one_row, pair_ids, row_drafter
from ..errors import BadInput, RollbackError
from .request import Decode, Parts, token_ids
from .stops import Stops

__all__ = [
    "Decode", "KVState", "Parts", "Stats", "TokenEvent", "TIME_DRAFT_EVERY", "generate_tokens",
    "prefill",
]  # fmt: skip

# MLX streams belong to a thread: the server generates on a worker thread of its own
_STREAM = getattr(mx, "new_thread_local_stream", mx.new_stream)(mx.default_device())
# drafting rounds: the first, the first after plain rounds (while drafting is rare, as when
# adaptive k has stopped and probes now and then, one in 8 would leave the draft's time
# unmeasured for a whole generation) and then one in 8 get a second host sync, to time the
# draft apart
TIME_DRAFT_EVERY = 8


def generate_tokens(
    target: nn.Module,
    draft: nn.Module | None,
    prompt_ids: Sequence[int],
    decode: Decode | None = None,
    parts: Parts | None = None,
) -> Iterator[TokenEvent]:
    """Generate from ``target``, speculating with ``draft`` (a model), prompt lookup
    (``decode.lookup``), both (lookup first), or neither (plain target decoding).

    Output is exactly the target's: token-identical when greedy, the same distribution when
    sampling.

    target, draft: mlx-lm models (draft None: no draft model); the draft may instead be a
        head over the target's hidden states (mtp.MTPHead: anything with ``reads_hidden``).
    prompt_ids: the prompt's token ids (at least one).
    decode: what is asked for (request.Decode: sampler, k, budget, stops, lookup, rule);
        default: greedy, k = 4, 256 tokens.
    parts: what the caller lends (request.Parts: caches to reuse, stats, the k chooser, the
        lookup memory, the ranks' lockstep check, the draft's vocabulary, the prefill chunk).
    """
    decode = decode if decode is not None else Decode()
    parts = parts if parts is not None else Parts()
    prompt = token_ids(prompt_ids)
    head = reads_hidden(draft)
    next_k = parts.chooser if parts.chooser is not None else make_chooser(decode.k)
    if decode.draft_stop and (head or draft is None or not next_k.plans):
        raise BadInput(
            "per-token stopping needs a draft model and adaptive k in one process"
            + (": a head (MTP, EAGLE-3, DFlash) drafts the chooser's k" if head else "")
        )
    accept = sampled_rule(decode.verify)
    stats = parts.stats if parts.stats is not None else Stats()
    kv = _ready(parts.kv, target, draft, prompt, stats)
    speculating = draft is not None or decode.lookup
    for what, c in (("target", kv.target), ("draft", kv.draft)) if speculating else ():
        if c is not None:
            check_kinds(c, what)  # a layer cache no rollback is known for: refused by name
    stops = Stops(decode.eos_ids, decode.stop_ids, decode.max_tokens)
    seed = decode.seed if decode.seed is not None else random.getrandbits(63)
    mx.reset_peak_memory()

    with mx.stream(_STREAM), _wired():
        tap = HiddenTap(target, draft.reads_hidden) if head else None
        _fill(target, draft, prompt, kv, stats, parts.prefill_step, tap)
        process = None if decode.sampling.greedy else make_processor(decode.sampling)
        check = parts.lockstep or (lambda _tokens: None)
        if not speculating:
            loop = _plain(target, kv, prompt, process, seed, stops, stats, check)
        else:
            ctx = list(prompt)  # the context, grown each round (lookup indexes this list)
            drafters: list[Drafter] = []
            if decode.lookup:
                finder = Lookup(ctx, parts.lookup_memory)
                drafters.append(LookupDrafter(finder, next_k, fallback=draft is not None))
            model_drafter = None
            # per-token stopping reads the draft's confidences chunk by chunk (a lone
            # option), and a draft that does not fit a row of one (row_drafters.fits_one_row)
            # drafts over its own caches: both through a cursor; every other as a batch's row
            as_row = head or (draft is not None and fits_one_row(draft, kv.draft))
            if decode.draft_stop or (draft is not None and not as_row):
                embeds, vocab = draft_ids(target, draft, parts.vocab_size)
                plan = next_k.draft_plan if decode.draft_stop else None
                model_drafter = ModelDrafter(
                    draft, kv.draft, kv.draft_held, vocab, embeds, process, plan
                )
                drafters.append(model_drafter)
            elif draft is not None:  # the batch's drafter, as one row
                rows, _ = row_drafter(target, draft, parts.vocab_size)
                model_drafter = OneRow(rows, kv.draft, kv.draft_held, kv.waiting, process)
                drafters.append(model_drafter)
            drafter = drafters[0] if len(drafters) == 1 else Chain(drafters)
            cursor = Cursor(target, kv.target, len(kv.tokens), record=True, tap=tap)
            # a lookup match can turn up any round, and a head reads every pass: no queueing
            overlap = not (isinstance(drafter, (LookupDrafter, Chain)) or head)
            spec = _Speculation(cursor, drafter, process, accept, stats, next_k, overlap)
            loop = spec.run(ctx, seed, stops, check, lambda ok: _end(kv, ctx, model_drafter, ok))
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
    prompt = token_ids(prompt_ids)
    stats = stats if stats is not None else Stats()
    kv = _ready(kv, target, draft, prompt, stats)
    tap = HiddenTap(target, draft.reads_hidden) if reads_hidden(draft) else None
    with mx.stream(_STREAM), _wired():
        _fill(target, draft, prompt, kv, stats, prefill_step, tap)


def _ready(kv: KVState | None, target, draft, prompt: list[int], stats: Stats) -> KVState:
    """``kv`` (a fresh KVState if None) with caches for both models, and the prompt's
    figures in ``stats``."""
    stats.prompt_tokens = len(prompt)
    kv = kv if kv is not None else KVState()
    if kv.target is None:
        kv.drop()
        kv.target = make_caches(target)
    head = reads_hidden(draft)
    if draft is not None and (kv.draft is None or kv.reads_hidden != head):
        kv.draft, kv.draft_held, kv.waiting, kv.reads_hidden = make_caches(draft), 0, None, head
    stats.caches = {"target": cache_kinds(kv.target)}
    if draft is not None:
        stats.caches["draft"] = cache_kinds(kv.draft)
    return kv


def _fill(target, draft, prompt: list[int], kv: KVState, stats: Stats, step: int, tap) -> None:
    """Prefill both models with the prompt minus its last token, reusing what kv holds. A
    head over the target's hidden states (read through ``tap``, a HiddenTap) is fed each
    chunk's pairs as the target makes them, all but the newest, which waits in kv.waiting for
    the first proposal."""
    t0 = time.perf_counter()
    stats.cached_tokens = reuse_prefix(kv, prompt[:-1], target, draft)
    at, kv.branch_at = kv.branch_at, 0
    if len(kv.tokens) < at < len(prompt):  # stop there once and leave a copy (kvstate)
        _feed(target, draft, prompt[: at + 1], kv, step, tap)
        kv.branch = kv.copy()
    _feed(target, draft, prompt, kv, step, tap)
    mx.clear_cache()  # prefill's temporaries: decoding needs the room
    stats.prefill_s = time.perf_counter() - t0


def _feed(target, draft, prompt: list[int], kv: KVState, step: int, tap) -> None:
    """Both models' caches from what kv holds to all of prompt but its last token."""
    head = tap is not None
    target_at = Cursor(target, kv.target, len(kv.tokens), tap=tap)
    for _ in _prefill(target_at, prompt[len(kv.tokens) : -1], step):
        if head:  # rows (c, H): the chunk's hidden states
            rows = target_at.hidden.states
            rows = rows if kv.waiting is None else mx.concatenate([kv.waiting, rows])
            n, fed = rows.shape[0] - 1, kv.draft_held
            if n > 0:  # pairs (h_j, t_{j+1}) at positions fed..fed+n-1
                pairs = mx.array(pair_ids(prompt, fed, n), dtype=mx.uint32)[None]  # (1, n)
                draft(rows[None, :n], pairs, kv.draft)
                mx.eval([c.state for c in kv.draft])
            kv.waiting, kv.draft_held = rows[n:], fed + n
    if draft is not None and not head:
        list(_prefill(Cursor(draft, kv.draft, kv.draft_held), prompt[kv.draft_held : -1], step))
        kv.draft_held = len(prompt) - 1
    kv.tokens = prompt[:-1]


def _prefill(cursor: Cursor, tokens: list[int], step: int) -> Iterator[None]:
    """Run the prompt through a cursor in chunks, evaluating each so memory stays bounded
    (with a tap, its hidden states too); yields after each chunk."""
    for i in range(0, len(tokens), step):
        cursor.feed(mx.array(tokens[i : i + step], dtype=mx.uint32)[None], undoable=False)
        rows = [] if cursor.hidden is None else [cursor.hidden.states]
        mx.eval([c.state for c in cursor.cache], *rows)
        yield


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


def _plain(target, kv, prompt, process, seed, stops, stats, check) -> Iterator[TokenEvent]:
    """Target-only decoding, overlapping the next step with the host like mlx-lm's
    generate_step: step i+1 is queued (async_eval) before token i is read back. A step
    draws with its position's draw key, as a plain round of speculation does (round_keys):
    the same seed gives the same text either way."""
    cursor = Cursor(target, kv.target, len(kv.tokens))
    at = len(prompt)  # the position of the token the next step makes

    def step(y: mx.array) -> mx.array:
        nonlocal at
        logits = cursor.feed(y.reshape(1, -1), undoable=False)[0, -1]  # (V,)
        at += 1
        if process is None:
            return mx.argmax(logits, axis=-1).astype(mx.uint32)
        return sample(process(logits), round_keys(seed, at - 1)[2])

    t0 = time.perf_counter()
    y = step(mx.array(prompt[-1:], dtype=mx.uint32))
    mx.async_eval(y)
    ctx = list(prompt)
    try:
        while True:
            if stops.count + 1 < stops.max_tokens:
                nxt = step(y)
                mx.async_eval(nxt)
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
        try:
            cursor.give_back(len(ctx) - 1, ctx)
            kv.tokens = ctx[:-1]
        except RollbackError:  # recurrent state cannot give tokens back: start afresh next time
            kv.drop()


def _end(kv: KVState, ctx: list[int], drafter, settled: bool) -> None:
    """Write where the generation left both models into ``kv``, for the next one; after an
    exception mid-round (not ``settled``) what the caches hold is unknown: forget them."""
    if not settled:
        kv.drop()
        return
    kv.tokens = ctx[:-1]
    if isinstance(drafter, OneRow):
        kv.draft, kv.draft_held, kv.waiting = drafter.state()
    elif drafter is not None:
        kv.draft_held = drafter.cursor.held


class _Speculation:
    """One speculative generation: the target's cursor, a drafter (which moves its own),
    the sampling setup, the acceptance rule and the k chooser.

    overlap: queue the next plain pass early when the chooser says the next round is plain
    too (its plain_next)."""

    def __init__(self, target: Cursor, drafter, process, accept: Rule, stats: Stats,
                 next_k: KChooser, overlap: bool):  # fmt: skip
        self.target, self.drafter, self.stats = target, drafter, stats
        self.process, self.accept, self.next_k = process, accept, next_k
        self.plain_next: Callable[[], bool] = next_k.plain_next if overlap else (lambda: False)

    def run(self, ctx, seed, stops, check, end) -> Iterator[TokenEvent]:
        """Rounds until a stop. ctx: the context, grown in place; seed: the sampling seed
        (each round's keys come from it and the round's position: round_keys); stops: the
        Stops; check: the lockstep (may raise); end: called once at the end, with whether
        the caches match ctx."""
        drafting, last, settled = 0, None, True  # settled: the caches match ctx
        try:
            while True:
                t0 = time.perf_counter()
                room = stops.room  # a round emits up to k + 1 tokens
                k = max(0, min(self.next_k(last), room))
                settled = False  # (a chooser that raises leaves the caches as they were)
                drafting = 0 if last is not None and last.k == 0 else drafting  # time a probe
                # a queued pass would be waited for inside the draft's timing: time the next
                queued = self.target.queued is not None
                timed = k > 0 and not queued and drafting % TIME_DRAFT_EVERY == 0
                drafting += k > 0 and not queued
                draft_key = u_key = draw_key = None  # greedy rounds draw nothing
                if self.process is not None:  # the draft's, u's, the draw's: this round's own
                    draft_key, u_key, draw_key = round_keys(seed, len(ctx))
                # propose -> verify -> accept: one lazy graph
                proposal = self.drafter.propose(ctx, k, room, draft_key, timed)
                logits = self.target.verify(ctx[-1], proposal.tokens)  # (k+1, V_target)
                n, nxt = self.accept_from(logits, proposal, u_key, draw_key)
                out = mx.concatenate(
                    [n.astype(mx.uint32).reshape(1), proposal.tokens, nxt.reshape(1)]
                )
                if proposal.k == 0 and room > 0 and self.plain_next():
                    mx.async_eval(out)  # the next plain pass runs while the host reads this one
                    self.target.queue(nxt)
                n, *tokens = out.tolist()  # the round's one host sync
                # keep the accepted drafts and the target's token, up to a stop; settle both
                new, reason = stops.cut(tokens[:n] + [tokens[proposal.k]])
                ctx += new
                right = len(ctx) - 1  # what this round's pass confirmed
                ahead = self.target.queued is not None and not reason  # a queued pass stays
                self.stats.replayed += self.target.give_back(right + ahead, ctx)
                self.drafter.settle(ctx, right, self.target.hidden, n)
                settled = True
                last = RoundReport(
                    proposal.k, n, time.perf_counter() - t0, proposal.draft_s, proposal.match,
                    proposal.confidences, proposal.made,
                )  # fmt: skip
                self.stats.record(last, stops.count)
                self.stats.finish_reason = reason
                check(new)
                for i, t in enumerate(new):
                    yield TokenEvent(t, i < n)
                if reason:
                    return
        finally:
            self.drafter.close()
            if settled:  # closed early with a plain pass queued: give it back
                self.stats.replayed += self.target.give_back(len(ctx) - 1, ctx)
            end(settled)

    def accept_from(
        self, logits: mx.array, proposal: Proposal, u_key, draw_key
    ) -> tuple[mx.array, mx.array]:
        """(n accepted, the next token), lazy (acceptance.accept_proposal)."""
        return accept_proposal(
            logits, proposal.tokens, proposal.q, self.process, self.accept, u_key, draw_key
        )
