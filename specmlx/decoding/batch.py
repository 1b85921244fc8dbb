"""Speculation for many sequences at once: B rows decoded in one target pass a round.

The driver is driver.Driver, the one a lone generation runs as a row of one: the drafter
(drafting.row_drafters) proposes for every row, the target verifies every row's k + 1
positions in one pass over core.batch_caches' batch caches (verifiers.RowsTarget: a row's rollback
is its own length), each row accepts by its own rule (its own sampler, its own seed) and
keeps its own accepted prefix. One lazy graph and one host sync a round. A row joins between
rounds (its prompt prefilled alone, reusing a prompt cache's prefix) and leaves between
rounds (its caches come back as a KVState, for the prompt cache).

Exact per row: a row's greedy tokens are the target's for its context whatever else is in
the batch, and a sampled row draws from the same keys, in the same order, as a solo
generation with the same k would (its keys come from its seed and its length), so it follows
the target's distribution through the same acceptance rules. Models whose layers keep full
attention, sliding windows or the recurrent state of a known mixer batch (rows.batchable):
the rest are served one at a time. What drafts for a lone request only (prompt lookup,
per-token stopping) is refused by name when a row joins.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import mlx.nn as nn

from ..core.acceptance import sampled_rule
from ..core.batch_caches import batchable, row_of, rows_of, solo_of
from ..core.caches import make_caches
from ..core.hidden import HiddenTap
from ..core.kvstate import KVState, common_prefix
from ..core.sampling import make_processor
from ..core.stats import Stats
from ..core.tree_pass import tree_refusal
from ..core.vocab import logit_width
from ..drafting.choosing.cost_curve import CostCurve
from ..drafting.choosing.tree_size import AUTO, TreeSize
from ..drafting.proposals import RowDrafter
from ..drafting.trees.expand import expand_refusal
from ..errors import BadInput, IncompatiblePair, parsed
from .decode import Decode, token_ids
from .drafter_factory import batch_drafter
from .driver import Driver
from .engine import prefill
from .round import Row
from .stops import Stops
from .verifiers import RowsTarget

__all__ = ["Batch", "Row"]


class Batch(Driver):
    """Rows that decode together: ``join`` a prompt, ``round(k)`` (driver.Driver: every row
    one round, up to k + 1 tokens each), ``leave`` a row.

    target, draft: mlx-lm models (draft None: batched plain decoding), or a chained head over
    the target as the draft; both must batch (rows.batchable). vocab_size: how many ids the
    draft may propose (default: the smaller logit width). pass_ratio: the target's measured
    pass-cost curve (choosers.ChooserStore.probe), which sizes a batch's trees under
    ``--tree auto`` (None: CostCurve's guess, +10% a token; ``price_trees`` changes it).
    tree: the batch's token trees (a tree_size.TreeSize; default auto).

    Token trees: a row whose request asks for them (its Decode's ``tree`` not off) takes side
    leaves (or EAGLE-2's grown tree, ``expand:N``) as the batch's sizer plans them from
    ``tree`` (tree_size.SideSizer.plan_rows: one count for every such row, from the curve
    at the batch's width), each row its own tree in one pass (core.tree_pass). A target with
    recurrent layers verifies chains (its rows say why in ``stats.tree_off``)."""

    def __init__(
        self,
        target: nn.Module,
        draft: nn.Module | None,
        vocab_size: int | None = None,
        pass_ratio: list[float] | None = None,
        tree: TreeSize = AUTO,
    ):
        for what, model in (("target", target), ("draft", draft)):
            why = batchable(model) if model is not None else None
            if why:
                raise IncompatiblePair(f"the {what} cannot decode in a batch: {why}")
        self.target, self.draft, self.tree = target, draft, parsed(tree, TreeSize, "tree")
        # why no row takes a tree (None: they may, when they ask)
        self.no_trees = tree_refusal(target, make_caches(target))
        self.cost = CostCurve(pass_ratio=pass_ratio)  # what sizes the trees of auto
        # what drafts for the rows (drafting.row_drafters: one class a kind of drafter)
        drafter: RowDrafter | None = None
        self.vocab = min(vocab_size or logit_width(target), logit_width(target))
        if draft is not None:
            drafter, self.vocab = batch_drafter(
                target, draft, vocab_size, self.tree, self.cost, self.no_trees
            )
        places = drafter.reads_hidden if drafter is not None else ()
        self.tap = HiddenTap(target, places) if places else None
        self.verifier: RowsTarget  # the target's batch caches
        super().__init__(RowsTarget(target, self.tap), drafter)

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
            raise BadInput(
                "prompt lookup and per-token stopping draft for a lone request only, not in a batch"
            )
        if drafts and self.drafter is not None and self.drafter.lone:
            raise BadInput(f"{type(self.drafter).__name__} drafts for a lone request only")
        if drafts and self.drafter is not None and decode.tree.expand:
            why = expand_refusal(self.draft)  # (as a lone generation refuses it)
            if why:
                raise BadInput(f"tree {decode.tree}: {why}")
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
        row.wants_trees = self._trees(decode.tree, stats)
        self.verifier.cache = rows_of(self.verifier.cache, kv.target)  # prompt[:-1]
        self.verifier.rows_changed()
        if self.drafter is not None:
            self.drafter.join(row, kv.draft, kv.draft_held, kv.waiting)
        self.rows.append(row)
        return row

    @property
    def pass_ratio(self) -> list[float] | None:
        """The pass-cost curve the batch's trees are sized from (None: the guess)."""
        return self.cost.pass_ratio

    def price_trees(self, pass_ratio: list[float] | None) -> None:
        """Size the batch's auto trees from ``pass_ratio`` (a probe of the target's pass
        costs; None: CostCurve's guess, +10% a token) from the next round on."""
        self.cost.pass_ratio = pass_ratio

    def _trees(self, size: TreeSize, stats: Stats) -> bool:
        """Whether a row asking for ``size`` takes trees (as the batch's ``tree`` sizes
        them): not where it asks for none, nothing drafts, or the batch's trees are off (a
        draft with none drafts chains: there is nothing to branch)."""
        if size.off or self.drafter is None or self.tree.off:
            return False
        if self.no_trees:
            stats.tree_off = f"the target cannot verify a tree: {self.no_trees}"
            return False
        return True

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
        target = row_of(self.verifier.cache, best) if best >= 0 else None
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
        kv.target, kv.tokens = solo_of(self.verifier.cache, i), row.ctx[:-1]
        if self.drafter is not None:
            kv.draft, kv.draft_held = self.drafter.leave(i, row), row.draft_held
            kv.waiting, kv.reads_hidden = row.waiting, self.tap is not None
        if not self.rows:
            self.verifier.cache = None
            if self.drafter is not None:
                self.drafter.empty()
        return kv
