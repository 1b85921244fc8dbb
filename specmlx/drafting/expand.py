"""EAGLE-2's dynamic draft tree (Li et al. 2024, arXiv 2406.16858) grown by a draft model or
a chained head (MTP, EAGLE-3) for one greedy row (``--tree expand:N``; row_drafters.ModelRows
and HeadRows call it).

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

k levels cost k - 1 draft passes of W tokens each, where the chain's cost k - 1 of one.
The nodes are chosen, not drawn: point masses for the tree's acceptance (tree_acceptance),
exact whatever chose them; a greedy row's output is the target's argmax path either way.
The scores are read on the host once, after the last level (the tree's shape is the
target's mask), where a chain reads nothing before its verify.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx
import mlx.nn as nn

from ..core.caches import WindowKVCache, layer_caches, make_caches
from ..core.kvstate import reads_hidden
from ..core.tree_acceptance import Tree
from ..core.tree_pass import keep_rows_paths, masked_logits, masked_pass, tree_refusal
from .drafters import SAFE_ID
from .medusa import MedusaDraft
from .self_draft import SelfDraft

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
    """A level through the draft: tokens (1, w), each one's parent among the level above's
    fed nodes (w,) (None: the root's children), positions (w,) and the mask (1, 1, w, S);
    the logits after each (w, vocab), lazy."""

    def __call__(self, x: mx.array, parent: mx.array | None, at: mx.array, mask: mx.array): ...


def model_feed(model: nn.Module, cache: Sequence, embeds: int) -> Feed:
    """A draft model's levels, over its caches; ids past ``embeds`` are fed as SAFE_ID."""

    def feed(x, parent, at, mask):
        return masked_logits(model, cache, mx.where(x < embeds, x, SAFE_ID), at, mask)[0]

    return feed


class HeadFeed:
    """A chained head's levels (head(hidden, tokens, cache) -> (g, logits)): a node is fed
    with its parent's output g, the root's children with ``g`` (1, 1, H), the root's."""

    def __init__(self, head: nn.Module, cache: Sequence, g: mx.array):
        self.head, self.cache, self.g = head, cache, g  # (the last level's g, (1, w, H))

    def __call__(self, x, parent, at, mask):
        hidden = self.g[:, parent] if parent is not None else mx.repeat(self.g, x.shape[1], 1)
        run = lambda c: self.head(hidden, x, c)  # noqa: E731
        self.g, logits = masked_pass(self.head, self.cache, at, mask, run)
        return logits[0]


def grow(feed: Feed, held: int, logits: mx.array, k: int, nodes: int, width: int = WIDTH) -> Grown:
    """The N best-scored nodes of a tree grown to depth k (see the module), for one row; the
    draft's caches then hold (k - 1) * width entries of the levels after what they held
    (``keep`` next).

    feed: the draft (``model_feed``, a ``HeadFeed``); held: the entries its caches hold (the
    last at the root's position, or just before it for a head); logits (vocab,): the
    draft's after the root; k: the depth; nodes: N; width: W."""
    w = min(width, logits.shape[-1])
    score = nn.log_softmax(logits.astype(mx.float32))  # (vocab,)
    tok = mx.argpartition(-score, kth=w - 1)[:w]  # (w,) depth 1
    toks, cums, parents = [tok], [score[tok]], [mx.full((w,), -1, dtype=mx.int32)]
    offset, fed, seen = 0, [], mx.zeros((w, 0), dtype=mx.bool_)  # (seen: fed ancestors)
    local = None  # each node of the level's parent among the level above's picked
    for d in range(1, k):
        level_tok, level_cum = toks[-1], cums[-1]
        pick = mx.argpartition(-level_cum, kth=w - 1)[:w] if d > 1 else mx.arange(w)  # (w,)
        fed.append(offset + pick)
        parent = local[pick] if local is not None else None
        if parent is not None:  # each picked node's fed ancestors: its parent's, and its parent
            seen = seen[parent]
        seen = mx.concatenate([seen, mx.eye(w, dtype=mx.bool_)], axis=1)  # (w, d * w)
        mask = mx.concatenate([mx.ones((w, held), dtype=mx.bool_), seen], axis=1)
        at = mx.full((w,), held - 1 + d, dtype=mx.int32)  # a level shares its depth
        out = feed(level_tok[pick][None], parent, at, mask[None, None])[:, : logits.shape[-1]]
        child = level_cum[pick][:, None] + nn.log_softmax(out.astype(mx.float32))  # (w, vocab)
        best = mx.argpartition(-child, kth=w - 1, axis=-1)[:, :w]  # (w, w)
        toks.append(best.reshape(-1))
        cums.append(mx.take_along_axis(child, best, axis=-1).reshape(-1))
        local = mx.repeat(mx.arange(w), w)  # (w * w,)
        parents.append((offset + pick)[local])
        offset += level_tok.shape[0]
    n = offset + toks[-1].shape[0]  # every node grown
    fed_at = mx.concatenate(fed) if fed else mx.zeros((0,), dtype=mx.int32)  # ((k - 1) w,)
    parts = [mx.concatenate(toks), mx.concatenate(cums), mx.concatenate(parents), fed_at]
    # the tree's one host read (its shape is the target's mask), as float32: ids below 2^24
    got = mx.concatenate([a.astype(mx.float32) for a in parts]).tolist()
    tokens, scores = [int(t) for t in got[:n]], got[n : 2 * n]
    parent = [int(p) for p in got[2 * n : 3 * n]]
    depth = [1] * w
    for i in range(w, n):
        depth.append(depth[parent[i]] + 1)
    slot = {int(g): j for j, g in enumerate(got[3 * n :])}  # fed node -> its entry
    # best first; a parent scores at least its child and is shallower, so comes first
    order = sorted(range(n), key=lambda i: (-scores[i], depth[i], i))
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


def keep(cache: Sequence, held: int, slots: Sequence[int]) -> None:
    """After ``grow`` from ``held`` tokens: keep the entries at ``slots`` (``Grown.kept``'s, a
    kept path's fed nodes) at held, held + 1, ... and give back the rest of the levels'."""
    keep_rows_paths(cache, [held], [list(slots)])
