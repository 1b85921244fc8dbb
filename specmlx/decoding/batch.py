"""Speculation for many sequences at once: B rows decoded in one target pass a round.

Each round the draft model drafts k tokens for every row (one catch-up pass over each row's
unseen tokens, right-padded, then k - 1 one-token steps, all rows together), the target
verifies every row's k + 1 positions in one pass, each row accepts by its own rule (its own
sampler, its own seed) and keeps its own accepted prefix: the caches are core.rows'
RowsKVCache, where a row's rollback is its own length. One lazy graph and one host sync a
round, as for one sequence (engine.py). A row joins between rounds (its prompt prefilled
alone, reusing a prompt cache's prefix) and leaves between rounds (its caches come back as a
KVState, for the prompt cache).

Exact per row: a row's greedy tokens are the target's for its context whatever else is in
the batch, and a sampled row draws from the same keys, in the same order, as a solo
generation with the same k would (engine.py splits its key the same way each round), so
it follows the target's distribution through the same acceptance rules. Models whose layers
keep full attention, sliding windows or the recurrent state of a known mixer batch
(rows.batchable): the rest are served one at a time. Recurrent rows roll back by their kept
steps: the target's verify pass is recorded and each row's recurrence recomputed over its own
kept steps (recurrent.PassRecorder.settle_rows); the draft keeps its state after its
catch-up and after each drafting step, and each row takes the one at its kept length.

The draft may instead be a chained head over the target's hidden states (an MTP or EAGLE-3
head): the verify pass is tapped (hidden.HiddenTap), each row keeps the features of its
confirmed positions as pairs waiting to be fed (``pending``), and a proposal feeds every
row's waiting pairs at once (right-padded, the pads given back) and chains k - 1 steps, as
drafters.HeadDrafter does for one sequence; the chained entries are given back after the
round. A block drafter (DFlash) keeps each row's context cache apart and drafts each row's
block in a pass of its own, at that row's width, as drafters.BlockDrafter does (its block
attends to the context and to itself both ways, so a block's logits depend on its width and
on nothing of another row): the target's pass is still one for all rows.
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from ..core.acceptance import Rule, accept_proposal, sampled_rule
from ..core.caches import make_caches, recurrent_layers
from ..core.hidden import HiddenTap
from ..core.kvstate import KVState, common_prefix, reads_hidden
from ..core.recurrent import PassRecorder
from ..core.rows import attention_rows, batchable, row_of, rows_of, solo_of
from ..core.sampling import Processor, make_processor, round_keys, sample
from ..core.stats import RoundReport, Stats, TokenEvent
from ..core.vocab import logit_width
from ..drafting.choosers import K
from ..drafting.drafters import FEED_AFTER, SAFE_ID
from ..errors import BadInput, IncompatiblePair
from .engine import prefill
from .request import Decode, token_ids
from .stops import Stops


@dataclass
class Row:
    """One sequence of a batch: its context (prompt + generated), the k it asked for, its
    stops, seed, sampler, acceptance rule and statistics. ``done``: it reached a stop (it
    leaves next). Its randomness is its own: each round's keys come from its seed and its
    length (sampling.round_keys), as a solo generation's do."""

    ctx: list[int]
    k: K  # (a fixed k is the row's own; "auto" follows what the batch's owner picks)
    stops: Stops
    seed: int
    process: Processor | None
    rule: Rule
    stats: Stats = field(default_factory=Stats)
    done: bool = False
    drafts: bool = True  # False: it asked for no draft (plain steps in the batch's passes)
    draft_held: int = 0  # how much of ctx the draft's row holds (a prefix of ctx[:-1])
    # a head's row: the target's features at positions draft_held.. it has not been fed
    # yet (m, F), the pairs' hidden states; None: none (a one-token prompt's first round)
    waiting: mx.array | None = None
    own_cache: list | None = None  # a block drafter's row: its context cache, its own


class Batch:
    """Rows that decode together: ``join`` a prompt, ``round(k)`` (every row one round, up to
    k + 1 tokens each), ``leave`` a row.

    target, draft: mlx-lm models (draft None: batched plain decoding), or a chained head over
    the target as the draft; both must batch (rows.batchable). vocab_size: how many ids the
    draft may propose (default: the smaller logit width)."""

    def __init__(self, target: nn.Module, draft: nn.Module | None, vocab_size: int | None = None):
        for what, model in (("target", target), ("draft", draft)):
            why = batchable(model) if model is not None else None
            if why:
                raise IncompatiblePair(f"the {what} cannot decode in a batch: {why}")
        self.target, self.draft = target, draft
        self.head = reads_hidden(draft)
        self.block = bool(getattr(draft, "block_size", None))  # a DFlash drafter: per row
        self.tap = HiddenTap(target, draft.reads_hidden) if self.head else None
        width = logit_width(target)
        self.draft_embeds = 0
        if draft is not None and not self.head:
            width = min(width, logit_width(draft))
            self.draft_embeds = getattr(getattr(draft, "args", None), "vocab_size", None) or width
        self.vocab = min(vocab_size or width, width)
        self.rows: list[Row] = []
        self.t_cache: list | None = None  # per layer: core.rows' batch caches
        self.d_cache: list | None = None
        # the target's recurrent mixers, recorded each verify pass (None: none to roll back)
        layers = recurrent_layers(make_caches(target))
        self.recorder = PassRecorder(target, layers) if layers else None
        self._draft_states: list[list[list]] = []  # the draft's states after each step

    def join(
        self,
        prompt_ids: Sequence[int],
        decode: Decode,
        kv: KVState | None = None,
        stats: Stats | None = None,
        drafts: bool = True,
        generated: int = 0,
    ) -> Row:
        """Prefill a prompt alone and add it as the last row; its first tokens come at the
        next round. decode: the request's settings (max_tokens its whole budget); kv: caches
        whose common prefix with the prompt is kept (a prompt cache's); stats: filled live
        (a fresh one if None); drafts: False for a row that asked for no draft (it takes
        plain steps in the batch's passes); generated: tokens the request already made
        elsewhere (alone, or before it was parked): their ids end ``prompt_ids``, they count
        against the budget, its stats go on counting from there and keep its prompt's
        figures, and its keys go on from its seed where it stopped."""
        prompt = token_ids(prompt_ids)
        if decode.lookup or decode.draft_stop:
            raise BadInput("a batch drafts with the draft model only (no lookup, no stopping)")
        kv = kv if kv is not None else KVState()
        stats = stats if stats is not None else Stats()
        kept = (stats.prompt_tokens, stats.cached_tokens, stats.prefill_s)
        prefill(self.target, self.draft, prompt, kv=kv, stats=stats)
        if generated:  # the caches held all but the last token: this was no prompt's prefill
            stats.prompt_tokens, stats.cached_tokens, stats.prefill_s = kept
        if not 0 <= generated < decode.max_tokens:
            raise BadInput(f"{generated} tokens made of a budget of {decode.max_tokens}")
        seed = decode.seed if decode.seed is not None else random.getrandbits(63)
        process = None if decode.sampling.greedy else make_processor(decode.sampling)
        made = prompt[len(prompt) - generated :]
        stops = Stops(decode.eos_ids, decode.stop_ids, decode.max_tokens, made)
        rule = sampled_rule(decode.verify)
        row = Row(list(prompt), decode.k, stops, seed, process, rule, stats, drafts=drafts)
        self.t_cache = rows_of(self.t_cache, kv.target)  # it holds prompt[:-1]
        if self.recorder is not None:
            self.recorder.layers = recurrent_layers(self.t_cache)
        if self.block:  # its context cache stays the row's own
            row.own_cache = kv.draft
        elif self.draft is not None:
            self.d_cache = rows_of(self.d_cache, kv.draft)
        if self.draft is not None:
            row.draft_held, row.waiting = kv.draft_held, kv.waiting
        self.rows.append(row)
        return row

    def share(self, prompt_ids: Sequence[int], kv: KVState) -> KVState:
        """The caches a joining prompt starts from: ``kv`` (a prompt cache's), or a copy of
        a running row's when that row holds a longer prefix of the prompt (requests sent
        together with one long system prompt or document: the first one's prefill serves
        the others). The copy holds what ``leave`` would give back (a head's waiting
        features too); the engine trims it to the shared prefix. Not for recurrent layers:
        their state does not cut back to a shorter prefix."""
        context = list(prompt_ids[:-1])
        best, most = -1, common_prefix(kv.tokens, context)
        for i, r in enumerate(self.rows):
            n = common_prefix(r.ctx[:-1], context)
            if n > most and not r.done:
                best, most = i, n
        target = row_of(self.t_cache, best) if best >= 0 else None
        if target is None:
            return kv
        row, draft = self.rows[best], None
        if self.block:  # its own context cache (a copy is free until written)
            draft = copy.deepcopy(row.own_cache)
        elif self.draft is not None:
            draft = row_of(self.d_cache, best)
        if self.head and draft is None:
            return kv  # (a head needs its pairs for the prefix the target keeps)
        out = KVState(target=target, tokens=row.ctx[:-1])
        if draft is not None:  # else a draft model prefills the whole prompt afresh
            out.draft, out.draft_held = draft, row.draft_held
            out.waiting, out.reads_hidden = row.waiting, self.head
        return out

    def leave(self, row: Row) -> KVState:
        """Take ``row`` out; its caches back as a KVState that holds its ctx[:-1]."""
        i = self.rows.index(row)
        self.rows.pop(i)
        kv = KVState()
        kv.target, kv.tokens = solo_of(self.t_cache, i), row.ctx[:-1]
        if self.draft is not None:
            kv.draft = row.own_cache if self.block else solo_of(self.d_cache, i)
            kv.draft_held, kv.waiting, kv.reads_hidden = row.draft_held, row.waiting, self.head
        if not self.rows:
            self.t_cache = self.d_cache = None
        return kv

    def round(self, k: int | Sequence[int]) -> list[list[TokenEvent]]:
        """One round for every row; each row's new token events, in row order (a row that
        reached a stop is marked ``done`` and must leave before the next round). k: drafts
        per row, one for all or one each (0, or no draft model: one plain step)."""
        rows = self.rows
        if any(r.done for r in rows):
            raise RuntimeError("a finished row must leave before the next round")
        if not rows:
            return []
        t0 = time.perf_counter()
        asked = [k] * len(rows) if isinstance(k, int) else list(k)
        if len(asked) != len(rows):
            raise ValueError(f"{len(asked)} k for {len(rows)} rows")
        # a row near its budget verifies fewer (as a solo generation would: the same keys); a
        # head's row with nothing to read yet drafts nothing; a block drafts at most
        # block_size - 1
        top = self.draft.block_size - 1 if self.block else None
        ks = [
            max(0, min(ki, r.stops.room, top if top is not None else ki))
            * (self.draft is not None and r.drafts)
            * (not self.head or r.waiting is not None)
            for r, ki in zip(rows, asked, strict=True)
        ]
        # the drafts one pass verifies: no more than any row can use (a huge k asked for
        # costs nothing past what the rows' budgets let them emit)
        k = max(ks)
        keys = [_split(r) for r in rows]  # per row (draft, u, draw), all None when greedy
        propose = (
            self._propose_block
            if self.block
            else self._propose_head
            if self.head
            else self._propose
        )
        if k:
            d, qs = propose(rows, k, ks, [kk[0] for kk in keys])
        else:
            d, qs = None, [None] * len(rows)
        last = mx.array([[r.ctx[-1]] for r in rows], dtype=mx.uint32)  # (B, 1)
        x = last if d is None else mx.concatenate([last, d], axis=1)  # (B, k + 1)
        recurrent = recurrent_layers(self.t_cache) if self.recorder is not None else []
        before = [list(c.cache) for c in recurrent]  # (references: the mixers assign anew)
        with (
            self.recorder.recording(k + 1) if recurrent else nullcontext(),
            self.tap or nullcontext(),
        ):
            logits = self.target(x, cache=self.t_cache)  # (B, k + 1, V)
        feats = self.tap.features() if self.head else None  # (B, k + 1, F), lazy
        outs = []
        for i, r in enumerate(rows):  # each row by its own rule, sampler, keys and k
            ki = ks[i]
            di = d[i, :ki] if d is not None else mx.zeros((0,), dtype=mx.uint32)
            qi = qs[i][:ki] if qs[i] is not None else None
            n, nxt = accept_proposal(logits[i, : ki + 1], di, qi, r.process, r.rule, *keys[i][1:])
            pad = mx.zeros((k - ki,), dtype=mx.uint32)
            outs.append(mx.concatenate([n.astype(mx.uint32).reshape(1), di, nxt.reshape(1), pad]))
        got = mx.stack(outs).tolist()  # the round's one host sync: (B, k + 2)
        seconds = time.perf_counter() - t0
        events, kept, steps = [], [], []
        for i, (r, ki, (n, *tokens)) in enumerate(zip(rows, ks, got, strict=True)):
            fed = len(r.ctx) - 1  # where this round's drafts start, in both models
            new, reason = r.stops.cut(tokens[:n] + [tokens[ki]])
            r.ctx += new
            kept.append(len(r.ctx) - 1 - fed)  # of the k + 1 tokens the target was fed
            if self.head:  # the pairs (h_j, t_{j+1}) this pass confirmed wait to be fed
                new_rows = feats[i, : kept[-1]]
                r.waiting = new_rows if r.waiting is None else mx.concatenate([r.waiting, new_rows])
            elif k:  # the draft fed ctx and k - 1 drafts: it keeps what ctx confirms of them
                r.draft_held = min(fed + 1 + min(n, k - 1), len(r.ctx) - 1)
                steps.append(r.draft_held - fed - 1)  # drafting steps kept after its catch-up
            r.stats.record(RoundReport(ki, n, seconds), r.stops.count)
            r.stats.finish_reason, r.done = reason, bool(reason)
            events.append([TokenEvent(t, j < n) for j, t in enumerate(new)])
        # keep: a target row fed ctx[-1] and k drafts; it keeps what its new ctx[:-1] holds
        for c in attention_rows(self.t_cache):
            c.lens = [len(r.ctx) - 1 for r in rows]
        if recurrent:  # each row's state after its kept steps (lazy: the next round's sync)
            self.recorder.settle_rows(kept, before)
        if k and not self.block:  # a head's chained entries are never kept: its pairs are
            for c in attention_rows(self.d_cache):
                c.lens = [r.draft_held for r in rows]
            self._settle_draft(steps)
        if self.head and max((len_of(r.waiting) for r in rows), default=0) > FEED_AFTER:
            self._catch_up(rows)
        return events

    def _propose_head(self, rows: list[Row], k: int, ks: list[int], keys):
        """k drafts per row from a chained head: every row's waiting pairs fed at once,
        right-padded (the pads given back), then k - 1 chained steps, all rows together, as
        drafters.head_propose does for one. d (B, k), each row's q (k, vocab) or None."""
        g, logits = self._feed_pending(rows, keep_last=False)  # (B, 1, H), (B, vocab)
        steps = [mx.random.split(kk, ki) if kk is not None and ki else None
                 for kk, ki in zip(keys, ks, strict=True)]  # fmt: skip
        tokens, qs = [], []
        for j in range(k):
            if j:
                g, logits = self.draft(g, tokens[-1][:, None], self.d_cache)
                g, logits = g[:, -1:], logits[:, -1, : self.vocab]
            step_keys = [s[j] if s is not None and j < s.shape[0] else None for s in steps]
            t, q = _draw(rows, logits, step_keys)
            tokens.append(t)
            qs.append(q)
            mx.async_eval(t)
        d = mx.stack(tokens, axis=1)  # (B, k)
        per_row = [None if r.process is None else mx.stack([q[i] for q in qs])
                   for i, r in enumerate(rows)]  # fmt: skip
        return d, per_row

    def _feed_pending(self, rows: list[Row], keep_last: bool):
        """Feed every row's waiting pairs (all but each row's newest when ``keep_last``),
        right-padded to the longest; the pads are given back and each row's draft_held grows
        by what it was fed. Returns the outputs at each row's last pair fed: g (B, 1, H) and
        logits (B, vocab). A row with nothing to feed is fed a zero pair, given back."""
        counts = [max(0, len_of(r.waiting) - keep_last) for r in rows]
        top = max(max(counts), 1)
        feats, toks = [], []
        for r, m in zip(rows, counts, strict=True):
            f = r.waiting[:m] if m else mx.zeros((0, self._feature_width(rows)))
            feats.append(mx.pad(f, [(0, top - m), (0, 0)]))
            pairs = r.ctx[r.draft_held + 1 : r.draft_held + 1 + m]
            toks.append(pairs + [0] * (top - m))
        g, logits = self.draft(mx.stack(feats), mx.array(toks, dtype=mx.uint32), self.d_cache)
        for c in attention_rows(self.d_cache):
            c.give_back([top - m for m in counts])
        at = mx.array([max(m - 1, 0) for m in counts])[:, None, None]
        g = mx.take_along_axis(g, at, axis=1)  # (B, 1, H)
        logits = mx.take_along_axis(logits, at, axis=1)[:, 0, : self.vocab]
        for r, m in zip(rows, counts, strict=True):
            r.draft_held += m
            r.waiting = r.waiting[m:] if r.waiting is not None and m < len_of(r.waiting) else None
        return g, logits

    def _propose_block(self, rows: list[Row], k: int, ks: list[int], keys):
        """Each row's block, as drafters.BlockDrafter drafts it for one sequence: the row's
        waiting context fed to its own cache, then a block of its own ks[i] + 1 positions
        after its newest token, drawn with the row's draft key. d (B, k) (zeros past ks[i]),
        each row's q (ks[i], vocab) or None."""
        tokens, qs = [], []
        for r, ki, key in zip(rows, ks, keys, strict=True):
            m = len_of(r.waiting)
            if m:
                self.draft(r.waiting[None], None, r.own_cache)
                r.draft_held, r.waiting = r.draft_held + m, None
            if not ki:
                tokens.append(mx.zeros((k,), dtype=mx.uint32))
                qs.append(None)
                continue
            first = mx.array(r.ctx[-1:], dtype=mx.uint32)  # (1,)
            logits = self.draft.block(None, first, ki + 1, r.own_cache)[0, :, : self.vocab]
            if r.process is None:
                d, q = mx.argmax(logits, axis=-1).astype(mx.uint32), None
            else:  # (each position has its own q, drawn independently)
                q = r.process(logits)
                d = sample(q, key)
            tokens.append(mx.concatenate([d, mx.zeros((k - ki,), dtype=mx.uint32)]))
            qs.append(q)
        d = mx.stack(tokens)  # (B, k)
        mx.async_eval(d)
        return d, qs

    def _feature_width(self, rows: list[Row]) -> int:
        return next(r.waiting.shape[-1] for r in rows if r.waiting is not None)

    def _catch_up(self, rows: list[Row]) -> None:
        """Feed each row's waiting pairs but its newest (rounds without proposals, as when
        the batch's k is 0, would pile them up): queued, not waited for."""
        if self.block:  # each row's context, to its own cache
            for r in rows:
                m = len_of(r.waiting) - 1
                if m > 0:
                    self.draft(r.waiting[None, :m], None, r.own_cache)
                    r.draft_held, r.waiting = r.draft_held + m, r.waiting[m:]
                    mx.async_eval([c.state for c in r.own_cache])
            return
        self._feed_pending(rows, keep_last=True)
        mx.async_eval([c.state for c in attention_rows(self.d_cache)])

    def _settle_draft(self, steps: list[int]) -> None:
        """Each draft row's recurrent layers to their state after its catch-up and steps[i]
        drafting steps, from the states kept after each (``_draft_states``)."""
        states, self._draft_states = self._draft_states, []
        if not states:
            return
        rows = mx.arange(len(steps))
        at = mx.array(steps, dtype=mx.int32)
        for layer, c in enumerate(recurrent_layers(self.d_cache)):
            c.cache = [
                None if states[0][layer][e] is None
                else mx.stack([s[layer][e] for s in states])[at, rows]  # (B, ...)
                for e in range(len(c.cache))
            ]  # fmt: skip

    def _propose(self, rows: list[Row], k: int, ks: list[int], keys) -> tuple[mx.array, list]:
        """k drafts per row: d (B, k) uint32 and each row's q (k, vocab), None when greedy.
        Each draft row is fed its unseen tokens first, right-padded to the longest (a pad
        sits after a row's real tokens, where causal attention keeps it from them, and is
        given back before the chain), then k - 1 one-token steps: its cache grows by its
        unseen tokens and k - 1. A sampled row splits its draft key into its own ks[i] keys,
        as a solo draft of ks[i] tokens does (its drafts past ks[i] are never verified)."""
        pending = [[t if t < self.draft_embeds else SAFE_ID for t in r.ctx[r.draft_held :]]
                   for r in rows]  # fmt: skip
        width = max(len(p) for p in pending)
        x = mx.array([p + [SAFE_ID] * (width - len(p)) for p in pending], dtype=mx.uint32)
        recurrent = recurrent_layers(self.d_cache)
        for c in recurrent:  # the pads leave each row's state as its real tokens left it
            c.lengths = mx.array([len(p) for p in pending])
        logits = self.draft(x, cache=self.d_cache)  # (B, width, V)
        for c in recurrent:
            c.lengths = None
        at = mx.array([len(p) - 1 for p in pending])[:, None, None]  # each row's last real
        logits = mx.take_along_axis(logits, at, axis=1)[:, 0, : self.vocab]  # (B, vocab)
        for c in attention_rows(self.d_cache):
            c.give_back([width - len(p) for p in pending])  # the pads
        keep = lambda: [list(c.cache) for c in recurrent]  # noqa: E731 - references only
        self._draft_states = [keep()] if recurrent else []
        steps = [mx.random.split(kk, ki) if kk is not None and ki else None
                 for kk, ki in zip(keys, ks, strict=True)]  # fmt: skip
        tokens, qs = [], []
        for j in range(k):
            if j:
                fed = mx.where(tokens[-1] < self.draft_embeds, tokens[-1], SAFE_ID)
                logits = self.draft(fed[:, None], cache=self.d_cache)[:, -1, : self.vocab]
                if recurrent:
                    self._draft_states.append(keep())
            step_keys = [s[j] if s is not None and j < s.shape[0] else None for s in steps]
            t, q = _draw(rows, logits, step_keys)
            tokens.append(t)
            qs.append(q)
            mx.async_eval(t)  # the host builds the next step while this one runs
        d = mx.stack(tokens, axis=1)  # (B, k)
        per_row = [None if r.process is None else mx.stack([q[i] for q in qs])
                   for i, r in enumerate(rows)]  # fmt: skip
        return d, per_row


def len_of(x: mx.array | None) -> int:
    """Rows of an array, 0 for None."""
    return 0 if x is None else x.shape[0]


def _split(row: Row) -> tuple:
    """A sampled row's keys for this round (draft, u, draw), from its seed and its length
    as a solo generation's are (sampling.round_keys); greedy rows draw nothing."""
    if row.process is None:
        return None, None, None
    return round_keys(row.seed, len(row.ctx))


def _draw(rows: list[Row], logits: mx.array, keys: list) -> tuple[mx.array, list]:
    """One draft token per row from logits (B, vocab): argmax for greedy rows, a draw from
    the row's processed q otherwise; (tokens (B,), each row's q (vocab,) or None)."""
    if all(r.process is None for r in rows):
        return mx.argmax(logits, axis=-1).astype(mx.uint32), [None] * len(rows)
    tokens, qs = [], []
    for i, r in enumerate(rows):
        if r.process is None:
            tokens.append(mx.argmax(logits[i], axis=-1).astype(mx.uint32))
            qs.append(None)
        else:
            q = r.process(logits[i : i + 1])  # (1, vocab): drawn as a solo draft draws it
            tokens.append(sample(q, keys[i])[0])
            qs.append(q[0])
    return mx.stack(tokens), qs
