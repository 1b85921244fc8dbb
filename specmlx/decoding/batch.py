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
from ..core.kvstate import KVState, common_prefix
from ..core.recurrent import PassRecorder
from ..core.rows import attention_rows, batchable, row_of, rows_of, solo_of
from ..core.sampling import Processor, make_processor, round_keys
from ..core.stats import RoundReport, Stats, TokenEvent
from ..core.vocab import logit_width
from ..drafting.choosers import K
from ..drafting.row_drafters import RowDrafter, row_drafter
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
        # what drafts for the rows (drafting.row_drafters: one class a kind of drafter)
        self.drafter: RowDrafter | None = None
        self.vocab = min(vocab_size or logit_width(target), logit_width(target))
        if draft is not None:
            self.drafter, self.vocab = row_drafter(target, draft, vocab_size)
        places = self.drafter.reads_hidden if self.drafter is not None else ()
        self.tap = HiddenTap(target, places) if places else None
        self.rows: list[Row] = []
        self.t_cache: list | None = None  # per layer: core.rows' batch caches
        # the target's recurrent mixers, recorded each verify pass (None: none to roll back)
        layers = recurrent_layers(make_caches(target))
        self.recorder = PassRecorder(target, layers) if layers else None

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
        if self.drafter is not None:
            self.drafter.join(row, kv.draft, kv.draft_held, kv.waiting)
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
        if self.drafter is not None:
            draft = self.drafter.copy_of(best, row)
        head = self.tap is not None
        if head and draft is None:
            return kv  # (a head needs its pairs for the prefix the target keeps)
        out = KVState(target=target, tokens=row.ctx[:-1])
        if draft is not None:  # else a draft model prefills the whole prompt afresh
            out.draft, out.draft_held = draft, row.draft_held
            out.waiting, out.reads_hidden = row.waiting, head
        return out

    def leave(self, row: Row) -> KVState:
        """Take ``row`` out; its caches back as a KVState that holds its ctx[:-1]."""
        i = self.rows.index(row)
        self.rows.pop(i)
        kv = KVState()
        kv.target, kv.tokens = solo_of(self.t_cache, i), row.ctx[:-1]
        if self.drafter is not None:
            kv.draft, kv.draft_held = self.drafter.leave(i, row), row.draft_held
            kv.waiting, kv.reads_hidden = row.waiting, self.tap is not None
        if not self.rows:
            self.t_cache = None
            if self.drafter is not None:
                self.drafter.empty()
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
        # a row near its budget verifies fewer (as a solo generation would: the same keys);
        # the drafter may allow fewer (a head's row with nothing to read yet, a block's cap)
        ks = [0] * len(rows)
        if self.drafter is not None:
            for i, (r, ki) in enumerate(zip(rows, asked, strict=True)):
                top = self.drafter.limit(r)
                ks[i] = max(0, min(ki, r.stops.room, ki if top is None else top)) * r.drafts
        # the drafts one pass verifies: no more than any row can use (a huge k asked for
        # costs nothing past what the rows' budgets let them emit)
        k = max(ks)
        keys = [_split(r) for r in rows]  # per row (draft, u, draw), all None when greedy
        if k:
            d, qs = self.drafter.propose(rows, k, ks, [kk[0] for kk in keys])
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
        feats = self.tap.features() if self.tap is not None else None  # (B, k + 1, F), lazy
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
        events, kept, fed, accepted = [], [], [], []
        for r, ki, (n, *tokens) in zip(rows, ks, got, strict=True):
            fed.append(len(r.ctx) - 1)  # where this round's drafts start, in both models
            accepted.append(n)
            new, reason = r.stops.cut(tokens[:n] + [tokens[ki]])
            r.ctx += new
            kept.append(len(r.ctx) - 1 - fed[-1])  # of the k + 1 tokens the target was fed
            r.stats.record(RoundReport(ki, n, seconds), r.stops.count)
            r.stats.finish_reason, r.done = reason, bool(reason)
            events.append([TokenEvent(t, j < n) for j, t in enumerate(new)])
        # keep: a target row fed ctx[-1] and k drafts; it keeps what its new ctx[:-1] holds
        for c in attention_rows(self.t_cache):
            c.lens = [len(r.ctx) - 1 for r in rows]
        if recurrent:  # each row's state after its kept steps (lazy: the next round's sync)
            self.recorder.settle_rows(kept, before)
        if self.drafter is not None:  # each row's draft state to what its ctx confirms
            self.drafter.settle(rows, k, fed, accepted, feats)
        return events


def _split(row: Row) -> tuple:
    """A sampled row's keys for this round (draft, u, draw), from its seed and its length
    as a solo generation's are (sampling.round_keys); greedy rows draw nothing."""
    if row.process is None:
        return None, None, None
    return round_keys(row.seed, len(row.ctx))
