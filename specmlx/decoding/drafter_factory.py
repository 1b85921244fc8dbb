"""The one place drafters are built, ready to draft: for a lone generation
(``lone_drafter``: lookup, the draft model or a head, an early exit, chains and siblings)
and for a batch's rows (``batch_drafter``). Each object gets everything it reads at
construction: the side-leaf sizer goes into the drafter that branches, a tree size into
lookup and Medusa, and the adaptive chooser reads the leaves through the ``choose`` call
it is given (nothing is set onto an object after it is built).

Whether a drafter may branch is known from what it will be before it is built: the draft
model as a row (or over its own cursor without per-token stopping), a head, a block
drafter; Medusa and suffix lookup take a tree size of their own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import mlx.nn as nn

from ..core.kvstate import KVState, reads_hidden
from ..core.stats import KChooser, RoundReport, Stats
from ..core.tree_pass import tree_refusal
from ..core.vocab import draft_ids, logit_width
from ..drafting.choosing.adaptive import AdaptiveK
from ..drafting.choosing.cost_curve import CostCurve
from ..drafting.choosing.tree_size import OFF, SideSizer, TreeSize
from ..drafting.drafters import ModelDrafter
from ..drafting.heads.medusa import MedusaDraft
from ..drafting.lookup.lookahead import LookaheadRows
from ..drafting.lookup.memory import Lookup
from ..drafting.lookup.rows import LookupRows
from ..drafting.proposals import RowDrafter
from ..drafting.row_drafters import (
    ChainRows,
    HeadRows,
    LoneRows,
    ModelRows,
    fits_one_row,
    row_drafter,
)
from ..drafting.self_draft import SharedExit
from ..drafting.trees.expand import expand_refusal
from ..drafting.trees.rows import MedusaRows, SiblingRows
from ..errors import BadInput
from .decode import Decode, Parts
from .round import Row

__all__ = ["Drafting", "batch_drafter", "lone_drafter"]


@dataclass(frozen=True)
class Drafting:
    """What drafts for a lone generation. drafter: the row drafter (None: nothing drafts);
    holder: what holds the draft's state at the end (a ModelDrafter's cursor, a row
    drafter's row, a SharedExit; None: none); choose: the next round's k from the last
    round's report (the chooser, weighing side leaves where an adaptive one sizes trees)."""

    drafter: RowDrafter | None
    holder: object | None
    choose: Callable[[RoundReport | None], int]


def lone_drafter(target: nn.Module, draft: nn.Module | None, decode: Decode, parts: Parts,
                 kv: KVState, row: Row, next_k: KChooser, exit_shared: bool) -> Drafting:  # fmt: skip
    """The drafter of a lone generation: lookup first when asked, then the draft model or
    head as a row of one (with trees and lookup, lookup's continuation and that drafter's
    chain as siblings in one tree instead); the draft model over its own cursor for per-token
    stopping (its chunks read the draft's confidences, a lone option) and for caches with no
    batch kind (row_drafters.fits_one_row); an early exit over the target's caches when
    ``exit_shared`` (self_draft.SharedExit).

    target, draft: the models (draft None: lookup or nothing); decode: the request; parts:
    what the caller lends (the lookup memory, the draft's vocabulary); kv: both models'
    caches, prefilled; row: the generation's row; next_k: its k chooser; exit_shared: the draft
    is an early exit over the target's own caches. BadInput for a tree the drafter or the
    target cannot take."""
    tree = decode.tree
    own_cursor = draft is not None and not exit_shared and (
        decode.draft_stop or not (reads_hidden(draft) or fits_one_row(draft, kv.draft))
    )  # fmt: skip
    # what may branch: a drafter with a distribution at each step (side leaves) or Medusa;
    # not an early exit, nor per-token stopping (its chunks are cut after leaves are chosen)
    may_branch = draft is not None and not exit_shared and not decode.draft_stop
    runs = _block(draft) and not own_cursor  # a block drafter's leaves go on for free
    sizer = _sizer(target, kv.target, decode, next_k, row.stats, runs) if may_branch else None
    drafters: list[RowDrafter] = []
    finder = Lookup(row.ctx, parts.lookup_memory) if decode.lookup else None
    if finder is not None:  # (it indexes the row's own list)
        drafters.append(_lookup(finder, target, kv, decode, next_k, row, draft is not None))
    holder = branching = None
    if exit_shared:
        vocab = draft_ids(target, draft, parts.vocab_size)[1]
        holder = SharedExit(draft, kv.target, row.process, vocab)
        drafters.append(LoneRows(holder, "an early exit over the target's caches"))
    elif own_cursor:
        embeds, vocab = draft_ids(target, draft, parts.vocab_size)
        plan = next_k.draft_plan if decode.draft_stop else None
        holder = ModelDrafter(draft, kv.draft, kv.draft_held, vocab, embeds, row.process, plan)
        drafters.append(LoneRows(holder, "the draft model over its own caches", sizer))
        branching = drafters[-1] if sizer is not None else None
    elif draft is not None:  # the batch's drafter, as one row
        medusa = isinstance(draft, MedusaDraft)  # (its own trees: a size, no sizer)
        size = tree if medusa and sizer is not None else OFF
        holder, _ = row_drafter(target, draft, parts.vocab_size, None if medusa else sizer, size)
        holder.join(row, kv.draft, kv.draft_held, kv.waiting)
        drafters.append(holder)
        branching = holder if sizer is not None else None
    if tree.expand:  # EAGLE-2's grown tree: a draft model's or a head's, as a row
        why = expand_refusal(draft, decode.draft_stop)
        if why is None and not isinstance(holder, (ModelRows, HeadRows)):
            why = "the draft's caches have no batch kind: it drafts over its own, chains"
        if why:
            raise BadInput(f"tree {tree}: {why}")
    if sizer is None and not (tree.off or tree.auto or _branching_lookup(drafters, holder)):
        what = _DRAFTERS.get(type(holder), "n-gram lookup") if drafters else "nothing drafts"
        raise BadInput(
            f"tree {tree}: {what} cannot branch (trees: a draft model, a head, Medusa, suffix "
            "lookup)"
        )
    if branching is not None and finder is not None and not tree.auto:
        # lookup's continuation beside the drafter, in one tree; auto keeps the choice by
        # value, one of them a round (siblings measured slower here: BENCHMARKS.md, "Token
        # trees")
        drafters = [SiblingRows(finder, next_k, branching, logit_width(target))]
    choose: Callable[[RoundReport | None], int] = next_k
    medusa = isinstance(branching, MedusaRows)
    if branching is not None and not medusa and isinstance(next_k, AdaptiveK) and tree.auto:
        # k weighed with the leaves the sizer would add to it, from this row's statistics
        choose = partial(next_k, widen=partial(sizer.gain, stats=row.stats), dips=sizer.dips)
    if not drafters:
        return Drafting(None, None, choose)
    return Drafting(drafters[0] if len(drafters) == 1 else ChainRows(drafters), holder, choose)


def batch_drafter(target: nn.Module, draft: nn.Module, vocab_size: int | None, tree: TreeSize,
                  cost: CostCurve, no_trees: str | None) -> tuple[RowDrafter, int]:  # fmt: skip
    """The row drafter of a batch's rows and the ids it may propose: its side leaves (or
    grown trees) sized by ``tree`` for the rows that ask for trees, priced by ``cost`` (the
    batch's pass-cost curve; a greedy row may fill a cheaper wider pass), unless the target
    cannot verify a tree (``no_trees`` says why) or ``tree`` is off.

    target, draft: the models (draft: a model, a chained head or a block drafter);
    vocab_size: the ids the pair shares (None: the smaller logit width)."""
    sizer = None
    if not (tree.off or no_trees):
        sizer = SideSizer(tree, AdaptiveK(cost=cost), runs=_block(draft))
    return row_drafter(target, draft, vocab_size, sizer)


def _lookup(finder: Lookup, target, kv: KVState, decode: Decode, next_k, row: Row,
            fallback: bool) -> RowDrafter:  # fmt: skip
    """Lookup's row drafter: lookahead decoding (its own tree each round, where the target
    verifies trees: auto falls back to suffix lookup's chains and says why), or suffix lookup
    (its tree of continuations, sized by ``decode.tree``), or n-gram lookup (chains)."""
    width = logit_width(target)
    method, window = decode.lookup.method, decode.lookup.lookahead
    if window is not None:  # lookahead
        why = tree_refusal(target, kv.target)
        if why is None:
            return LookaheadRows(finder, next_k, window, width, seed=len(row.ctx))
        if not window.auto:
            raise BadInput(f"{window}: the target cannot verify a tree: {why}")
        row.stats.tree_off = f"lookahead needs a tree the target cannot verify: {why}"
        method = "suffix"
    size = OFF
    if method == "suffix" and not decode.tree.off:  # its tree of continuations
        takes = _sizer(target, kv.target, decode, next_k, row.stats) is not None
        size = decode.tree if takes else OFF
    return LookupRows(finder, next_k, fallback=fallback, method=method, width=width, size=size)


def _branching_lookup(drafters: list, holder) -> bool:
    """Suffix lookup or lookahead alone propose their trees (nothing else drafting)."""
    return holder is None and any(
        isinstance(d, LookaheadRows) or (isinstance(d, LookupRows) and not d.size.off)
        for d in drafters
    )


# what a drafter is, for the refusal of a fixed tree size
_DRAFTERS = {SharedExit: "an early exit", ModelDrafter: "the draft model with per-token stopping"}


def _block(draft) -> bool:
    """Whether ``draft`` is a block drafter (DFlash: a head that drafts k in one forward)."""
    return bool(reads_hidden(draft) and getattr(draft, "block_size", None))


def _sizer(target, cache: list, decode: Decode, next_k, stats: Stats,
           runs: bool = False) -> SideSizer | None:  # fmt: skip
    """The side-leaf sizer when the generation asks for trees and the target's caches take
    them (None: chains, and for auto ``stats.tree_off`` says why); BadInput for a fixed size
    they cannot take. A sampled round's acceptance is not probed: only a greedy one dips;
    runs: a block drafter's leaves go on (tree_size.SideSizer)."""
    if decode.tree.off:
        return None
    why = tree_refusal(target, cache)
    if why is None:
        return SideSizer(decode.tree, next_k, runs=runs, dips=decode.sampling.greedy)
    if decode.tree.auto:
        stats.tree_off = f"the target cannot verify a tree: {why}"
        return None
    raise BadInput(f"tree {decode.tree}: the target cannot verify a tree: {why}")
