"""What a token tree's verify pass costs against a causal pass of the same width (issue 65:
"a tree round costs more than its width"), split into the parts a tree adds: the tree mask
(each node sees the prefix and its ancestors), the per-node RoPE (each node at prefix +
depth) and keep_path (the kept path's keys and values moved into place).

  . scripts/env.sh && .venv/bin/python experiments/tree_pass_cost.py [--target T] [--nodes 16]

The target prefills a 300-token prompt, then each pass is timed over the same prefix (its
entries given back after each), the best of --reps after a warm-up: a causal pass over 1 and
over N + 1 tokens; the tree pass over a chain of N (the tree code, a chain's shape); a wide
tree of N (a chain of 4 with the rest side leaves under the root); the same tree with only
its mask (every node's RoPE at the root's position: wrong logits, timing only) and with only
its RoPE (the causal mask); and keep_path keeping 4 of the N + 1 entries.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402

from specmlx.core import tree_pass  # noqa: E402
from specmlx.core.caches import make_caches  # noqa: E402
from specmlx.core.tree_acceptance import Tree  # noqa: E402
from specmlx.machine import blas_in_use  # noqa: E402
from specmlx.models.loading import load_pair  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--target", default="cpu-demo-target")
ap.add_argument("--nodes", type=int, default=16)
ap.add_argument("--reps", type=int, default=5)
a = ap.parse_args()

model = load_pair(a.target)[0].model
ids = list(range(100, 400))
cache = make_caches(model)
model(mx.array(ids)[None], cache=cache)
mx.eval([c.state for c in cache])
held = cache[0].offset
n = a.nodes


def give_back() -> None:
    for c in cache:
        c.offset = held


def causal(width: int) -> mx.array:
    return model(mx.array(ids[:width])[None], cache=cache)


def tree(shape: Tree) -> mx.array:
    return tree_pass.tree_logits(model, cache, mx.array(ids[: n + 1]), shape)


def best(run) -> float:
    times = []
    for _ in range(a.reps + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        mx.eval(run())
        times.append(time.perf_counter() - t0)
        give_back()
    return min(times[1:])


class _MaskOnly(tree_pass._Placed):
    """Every node's RoPE at the root's position: the tree mask's cost alone."""

    def __call__(self, x, offset=0, **kwargs):
        return self._rope(x, offset=held, **kwargs)


class _RopeOnly(tree_pass._Masked):
    """The cache's own (causal) mask: the per-node RoPE's cost alone."""

    def make_mask(self, N, window_size=None, **kwargs):
        return self._cache.make_mask(N, window_size=window_size, **kwargs)


wide = Tree(tuple(list(range(4)) + [0] * (n - 4)))
rows = {
    "causal, 1 token": best(lambda: causal(1)),
    f"causal, {n + 1} tokens": best(lambda: causal(n + 1)),
    f"tree pass, a chain of {n}": best(lambda: tree(Tree.chain(n))),
    f"tree pass, a wide tree of {n}": best(lambda: tree(wide)),
}
placed, masked = tree_pass._Placed, tree_pass._Masked
tree_pass._Placed = _MaskOnly
rows["  its mask only"] = best(lambda: tree(wide))
tree_pass._Placed, tree_pass._Masked = placed, _RopeOnly
rows["  its RoPE only"] = best(lambda: tree(wide))
tree_pass._Masked = masked


def keep() -> float:
    mx.eval(tree(wide))
    t0 = time.perf_counter()
    tree_pass.keep_path(cache, held, [0, 1, 2, 3])
    mx.eval([c.state for c in cache])
    return time.perf_counter() - t0


kept = []
for _ in range(a.reps + 1):
    kept.append(keep())
    give_back()
rows["keep_path, 4 of the pass kept"] = min(kept[1:])

base = rows[f"causal, {n + 1} tokens"]
print(f"{a.target}, {held}-token prefix; BLAS: {blas_in_use()}")
print("| pass | ms | vs causal N + 1 |\n|---|---|---|")
for name, s in rows.items():
    print(f"| {name} | {s * 1000:.1f} | {s / base:.2f}x |")
