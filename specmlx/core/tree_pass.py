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
the path) and gives the rest back. Full-attention caches and specmlx's sliding windows
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

from .caches import WindowKVCache, layer_caches
from .tree_acceptance import Tree

# RoPE modules whose rotation depends on the whole length, not on each position alone
_LENGTH_DEPENDENT = ("DynamicNTKScalingRoPE",)
# the layer caches a tree pass can mask and compact: full attention, and the windows that keep
# keys in time order (mlx-lm's RotatingKVCache keeps a ring, which make_caches replaces)
_TREE_KINDS = {"KVCache", "WindowKVCache"}


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
    return mx.array(np.concatenate([before, seen], axis=1))


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


class _Placed(nn.Module):
    """A rope module for one tree pass: the module's own rotation at each node's position
    (the nodes moved to the batch axis, one offset each)."""

    def __init__(self, rope: nn.Module, positions: mx.array):
        super().__init__()
        self.__dict__["_rope"], self.__dict__["_positions"] = rope, positions

    def __call__(self, x: mx.array, offset=0, **kwargs) -> mx.array:
        # x (1, H, L, D) -> (L, H, 1, D): a row a node, rotated at its own position
        y = self._rope(x.transpose(2, 1, 0, 3), offset=self._positions, **kwargs)
        return y.transpose(2, 1, 0, 3)


def _ropes(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """(module, its rope) for every module of ``model`` that keeps one."""
    out = []
    for _, m in model.named_modules():
        rope = m.get("rope") if isinstance(m, dict) else None
        if isinstance(rope, nn.Module):
            out.append((m, rope))
    return out


def tree_logits(model: nn.Module, cache: Sequence, tokens: mx.array, tree: Tree) -> mx.array:
    """The target's logits at the root and every node (N + 1, V), lazy, in one pass; the
    caches then hold the N + 1 entries after what they held (``keep_path`` next).

    model: the target; cache: its layer caches (full attention or windows: tree_refusal); tokens
    (N + 1,): the root's token, then the nodes'; tree: the shape."""
    why = tree_refusal(model, cache)
    if why:
        raise ValueError(f"a tree pass cannot run: {why}")
    held = next(c for c in layer_caches(cache)).offset
    positions = mx.array([held + d for d in tree.depths()])
    ropes = _ropes(model)
    try:
        for m, rope in ropes:
            m["rope"] = _Placed(rope, positions)
        return model(tokens[None], cache=[_Masked(c, tree) for c in cache])[0]
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
