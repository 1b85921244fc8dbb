"""Drafters: what proposes the tokens a target pass verifies. One protocol for all of them.

A drafter gets the context and the chooser's k and returns a Proposal: the tokens, the
distribution q each was drawn from (None: a point mass, as for prompt lookup and for any
greedy drafter) and how they were drafted. When the round is settled it is told how much of
what it has seen is still right and brings its own state (a KV cache, an index) there.
Verification, acceptance and the target's rollback are the same for every drafter, which is
what keeps all of them lossless: a drafter can only change how many tokens a target pass
yields. Here, what drafts for a lone sequence only: the draft model over its own cursor
(with per-token stopping, whose chunks read the draft's confidences, or with caches that
have no batch kind) and the early exit over the target's caches (self_draft.SharedExit).
The round sees them as rows of one (row_drafters.LoneRows); prompt lookup is a row drafter
of one (lookup.rows.LookupRows); the draft model, the heads over the target's hidden states (MTP,
EAGLE-3) and the block drafter (DFlash) are row drafters themselves (row_drafters.py), each
written once for a lone sequence and a batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx

from ..core.cursor import Cursor
from ..core.sampling import Processor, sample

# fed to the draft in place of an id its embedding table lacks (a padding row of a wider
# target's logits): the draft's guesses get worse for a while, the output stays exact
SAFE_ID = 0
# per-token stopping: the most extensions a round may draft (each one host sync)
DRAFT_MORE_MAX = 8
# a head's waiting hidden states past which they are fed without a proposal (see catch_up)
FEED_AFTER = 16
_NONE = mx.array([], dtype=mx.uint32)


@dataclass
class Proposal:
    """A round's drafts. tokens (k,) uint32, maybe still lazy; q (k, V_q) the distribution
    each was drawn from (V_q may be narrower than the target's logits: ids past it have
    q = 0), None for a point mass; source "model", "lookup" or "none" (nothing proposed)."""

    tokens: mx.array = _NONE
    q: mx.array | None = None
    source: str = "none"
    match: int = 0  # lookup: the length of the n-gram match the tokens follow
    draft_s: float | None = None  # seconds of drafting, when timed apart (one host sync)
    confidences: tuple[float, ...] = ()  # per-token stopping: the draft's q of each kept draft
    made: int | None = None  # per-token stopping: drafts made, when more than were kept
    # a draft model's step scores, each (vocab,) lazy: the q a token was drawn from, or the
    # logits a greedy one was the argmax of; a tree reads its side leaves from them
    scores: tuple[mx.array, ...] = ()

    @property
    def k(self) -> int:
        return self.tokens.shape[0]


class Drafter(Protocol):
    """A lone sequence's drafter. ``needs_k``: it proposes only when the round's k > 0
    (lookup may verify a match when k is 0)."""

    needs_k: bool

    def propose(self, ctx: list[int], k: int, room: int, key: mx.array | None) -> Proposal:
        """Up to k tokens to follow ``ctx`` (an adaptive chooser may let lookup verify up to
        ``room``); key: randomness for sampling (None when greedy)."""
        ...

    def settle(self, ctx: list[int], right: int) -> None:
        """The round is over: ``ctx`` is the whole context now, and its first ``right``
        tokens are what this round's target pass confirmed; anything the drafter has seen
        past them is wrong and is given back."""
        ...

    def close(self) -> None:
        """The generation ended (or stopped early)."""
        ...


class ModelDrafter:
    """A draft model and its cursor. The cursor holds ctx[:held] for some held <=
    len(ctx) - 1 between rounds; it is fed ctx[held:] before it drafts, which covers the
    2-token catch-up after a fully accepted round and whatever lookup accepted meanwhile.

    model, cache: the draft and its caches, which hold ``held`` tokens; vocab: how many ids
    it may propose; embeds: ids it can embed (others are fed as SAFE_ID); process: the sampling
    processor (None: greedy); plan: per-token stopping (an AdaptiveK's draft_plan) or None."""

    needs_k = True

    def __init__(self, model, cache, held, vocab, embeds, process, plan=None):
        self.vocab, self.embeds, self.process, self.plan = vocab, embeds, process, plan
        self.cursor = Cursor(model, cache, held, own_ids=self.own_ids)

    def own_ids(self, ids: Sequence[int]) -> list[int]:
        return [t if t < self.embeds else SAFE_ID for t in ids]

    def propose(self, ctx, k, room, key) -> Proposal:
        if k <= 0:
            return Proposal()
        t0 = time.perf_counter()
        cur = self.cursor
        cur.forget_before(cur.held)  # this round gives back nothing it has not fed
        x = mx.array(self.own_ids(ctx[cur.held :]), dtype=mx.uint32)[None]  # (1, L)
        more = None
        if self.plan is not None:  # per-token stopping: k is a go; the plan sizes the chunks
            k = max(1, min(self.plan([])[1], room))
            if key is not None:
                key, more = mx.random.split(key)
        scores: list[mx.array] = []
        d, q, conf = draft_model_propose(
            cur.feed, x, k, self.vocab, self.process, key, seen=lambda s: scores.append(s[0])
        )
        if self.plan is not None:
            return self.stop_or_extend(d, q, conf, room, more, t0)
        return Proposal(d[0], None if q is None else q[0], "model", scores=tuple(scores))

    def stop_or_extend(self, d, q, conf, room: int, key: mx.array | None, t0: float) -> Proposal:
        """Per-token stopping: read the draft's confidences (one host sync), draft more while
        the plan says it pays (one sync per chunk: fewer than one per token), and keep the
        prefix worth verifying. d (1, m), q (1, m, vocab) or None, conf (1, m). Always
        timed: the confidences were read anyway."""
        confs = conf[0].tolist()
        first = len(confs)  # drafted before any confidence was read: sunk for the plan
        keys = mx.random.split(key, DRAFT_MORE_MAX) if key is not None else None
        for ext in range(DRAFT_MORE_MAX):
            keep, more = self.plan(confs, drafted=first)
            more = min(more, room - len(confs))
            if more <= 0:
                break
            d2, q2, c2 = draft_model_propose(
                self.cursor.feed, d[:, -1:], more, self.vocab, self.process,
                None if keys is None else keys[ext],
            )  # fmt: skip
            d = mx.concatenate([d, d2], axis=1)
            q = None if q is None else mx.concatenate([q, q2], axis=1)
            confs += c2[0].tolist()
        keep = max(1, min(keep, len(confs)))
        return Proposal(
            d[0, :keep],
            None if q is None else q[0, :keep],
            "model",
            draft_s=time.perf_counter() - t0,
            confidences=tuple(confs[:keep]),
            made=len(confs) if len(confs) > keep else None,
        )

    def settle(self, ctx, right) -> None:
        self.cursor.give_back(min(self.cursor.held, right), ctx)

    def close(self) -> None:
        pass


def draft_model_propose(
    feed: Callable[[mx.array], mx.array],
    pending: mx.array,
    k: int,
    vocab: int,
    process: Processor | None,
    key: mx.array | None,
    seen: Callable[[mx.array], None] | None = None,
) -> tuple[mx.array, mx.array | None, mx.array]:
    """Feed the draft the tokens it has not seen yet, pending (B, L), then draft k tokens.

    Nothing waits here: each step is queued with async_eval (the host never blocks) and feeds
    the previous step's not-yet-read token.
    Returns d (B, k) uint32, q (B, k, vocab) float32 (None when greedy) and the draft's
    confidence in each token (B, k): its probability under q (greedy: under the softmax).
    MLX is lazy: the confidence costs nothing unless someone reads it.

    feed: runs the draft over (B, L) tokens and returns its logits (B, L, V) -- a Cursor's
        ``feed``, which counts what the cache holds and keeps what a rollback needs; the
        cache grows by L + k - 1 (the last drafted token is never fed).
    key: randomness for sampling (unused, and may be None, when greedy).
    vocab: restricts proposals to ids the target has (Code Llama 7B has 16 more than 34B).
    seen: given each step's scores (B, vocab), lazy: q when sampling, the logits when greedy
        (a lone row's tree takes its side leaves from them).
    The engine uses B = 1; tests batch thousands of rounds through this same function.
    """
    keys = mx.random.split(key, k) if process is not None else None  # greedy draws nothing
    x, tokens, qs, confs = pending, [], [], []
    for i in range(k):
        logits = feed(x)[:, -1, :vocab]  # (B, vocab)
        if process is None:
            t = mx.argmax(logits, axis=-1).astype(mx.uint32)
            confs.append(mx.softmax(logits, axis=-1).max(axis=-1))  # (B,)
        else:
            q = process(logits)
            t = sample(q, keys[i])
            qs.append(q)
            confs.append(mx.take_along_axis(q, t[:, None].astype(mx.int32), axis=-1)[:, 0])
        if seen is not None:
            seen(logits if process is None else q)
        tokens.append(t)
        x = t[:, None]  # (B, 1)
        mx.async_eval(t)  # start computing while the next step's graph is built: no host wait
    d = mx.stack(tokens, axis=1)
    return d, (mx.stack(qs, axis=1) if qs else None), mx.stack(confs, axis=1)
