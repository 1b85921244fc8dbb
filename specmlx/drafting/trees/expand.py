"""EAGLE-2's dynamic draft tree (Li et al. 2024, arXiv 2406.16858) grown by a draft model or
a chained head (MTP, EAGLE-3) for every row of a round (``--tree expand:N``;
row_drafters.ModelRows and HeadRows call it).

A chain with side leaves (trees.py) branches only off the draft's own best path. EAGLE-2
grows the tree where the draft is confident instead, a level a draft pass:

- depth 1: the draft's W best tokens after the root, each scored by its log-probability;
- depth d + 1: the W best-scored nodes at depth d go through the draft in one pass (each
  sees the context, its own ancestors and itself, at the root's position + d; a head's node
  reads its parent's output, as its chained step would), and each one's W best next tokens
  join, scored by the summed log-probabilities of their path: the draft's probability of
  the whole path, what EAGLE-2 takes for its chance of acceptance;
- the tree: the N best-scored nodes of all. A node scores no more than its parent, so the
  parent of every chosen node is chosen too.

A batch's rows grow together, each level one pass over B rows of W nodes (each row's at its
own length, core.batch_caches). k levels cost k - 1 draft passes of W tokens each, where the chain's
cost k - 1 of one. The nodes are chosen, not drawn: point masses for the tree's acceptance
(tree_acceptance), exact whatever chose them, at any temperature. A sampled row scores them
by the draft's probabilities after its own processing (temperature, top-k, top-p, min-p),
as a point mass is kept with the target's processed probability of its token. A greedy
row's output is the target's argmax path either way, and a sampled row's tree does not
depend on its keys or on the rows beside it, so a seeded row draws alike alone and in a
batch. The scores are read on the host once, after the last level (the trees' shapes are
the target's mask), where a chain reads nothing before its verify.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx
import mlx.nn as nn

from ...core.caches import WindowKVCache, layer_caches, make_caches
from ...core.kvstate import reads_hidden
from ...core.sampling import Processor
from ...core.tree_acceptance import Tree
from ...core.tree_pass import keep_rows_paths, masked_logits, masked_pass, tree_refusal
from ..drafters import SAFE_ID
from ..heads.medusa import MedusaDraft
from ..self_draft import SelfDraft

WIDTH = 4  # W: nodes expanded a level, and children kept of each (a cap, not measured)


@dataclass(frozen=True)
class Grown:
    """A grown tree: its tokens (nodes 1..N), shape, where each node's keys sit in the
    draft's caches after the context (its slot among the levels' entries; None: it was not
    fed, a leaf of the last level or one not among its level's W best), and each node's score
    (the summed log-probabilities of its path)."""

    tokens: list[int]
    tree: Tree
    slots: list[int | None]
    scores: list[float]

    def kept(self, path_tokens: Sequence[int]) -> list[int]:
        """The slots of the nodes the draft fed along a kept path, from depth 1 while they
        were fed: path_tokens, the tokens the row kept after the root (siblings are distinct,
        so they name the path)."""
        slots, at = [], 0
        for t in path_tokens:
            child = next((i for i, (p, u) in enumerate(zip(self.tree.parents, self.tokens,
                          strict=True), start=1) if p == at and u == t), None)  # fmt: skip
            if child is None or self.slots[child - 1] is None:
                break
            slots.append(self.slots[child - 1])
            at = child
        return slots


def expand_refusal(draft: nn.Module | None, chunks: bool = False) -> str | None:
    """Why a generation cannot grow EAGLE-2's tree (None: it can): a draft model or a chained
    head (MTP, EAGLE-3) only, not an early exit, Medusa's heads, DFlash's blocks or lookup;
    over full attention (a level's mask is given whole: no window, no recurrent state);
    drafting as a row (not in chunks cut by per-token stopping).

    draft: the draft model or head (None: none); chunks: it drafts with per-token stopping."""
    only = "only a draft model or a chained head grows one"
    if draft is None:
        return f"{only}, none drafts"
    if isinstance(draft, SelfDraft):
        return f"{only}, not an early exit"
    if isinstance(draft, MedusaDraft):
        return f"{only}, not Medusa's heads (their own tree)"
    if getattr(draft, "block_size", None):
        return f"{only}, not DFlash (its block's tree)"
    if chunks:
        return "per-token stopping drafts chains"
    cache = draft.make_cache() if reads_hidden(draft) else make_caches(draft)
    why = tree_refusal(draft, cache)
    if why is None and any(isinstance(c, WindowKVCache) for c in layer_caches(cache)):
        why = "its layers keep sliding windows, which a grown level's mask does not hide"
    return f"the draft cannot grow it: {why}" if why else None


class Feed(Protocol):
    """A level through the draft for B rows: tokens (B, w), each one's parent among its
    row's fed nodes of the level above (B, w) (None: the root's children), positions
    (B * w,) row by row, and the mask (B, 1, w, S); the logits after each (B, w, vocab),
    lazy."""

    def __call__(self, x: mx.array, parent: mx.array | None, at: mx.array, mask: mx.array): ...


def model_feed(model: nn.Module, cache: Sequence, embeds: int) -> Feed:
    """A draft model's levels, over its caches; ids past ``embeds`` are fed as SAFE_ID."""

    def feed(x, parent, at, mask):
        return masked_logits(model, cache, mx.where(x < embeds, x, SAFE_ID), at, mask)

    return feed


class HeadFeed:
    """A chained head's levels (head(hidden, tokens, cache) -> (g, logits)): a node is fed
    with its parent's output g, the root's children with ``g`` (B, 1, H), the root's."""

    def __init__(self, head: nn.Module, cache: Sequence, g: mx.array):
        self.head, self.cache, self.g = head, cache, g  # (the last level's g, (B, w, H))

    def __call__(self, x, parent, at, mask):
        if parent is None:
            hidden = mx.repeat(self.g, x.shape[1], 1)
        else:  # row b's node j reads g[b, parent[b, j]]
            hidden = self.g[mx.arange(x.shape[0])[:, None], parent]  # (B, w, H)
        run = lambda c: self.head(hidden, x, c)  # noqa: E731
        self.g, logits = masked_pass(self.head, self.cache, at, mask, run)
        return logits


def _level_mask(held: mx.array, seen: mx.array, top: int) -> mx.array:
    """The mask of a level (B, 1, w, S = top): row b's nodes see its first held[b] keys, then
    among the entries after them (each level's, w a level) those ``seen`` (B, w, d * w) says:
    their fed ancestors and themselves. Rows of other lengths hold their levels elsewhere."""
    rel = mx.arange(top)[None] - held[:, None]  # (B, S): each key's place after the row's context
    n = seen.shape[-1]
    among = mx.take_along_axis(seen, mx.clip(rel, 0, n - 1)[:, None, :], axis=-1)  # (B, w, S)
    return ((rel < 0)[:, None, :] | (among & (rel < n)[:, None, :]))[:, None]


def _log_probs(logits: mx.array, process: Sequence[Processor | None]) -> mx.array:
    """The draft's log-probabilities (B, ..., vocab) that score each row's nodes: for a
    sampled row, after its own processing (temperature, then top-k, top-p, min-p: what the
    target's p goes through), as a node is kept with the target's processed probability of
    its token; -inf for a token its filters leave out."""
    x = logits.astype(mx.float32)
    if all(p is None for p in process):
        return nn.log_softmax(x, axis=-1)
    return mx.stack([nn.log_softmax(x[b], axis=-1) if p is None else mx.log(p(x[b]))
                     for b, p in enumerate(process)])  # fmt: skip


def grow(
    feed: Feed,
    held: Sequence[int],
    logits: mx.array,
    ks: Sequence[int],
    nodes: int,
    width: int = WIDTH,
    process: Sequence[Processor | None] = (),
) -> list[Grown]:
    """Each row's N best-scored nodes of a tree grown to depth ks[b] (see the module); the
    draft's caches then hold (max(ks) - 1) * width entries of the levels after what each row
    held (``keep`` next). A row of depth 0 gets an empty tree.

    feed: the draft (``model_feed``, a ``HeadFeed``); held: the entries its caches hold a row
    (the last at the root's position, or just before it for a head); logits (B, vocab): the
    draft's after each row's root; ks: each row's depth; nodes: N; width: W; process: each
    row's sampling processor (None or none given: greedy), see ``_log_probs``."""
    B, k = logits.shape[0], max(ks)
    w = min(width, logits.shape[-1])
    process = list(process) or [None] * B
    score = _log_probs(logits, process)  # (B, vocab)
    tok = mx.argpartition(-score, kth=w - 1, axis=-1)[:, :w]  # (B, w) depth 1
    toks, cums = [tok], [mx.take_along_axis(score, tok, axis=-1)]
    parents = [mx.full((B, w), -1, dtype=mx.int32)]
    offset, fed, seen = 0, [], mx.zeros((B, w, 0), dtype=mx.bool_)  # (seen: fed ancestors)
    local = None  # each node of the level's parent among the level above's picked
    rows, base = mx.arange(B)[:, None], mx.array(list(held), dtype=mx.int32)  # base: (B,)
    for d in range(1, k):
        level_tok, level_cum = toks[-1], cums[-1]  # (B, m)
        if d > 1:
            pick = mx.argpartition(-level_cum, kth=w - 1, axis=-1)[:, :w]  # (B, w)
        else:
            pick = mx.broadcast_to(mx.arange(w), (B, w))
        fed.append(offset + pick)
        parent = local[pick] if local is not None else None  # (B, w)
        if parent is not None:  # each picked node's fed ancestors: its parent's, and its parent
            seen = seen[rows, parent]
        eye = mx.broadcast_to(mx.eye(w, dtype=mx.bool_), (B, w, w))
        seen = mx.concatenate([seen, eye], axis=-1)  # (B, w, d * w)
        mask = _level_mask(base, seen, max(held) + d * w)
        at = mx.repeat(base - 1 + d, w)  # (B * w,): a level shares its depth
        x = mx.take_along_axis(level_tok, pick, axis=-1)  # (B, w)
        out = feed(x, parent, at, mask)[..., : logits.shape[-1]]  # (B, w, vocab)
        child = mx.take_along_axis(level_cum, pick, axis=-1)[..., None]
        child = child + _log_probs(out, process)  # (B, w, vocab)
        best = mx.argpartition(-child, kth=w - 1, axis=-1)[..., :w]  # (B, w, w)
        toks.append(best.reshape(B, -1))
        cums.append(mx.take_along_axis(child, best, axis=-1).reshape(B, -1))
        local = mx.repeat(mx.arange(w), w)  # (w * w,)
        parents.append((offset + pick)[:, local])
        offset += level_tok.shape[1]
    n = offset + toks[-1].shape[1]  # every node grown a row
    fed_at = mx.concatenate(fed, axis=1) if fed else mx.zeros((B, 0), dtype=mx.int32)
    parts = [mx.concatenate(toks, 1), mx.concatenate(cums, 1), mx.concatenate(parents, 1), fed_at]
    # the trees' one host read (their shapes are the target's mask), as float32: ids < 2^24
    got = mx.concatenate([a.astype(mx.float32) for a in parts], axis=1).tolist()
    return [_best(row, n, w, depth, nodes) for row, depth in zip(got, ks, strict=True)]


def _best(got: list[float], n: int, w: int, k: int, nodes: int) -> Grown:
    """A row's tree from its n grown nodes (tokens, scores, parents, then its fed nodes, as
    ``grow`` reads them): the N best-scored of depth k or less."""
    tokens, scores = [int(t) for t in got[:n]], got[n : 2 * n]
    parent = [int(p) for p in got[2 * n : 3 * n]]
    depth = [1] * w
    for i in range(w, n):
        depth.append(depth[parent[i]] + 1)
    # fed node -> its entry; a level past the row's own depth (a deeper row's) kept as
    # unfed, so the row keeps what it keeps alone
    slot = {int(g): j for j, g in enumerate(got[3 * n :]) if depth[int(g)] < k}
    # best first; a parent scores at least its child and is shallower, so comes first
    # (a token the row's filters leave out, -inf, would be rejected: never proposed)
    fit = (i for i in range(n) if depth[i] <= k and scores[i] > -math.inf)
    order = sorted(fit, key=lambda i: (-scores[i], depth[i], i))
    chosen, taken = [], set()
    for i in order:
        if len(chosen) == nodes:
            break
        if parent[i] < 0 or parent[i] in taken:
            chosen.append(i)
            taken.add(i)
    chosen.sort(key=lambda i: (depth[i], -scores[i], i))  # parents before their children
    place = {i: j for j, i in enumerate(chosen, start=1)}
    return Grown(
        [tokens[i] for i in chosen],
        Tree(tuple(place.get(parent[i], 0) for i in chosen)),
        [slot.get(i) for i in chosen],
        [scores[i] for i in chosen],
    )


def keep(cache: Sequence, held: Sequence[int], slots: Sequence[Sequence[int]]) -> None:
    """After ``grow`` from rows of ``held`` tokens: row b keeps the entries at slots[b]
    (``Grown.kept``'s, its kept path's fed nodes) at held[b], held[b] + 1, ... and gives back
    the rest of the levels'."""
    keep_rows_paths(cache, held, slots)
