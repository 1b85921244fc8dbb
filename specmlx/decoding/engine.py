"""A lone generation: prefill, then rounds (driver.Driver over a row of one, the driver a
batch is) until a stop; yields token events.

Bookkeeping, in one place: the row's ``ctx`` is every token so far (prompt + generated).
The target's position is its Cursor's (cursor.py, behind verifiers.LoneTarget): between
rounds it holds ctx[:-1] (the last token is fed at the start of the next pass), or all of
ctx when a plain round already queued the next plain pass; a draft holds a prefix of
ctx[:-1]. What drafts is a row drafter (drafting.row_drafters): the draft model, a head over
the target's hidden states or a block drafter, as a batch's row drafts; prompt lookup, the
lookup-first chain and the draft model over its own cursor (per-token stopping, caches with
no batch kind) as lone options. When generation ends, or the caller closes the generator
early, the target holds ctx[:-1] and KVState says so (the draft's caches given back as solo
ones).

Plain rounds (k = 0, and target-only decoding) overlap like mlx-lm's generate_step: when the
chooser says the next round is plain too (``plain_next``), the next target pass is queued
before this round is read back, so the host's work between rounds runs while the target
computes.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn

from ..core.acceptance import sampled_rule
from ..core.caches import cache_kinds, check_kinds, make_caches
from ..core.cursor import Cursor
from ..core.hidden import HiddenTap
from ..core.kvstate import KVState, reads_hidden, reuse_prefix
from ..core.mlx_lm_api import set_wired_limit
from ..core.sampling import make_processor
from ..core.stats import Stats, TokenEvent
from ..drafting.choosing.choosers import for_drafter, make_chooser
from ..drafting.drafters import ModelDrafter
from ..drafting.row_drafters import (
    pair_ids,
)
from ..drafting.self_draft import SharedExit, shares_caches
from ..errors import BadInput, RollbackError
from .decode import Decode, Parts, token_ids
from .drafter_factory import lone_drafter
from .driver import DraftClock, Driver
from .round import Row
from .stops import Stops
from .verifiers import LoneTarget

__all__ = [
    "Decode", "KVState", "Parts", "Stats", "TokenEvent", "generate_tokens", "prefill",
]  # fmt: skip

# MLX streams belong to a thread: the server generates on a worker thread of its own
_STREAM = getattr(mx, "new_thread_local_stream", mx.new_stream)(mx.default_device())


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
    next_k = parts.chooser
    if next_k is None:  # a fresh one, set for the drafter as the session sets the store's
        next_k = for_drafter(make_chooser(decode.k), draft)
    if decode.draft_stop and (head or draft is None or not next_k.plans):
        raise BadInput(
            "per-token stopping needs a draft model and adaptive k in one process"
            + (": a head (MTP, EAGLE-3, DFlash) drafts the chooser's k" if head else "")
        )
    stats = parts.stats if parts.stats is not None else Stats()
    # an early exit over the target's own caches keeps no caches of its own
    exit_shared = shares_caches(draft) and not decode.draft_stop
    own = None if exit_shared else draft  # the draft whose caches kv holds
    kv = _ready(parts.kv, target, own, prompt, stats)
    speculating = draft is not None or decode.lookup
    for what, c in (("target", kv.target), ("draft", kv.draft)) if speculating else ():
        if c is not None:
            check_kinds(c, what)  # a layer cache no rollback is known for: refused by name
    stops = Stops(decode.eos_ids, decode.stop_ids, decode.max_tokens)
    seed = decode.seed if decode.seed is not None else random.getrandbits(63)
    mx.reset_peak_memory()

    with mx.stream(_STREAM), _wired():
        tap = HiddenTap(target, draft.reads_hidden) if head else None
        _fill(target, own, prompt, kv, stats, parts.prefill_step, tap)
        process = None if decode.sampling.greedy else make_processor(decode.sampling)
        rule = sampled_rule(decode.verify)
        row = Row(list(prompt), decode.k, stops, seed, process, rule, stats,
                  wants_trees=not decode.tree.off)  # fmt: skip
        drafting = lone_drafter(target, draft, decode, parts, kv, row, next_k, exit_shared)
        drafter, holder = drafting.drafter, drafting.holder
        # the shared exit's verify pass is split at its layer: the cursor runs it through it
        model = holder.verifies if exit_shared else target
        record = drafter is not None and not exit_shared
        cursor = Cursor(model, kv.target, len(kv.tokens), record=record, tap=tap)
        # plain rounds overlap when the chooser says the next is plain too; a lookup match
        # can turn up any round, and a head reads every pass: no queueing then
        plain_next = (
            (lambda: True) if drafter is None
            else None if decode.lookup or head or exit_shared else next_k.plain_next
        )  # fmt: skip
        loop = _rounds(
            Driver(LoneTarget(cursor), drafter, [row]),
            drafting.choose if drafter is not None else None, plain_next,
            parts.lockstep or (lambda _tokens: None), lambda ok: _end(kv, row, holder, ok),
        )  # fmt: skip
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
        if head:  # states (c, H): the chunk's hidden states
            states = target_at.hidden.states
            states = states if kv.waiting is None else mx.concatenate([kv.waiting, states])
            n, fed = states.shape[0] - 1, kv.draft_held
            if n > 0:  # pairs (h_j, t_{j+1}) at positions fed..fed+n-1
                pairs = mx.array(pair_ids(prompt, fed, n), dtype=mx.uint32)[None]  # (1, n)
                draft(states[None, :n], pairs, kv.draft)
                mx.eval([c.state for c in kv.draft])
            kv.waiting, kv.draft_held = states[n:], fed + n
    if draft is not None and not head:
        list(_prefill(Cursor(draft, kv.draft, kv.draft_held), prompt[kv.draft_held : -1], step))
        kv.draft_held = len(prompt) - 1
    kv.tokens = prompt[:-1]


def _prefill(cursor: Cursor, tokens: list[int], step: int) -> Iterator[None]:
    """Run the prompt through a cursor in chunks, evaluating each so memory stays bounded
    (with a tap, its hidden states too); yields after each chunk."""
    for i in range(0, len(tokens), step):
        cursor.feed(mx.array(tokens[i : i + step], dtype=mx.uint32)[None], undoable=False)
        states = [] if cursor.hidden is None else [cursor.hidden.states]
        mx.eval([c.state for c in cursor.cache], *states)
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


def _end(kv: KVState, row: Row, holder, settled: bool) -> None:
    """Write where the generation left both models into ``kv``, for the next one; after an
    exception mid-round (not ``settled``) what the caches hold is unknown: forget them.
    holder: what holds the draft's state (a ModelDrafter, a row drafter, a SharedExit
    (nothing of its own), None)."""
    if not settled:
        kv.drop()
        return
    kv.tokens = row.ctx[:-1]
    if isinstance(holder, SharedExit):
        return
    if isinstance(holder, ModelDrafter):
        kv.draft_held = holder.cursor.held
    elif holder is not None:
        kv.draft, kv.draft_held, kv.waiting = holder.leave(0, row), row.draft_held, row.waiting


def _rounds(driver: Driver, next_k, plain_next, check, end):
    """A lone generation's rounds (the driver's one row, over its LoneTarget) until a stop;
    yields its token events. next_k: the k chooser (None: no drafter, plain steps);
    plain_next: queue the next plain pass early (round.one_round); check: the lockstep (may
    raise); end: called once at the end, with whether the caches match the row's context."""
    [row], cursor = driver.rows, driver.verifier.cursor
    clock, last, settled = DraftClock(), None, True  # settled: the caches match ctx
    try:
        while True:
            k = max(0, min(next_k(last), row.stops.room)) if next_k is not None else 0
            settled = False  # (a chooser that raises leaves the caches as they were)
            # a queued pass would be waited for inside the draft's timing: time the next
            timed = clock.timed(k, last, queued=cursor.queued is not None)
            [events] = driver.round(k, timed=timed, plain_next=plain_next)
            [last] = driver.reports
            settled = True
            check([e.token for e in events])
            yield from events
            if row.done:
                return
    finally:
        driver.close()
        if settled:  # closed early with a plain pass queued: give it back
            try:
                row.stats.replayed += cursor.give_back(len(row.ctx) - 1, row.ctx)
            except RollbackError:  # a cache with no known rollback (plain decoding only)
                settled = False
        end(settled)
