"""A token tree verified in one target pass, and the kept path made contiguous after it.

The pass feeds the root (the last confirmed token) and the N drafted nodes as one sequence
of N + 1 tokens after the P tokens the caches hold. Two things differ from a chain's pass,
both given to the target's own modules for the length of the pass, then taken back (no
class is patched, the family's forward runs as written):

- the mask: every node sees the prefix, its ancestors and itself. mlx-lm's models ask a
  layer cache for their mask (``create_attention_mask`` calls ``cache.make_mask``), so the
  pass hands each layer its cache behind a stand-in that answers with the tree's mask;
- the positions: node i sits at P + depth(i), not P + i. The attention layers rotate with
  their own ``rope`` module at ``offset=cache.offset``; for the pass each gets a stand-in that
  calls it with the nodes on the batch axis and one offset a node (``mx.fast.rope`` takes an
  offset per batch row), so each family's own RoPE (Llama 3, YaRN, su-scaled) does it.

Afterwards the caches hold all N + 1 entries in pass order; ``keep_path`` moves the kept
path's keys and values to the front (their rotations are already those of their places on
the path) and gives the rest back.

A batch's rows (core.batch_caches' caches, each row at its own length) take one tree each in one
pass: ``rows_tree_logits`` feeds B rows of N + 1 (a row with fewer nodes is padded with
nodes under its root that nothing reads), each row's mask its own tree's after its own
prefix, each node at its row's length + depth; ``keep_rows_paths`` keeps each row's path. Full-attention caches and specmlx's sliding windows
(``WindowKVCache``, keys in time order): a window layer's mask also hides, from each node,
the prefix keys more than a window behind the node's own position. A recurrent state cannot
take a tree, nor can mlx-lm's ring or a chunked cache (``tree_refusal`` says why, by name);
nor can a RoPE whose frequencies depend on the sequence's length (dynamic NTK).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import CacheList

from .batch_caches import BatchKVCache, attention_rows
from .caches import WindowKVCache, layer_caches
from .tree_acceptance import Tree

# RoPE modules whose rotation depends on the whole length, not on each position alone
_LENGTH_DEPENDENT = ("DynamicNTKScalingRoPE",)
# the layer caches a tree pass can mask and compact: full attention, and the windows that keep
# keys in time order (mlx-lm's RotatingKVCache keeps a ring, which make_caches replaces)
_TREE_KINDS = {"KVCache", "WindowKVCache", "BatchKVCache"}  # (a batch's rows: either kind)
_ROPES_FOUND = "_specmlx_ropes"  # where _ropes keeps what it found on a model


def tree_refusal(model: nn.Module, cache: Sequence) -> str | None:
    """Why ``model`` over ``cache`` cannot verify a tree in one pass (None: it can)."""
    kinds = {type(c).__name__ for c in layer_caches(cache)}
    if not kinds <= _TREE_KINDS:
        other = ", ".join(sorted(kinds - _TREE_KINDS))
        return (
            f"its layers keep {other}, which a tree pass cannot mask "
            "(full attention and sliding windows only)"
        )
    ropes = _ropes(model)
    if not ropes:
        return "no attention layer has a rope module whose positions a tree pass can set"
    odd = sorted({type(r).__name__ for _, r in ropes if type(r).__name__ in _LENGTH_DEPENDENT})
    if odd:
        return f"its RoPE ({odd[0]}) depends on the sequence's length, not on each position"
    return None


def tree_mask(tree: Tree, prefix: int, window: int | None = None) -> mx.array:
    """(N + 1, prefix + N + 1) bool: node i sees the prefix, its ancestors and itself; with a
    ``window``, only the keys less than a window behind its own position.

    tree: the shape; prefix: the keys before the pass that its layer gets (the last of them
    one position before the root); window: the layer's sliding window (None: full)."""
    return mx.array(_seen(tree, prefix, window))


def _seen(tree: Tree, prefix: int, window: int | None) -> np.ndarray:
    """tree_mask's booleans, on the host."""
    n = tree.size + 1
    depths = np.array(tree.depths())  # (N + 1,) the root's 0 first
    seen = np.zeros((n, n), dtype=bool)
    for i in range(n):
        seen[i, i] = True
        for j in tree.path(i):
            seen[i, j] = True
        seen[i, 0] = True  # the root: every node's first ancestor
    before = np.ones((n, prefix), dtype=bool)
    if window is not None:
        # key c of the prefix sits prefix - c positions before the root, node i depth(i)
        # after it: visible while that distance is under the window
        ago = prefix - np.arange(prefix)[None, :] + depths[:, None]  # (N + 1, prefix)
        before = ago < window
        seen &= (depths[:, None] - depths[None, :]) < window
    return np.concatenate([before, seen], axis=1)


def rows_tree_mask(trees: Sequence[Tree], lens: Sequence[int], window: int | None) -> mx.array:
    """(B, 1, N + 1, max(lens) + N + 1) bool: row b's nodes see its own first lens[b] keys
    (within the window) and their ancestors among its own N + 1 keys, written at lens[b]
    (rows.BatchKVCache keeps every row's keys at their positions); the rest is another row's
    length or stale. trees: one a row, each of N nodes (padded: ``padded``)."""
    n = trees[0].size + 1
    out = np.zeros((len(trees), 1, n, max(lens) + n), dtype=bool)
    for b, (tree, held) in enumerate(zip(trees, lens, strict=True)):
        out[b, 0, :, : held + n] = _seen(tree, held, window)
    return mx.array(out)


def padded(tree: Tree, n: int) -> Tree:
    """``tree`` with nodes added under the root up to ``n`` nodes (a batch's rows share one
    width; the pads' keys see only the prefix and the root, and no path goes through them)."""
    return Tree(tree.parents + (0,) * (n - tree.size))


class _Masked:
    """A layer cache for one tree pass: its mask is the tree's (over the keys this layer
    gets: all it holds, or a window's last window - 1); all else is the cache's."""

    def __init__(self, cache, tree: Tree):
        self._cache, self._tree = cache, tree

    def make_mask(self, N: int, window_size: int | None = None, **kwargs) -> mx.array:
        c = self._cache
        if isinstance(c, WindowKVCache):  # its pass gets min(held, window - 1) keys before
            window = c.window if window_size is None else window_size
            return tree_mask(self._tree, min(c.held, c.window - 1), window)
        return tree_mask(self._tree, c.offset, window_size)

    def __getattr__(self, name):
        return getattr(self._cache, name)


class _MaskedRows:
    """A batch layer cache (rows.BatchKVCache) for one pass of a tree a row: each row's mask
    is its own tree's (``rows_tree_mask``); all else is the cache's."""

    def __init__(self, cache: BatchKVCache, trees: Sequence[Tree]):
        self._cache, self._trees = cache, trees

    def make_mask(self, N: int, window_size: int | None = None, **kwargs) -> mx.array:
        c = self._cache
        return rows_tree_mask(self._trees, c.lens, window_size or c.window)

    def __getattr__(self, name):
        return getattr(self._cache, name)


class _Placed(nn.Module):
    """A rope module for one tree pass: the module's own rotation at each node's position
    (the nodes moved to the batch axis, one offset each)."""

    def __init__(self, rope: nn.Module, positions: mx.array):
        super().__init__()
        self.__dict__["_rope"], self.__dict__["_positions"] = rope, positions

    def __call__(self, x: mx.array, offset=0, **kwargs) -> mx.array:
        # x (B, H, L, D) -> (B * L, H, 1, D): a row a node, rotated at its own position
        B, H, L, D = x.shape
        y = self._rope(x.transpose(0, 2, 1, 3).reshape(B * L, H, 1, D), offset=self._positions,
                       **kwargs)  # fmt: skip
        return y.reshape(B, L, H, D).transpose(0, 2, 1, 3)


def _ropes(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """(module, its rope) for every module of ``model`` that keeps one: found once a model and
    kept on it (walking a 30-layer model's modules costs about 0.7 ms, and every tree pass
    asks twice), outside its parameters' tree."""
    found = model.__dict__.get(_ROPES_FOUND)
    if found is None:
        found = []
        for _, m in model.named_modules():
            rope = m.get("rope") if isinstance(m, dict) else None
            if isinstance(rope, nn.Module):
                found.append((m, rope))
        model.__dict__[_ROPES_FOUND] = found
    return found


def tree_logits(model: nn.Module, cache: Sequence, tokens: mx.array, tree: Tree) -> mx.array:
    """The target's logits at the root and every node (N + 1, V), lazy, in one pass; the
    caches then hold the N + 1 entries after what they held (``keep_path`` next).

    model: the target; cache: its layer caches (full attention or windows: tree_refusal); tokens
    (N + 1,): the root's token, then the nodes'; tree: the shape."""
    _refuse(model, cache)
    held = next(c for c in layer_caches(cache)).offset
    positions = mx.array([held + d for d in tree.depths()])
    return _pass(model, cache, tokens[None], positions, [_Masked(c, tree) for c in cache])[0]


def rows_tree_logits(
    model: nn.Module, cache: Sequence, tokens: mx.array, trees: Sequence[Tree]
) -> mx.array:
    """A batch's rows, a tree each, in one pass: logits (B, N + 1, V), lazy; each row's
    caches then hold its N + 1 entries after its length (``keep_rows_paths`` next).

    model: the target; cache: the batch's layer caches (rows.BatchKVCache: tree_refusal);
    tokens (B, N + 1): each row's root token, then its nodes' (a row's pads past its own
    tree, any ids); trees: each row's shape (fewer nodes than N: padded here)."""
    _refuse(model, cache)
    n = tokens.shape[1] - 1
    trees = [padded(t, n) for t in trees]
    lens = attention_rows(cache)[0].lens
    # (B * (N + 1),) row by row: each node at its row's length + its depth
    positions = mx.array(
        [held + d for t, held in zip(trees, lens, strict=True) for d in t.depths()]
    )
    return _pass(model, cache, tokens, positions, [_rows_masked(c, trees) for c in cache])


def masked_logits(
    model: nn.Module, cache: Sequence, tokens: mx.array, positions: mx.array, mask: mx.array
) -> mx.array:
    """Logits (B, L, V), lazy, of a pass over tokens (B, L) whose every token sits at its own
    position and sees the keys ``mask`` says: a draft growing its tree a level at a time
    (drafting/trees/expand.py), its nodes' ancestors scattered among the entries of earlier levels.

    model: any model tree_refusal accepts over ``cache``; cache: its layer caches (each row's
    L entries are written after its length); positions (B * L,): each token's, row by row;
    mask (B, 1, L, S) bool: which of the S keys the layer then holds each token sees."""
    return masked_pass(model, cache, positions, mask, lambda c: model(tokens, cache=c))


def masked_pass(model: nn.Module, cache: Sequence, positions: mx.array, mask: mx.array, run):
    """``run(caches)``'s result, with ``model``'s ropes placed at ``positions`` and ``cache``
    behind stand-ins that answer with ``mask`` (masked_logits's, for a module called its own
    way: a head's ``head(hidden, tokens, cache)``)."""
    _refuse(model, cache)
    return _pass(model, cache, None, positions, [_given(c, mask) for c in cache], run)


class _Given:
    """A layer cache whose mask for one pass is given (``masked_logits``); all else is the
    cache's."""

    def __init__(self, cache, mask: mx.array):
        self._cache, self._mask = cache, mask

    def make_mask(self, N: int, **kwargs) -> mx.array:
        return self._mask

    def __getattr__(self, name):
        return getattr(self._cache, name)


def _given(cache, mask: mx.array):
    """A layer cache (CacheList entries unpacked) behind a given mask."""
    if isinstance(cache, CacheList):
        return CacheList(*[_given(c, mask) for c in cache.caches])
    return _Given(cache, mask)


def _refuse(model: nn.Module, cache: Sequence) -> None:
    why = tree_refusal(model, cache)
    if why:
        raise ValueError(f"a tree pass cannot run: {why}")


def _rows_masked(cache, trees: Sequence[Tree]):
    """A batch layer cache (CacheList entries unpacked) behind its tree-mask stand-in."""
    if isinstance(cache, CacheList):
        return CacheList(*[_rows_masked(c, trees) for c in cache.caches])
    return _MaskedRows(cache, trees)


def _pass(model: nn.Module, cache: Sequence, x: mx.array | None, positions: mx.array, masked,
          run=None):  # fmt: skip
    """The model over x (B, L) with every rope placed at ``positions`` (B * L,) and the
    layer caches ``masked`` standing in for ``cache``; logits (B, L, V). run: call the model
    another way instead, given the masked caches (x unused)."""
    ropes = _ropes(model)
    try:
        for m, rope in ropes:
            m["rope"] = _Placed(rope, positions)
        return run(masked) if run is not None else model(x, cache=masked)
    finally:
        for m, rope in ropes:
            m["rope"] = rope


def keep_path(cache: Sequence, held: int, nodes: Sequence[int]) -> None:
    """After a tree pass from ``held`` tokens: keep the entries of ``nodes`` (indices into the
    pass, the root 0 first, then the kept path) at held, held + 1, ... and give back the rest.

    cache: the layer caches; held: what they held before the pass; nodes: the kept ones."""
    m = len(nodes)  # (0: the round's first token ended it; the root is not kept either)
    for c in layer_caches(cache):
        if m:
            row = held - getattr(c, "start", 0)  # a window's buffer starts at c.start
            at = mx.array([row + j for j in nodes], dtype=mx.int32)
            c.keys[..., row : row + m, :] = c.keys[..., at, :]
            c.values[..., row : row + m, :] = c.values[..., at, :]
        c.offset = held + m


def keep_rows_paths(cache: Sequence, held: Sequence[int], paths: Sequence[Sequence[int]]) -> None:
    """After ``rows_tree_logits`` from rows of ``held`` tokens: row b keeps the entries of
    paths[b] (indices into its pass, the root 0 first, then its kept path) at held[b],
    held[b] + 1, ... and gives back the rest. cache: the batch's layer caches."""
    for c in attention_rows(cache):
        for b, (at, nodes) in enumerate(zip(held, paths, strict=True)):
            m = len(nodes)
            if m and list(nodes) != list(range(m)):  # (a prefix of the pass stays where it is)
                src = mx.array([at + j for j in nodes], dtype=mx.int32)
                c.keys[b : b + 1, :, at : at + m] = c.keys[b : b + 1, :, src]
                c.values[b : b + 1, :, at : at + m] = c.values[b : b + 1, :, src]
        c.lens = [at + len(nodes) for at, nodes in zip(held, paths, strict=True)]
