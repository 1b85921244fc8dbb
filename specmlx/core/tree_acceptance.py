"""Acceptance over a token tree: the kept path and the next token, as pure functions of
(target p at every node, each node's q, the tree's tokens and shape, uniforms, a key).

A tree has N drafted nodes 1..N after the root 0 (the last confirmed token); node i holds
token t_i and its parent ``parents[i - 1]`` (a smaller index: parents come first). The
target scored every node in one pass, so p[u] is its distribution after the root-to-u path.

Multi-step speculative sampling (SpecInfer, Miao et al. 2024, Alg. 2; recursive rejection
sampling). At a node u, start from r = p[u] and try its children c_1..c_m in order:

    accept c_i with probability min(1, r(t_ci) / q_ci(t_ci))  <=>  u_ci * q_ci(t_ci) < r(t_ci)
    else r <- norm(max(0, r - q_ci))

and move to the first accepted child; if none is, the next token is drawn from r (a leaf's
r is p[u] itself: the bonus token). Exact (every emitted token has the target's
distribution) when each child's token was drawn from its q independently of its siblings'
given the path: the i-th trial is then one step of token-wise speculative sampling against
the residual the earlier ones left. Greedy is the one-hot case (p one-hot at the argmax).

Candidates that are not independent draws (the top-m of one distribution, drawn without
replacement; prompt lookup's matches; a greedy head's tokens) are point masses: q_ci is
one-hot at t_ci, so acceptance is r(t_ci) and rejection removes t_ci from r. That is exact
whatever chose the tokens, as long as siblings are distinct: a point mass's token is not
random, so nothing about how it was chosen can bias the draw.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .sampling import sample


@dataclass(frozen=True)
class Tree:
    """A tree's shape, known on the host: ``parents[i]`` is node i + 1's parent (0 the root;
    each parent before its children), and its nodes' children in the order they are tried
    (the order of the nodes)."""

    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        for i, a in enumerate(self.parents):
            if not 0 <= a <= i:
                raise ValueError(f"node {i + 1}'s parent {a} does not come before it")

    @classmethod
    def chain(cls, k: int) -> Tree:
        """A chain of k drafts: each node the child of the one before."""
        return cls(tuple(range(k)))

    @property
    def size(self) -> int:
        return len(self.parents)

    def depths(self) -> list[int]:
        """Each node's depth (the root 0, its children 1)."""
        d = [0]
        for a in self.parents:
            d.append(d[a] + 1)
        return d

    def children(self) -> list[list[int]]:
        """Each node's children (root first), in the order they are tried."""
        out: list[list[int]] = [[] for _ in range(self.size + 1)]
        for i, a in enumerate(self.parents):
            out[a].append(i + 1)
        return out

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to ``node`` (empty for the root)."""
        out = []
        while node:
            out.append(node)
            node = self.parents[node - 1]
        return out[::-1]


def tree_outcome(
    p: mx.array, q: mx.array, tokens: mx.array, tree: Tree, u: mx.array
) -> tuple[mx.array, mx.array]:
    """Multi-step speculative sampling before the final draw: (the last node kept (...,),
    the next token's distribution there (..., V), normalized).

    p (..., N + 1, V) the target's probabilities at the root and every node; q (..., N, V)
    the distribution each node's token was drawn from (one-hot rows for point masses:
    ``point_mass``); tokens (..., N); tree: the shape; u (..., N) uniforms in [0, 1), one per
    node. Every node's trials run at once (a node's outcome depends only on its own children),
    then the path is followed from the root, all lazy."""
    kids = tree.children()
    width = max((len(c) for c in kids), default=0)
    r = p  # (..., N + 1, V): each node's residual, starting at its p
    took = mx.full(p.shape[:-1], -1, dtype=mx.int32)  # (..., N + 1): the child each keeps
    for j in range(width):  # every node's j-th child at once (-1: it has none)
        child = mx.array([c[j] if j < len(c) else -1 for c in kids], dtype=mx.int32)
        has = child >= 0
        row = mx.maximum(child - 1, 0)  # (N + 1,) the child's row in tokens, q, u
        t = mx.take(tokens, row, axis=-1)  # (..., N + 1)
        qc = mx.take(q, row, axis=-2)  # (..., N + 1, V)
        r_t = mx.take_along_axis(r, t[..., None], axis=-1)[..., 0]
        q_t = mx.take_along_axis(qc, t[..., None], axis=-1)[..., 0]
        trying = has & (took < 0)
        keep = trying & (mx.take(u, row, axis=-1) * q_t < r_t)
        took = mx.where(keep, child, took)
        r = mx.where((trying & ~keep)[..., None], _residual(r, qc), r)
    node = mx.zeros(p.shape[:-2], dtype=mx.int32)
    for _ in range(max(tree.depths())):  # follow each node's kept child from the root
        nxt = mx.take_along_axis(took, node[..., None], axis=-1)[..., 0]
        node = mx.where(nxt >= 0, nxt, node)
    dist = mx.take_along_axis(r, node[..., None, None], axis=-2)[..., 0, :]
    return node, dist


def _residual(r: mx.array, q: mx.array) -> mx.array:
    """norm(max(0, r - q)) by rows; an empty one (r == q, which accepts with probability 1,
    so it is never used) stays r."""
    left = mx.maximum(r - q, 0.0)
    total = left.sum(axis=-1, keepdims=True)
    return mx.where(total > 1e-12, left / mx.maximum(total, 1e-30), r)


def accept_tree(
    p: mx.array, q: mx.array, tokens: mx.array, tree: Tree, u: mx.array, key: mx.array
) -> tuple[mx.array, mx.array]:
    """The kept path's last node and the next token (..., ), lazy: ``tree_outcome`` and one
    draw. The path itself is ``tree.path(node)`` once read back."""
    node, dist = tree_outcome(p, q, tokens, tree, u)
    return node, sample(dist, key)


def accept_tree_greedy(logits: mx.array, tokens: mx.array, tree: Tree) -> tuple[mx.array, mx.array]:
    """Temperature 0: keep the longest path whose every token is the target's argmax after
    its parent; the next token is the argmax at its end. logits (..., N + 1, V), tokens
    (..., N); siblings distinct (at most one child can match)."""
    best = mx.argmax(logits, axis=-1).astype(tokens.dtype)  # (..., N + 1)
    parents = mx.array(list(tree.parents), dtype=mx.int32)
    ok = tokens == mx.take(best, parents, axis=-1)  # (..., N): node i is its parent's argmax
    kids = tree.children()
    took = mx.full(best.shape, -1, dtype=mx.int32)
    for j in range(max((len(c) for c in kids), default=0)):
        child = mx.array([c[j] if j < len(c) else -1 for c in kids], dtype=mx.int32)
        hit = (child >= 0) & mx.take(ok, mx.maximum(child - 1, 0), axis=-1)
        took = mx.where(hit & (took < 0), child, took)
    node = mx.zeros(best.shape[:-1], dtype=mx.int32)
    for _ in range(max(tree.depths())):
        nxt = mx.take_along_axis(took, node[..., None], axis=-1)[..., 0]
        node = mx.where(nxt >= 0, nxt, node)
    return node, mx.take_along_axis(best, node[..., None], axis=-1)[..., 0]
