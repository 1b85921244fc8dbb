"""What any token tree of N nodes could keep with a given draft, under greedy decoding
(issue 46, BENCHMARKS.md "Token trees").

Under greedy decoding a tree's node is accepted exactly when every token on its path is the
target's, and the draft's distribution at an accepted node is its distribution given the
target's own prefix. So where the target's greedy continuation is known, one teacher-forced
draft pass gives R_t, the rank of the target's token t among the draft's guesses there, and a
tree is a set of rank paths: from position t it keeps 1 + the longest d with
(R_t, ..., R_(t+d-1)) in the tree. The best tree of N nodes (depth <= D) is then the N most
frequent rank-path prefixes; this reports, in tokens per pass over all start positions:

- the chain of depth D (ranks 0, 0, ...);
- chain + side leaves (what specmlx's side leaves can build: paths of zeros then one rank s,
  s <= SIDE_MAX at each depth), best of N;
- chain + side leaves + their children (one level of expansion past the leaves), best of N;
- the best of all trees of N nodes at depth <= D (EAGLE-2's dynamic trees, DDTree and
  Sequoia all build trees of this family);
- with --followers: where a side leaf holds the target's token, how often the token after it
  is the draft's own next after that leaf (the leaf's child: what a draft pass over the
  leaves would propose) and how often it is the chain's next token (a follower that costs no
  draft pass, as DFlash's block gives its leaves: one more draft forward a position here).

  . scripts/env.sh && .venv/bin/python experiments/tree_ceiling.py cpu-demo-target \
      cpu-distilled-draft [--prompts 6] [-n 64] [--nodes 8,16] [--depth 3] [--followers]
"""

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402

from specmlx.bench.data import read_jsonl  # noqa: E402
from specmlx.decoding.decode import Decode  # noqa: E402
from specmlx.decoding.engine import generate_tokens  # noqa: E402
from specmlx.drafting.choosing.choosers import K  # noqa: E402
from specmlx.drafting.choosing.tree_size import SIDE_MAX
from specmlx.models.loading import load_pair  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("target")
ap.add_argument("draft")
ap.add_argument("--prompts", type=int, default=6)
ap.add_argument("-n", type=int, default=64)
ap.add_argument("--nodes", default="8", help="tree sizes, e.g. 8,16")
ap.add_argument("--depth", type=int, default=3)
ap.add_argument("--followers", action="store_true", help="a kept leaf's child vs the chain's next")
a = ap.parse_args()

tgt, drf, shared = load_pair(a.target, a.draft)
prompts = [r["prompt"] for _, r in read_jsonl(None, "prompts.jsonl", "prompts")
           if r.get("kind") == "code"][: a.prompts]  # fmt: skip

ranks: list[list[int]] = []  # per prompt: R_t over its generated tokens
kept = [0, 0, 0]  # --followers: side leaves kept; their child right; the chain's next right
for text in prompts:
    ids = tgt.tokenizer.encode(text)
    out = [e.token for e in generate_tokens(tgt.model, None, ids, Decode(k=K(0), max_tokens=a.n))]
    x = mx.array(ids + out[:-1], dtype=mx.uint32)[None]
    logits = drf.model(x)[0, len(ids) - 1 :, :shared]  # (n, V): the draft before each token
    want = mx.array(out)[:, None]
    above = (logits > mx.take_along_axis(logits, want, axis=1)).sum(axis=1)  # (n,)
    ranks.append(above.tolist())
    if a.followers:  # positions t whose side leaf holds the target's token, t + 1 known
        best = mx.argmax(logits, axis=-1).tolist()  # the chain's token at each position
        for t in [t for t in range(len(out) - 1) if 1 <= ranks[-1][t] <= SIDE_MAX]:
            kept[0] += 1
            kept[1] += ranks[-1][t + 1] == 0  # the leaf's own child is the target's next
            y = mx.array(ids + out[:t] + [best[t]], dtype=mx.uint32)[None]  # the chain's path
            kept[2] += mx.argmax(drf.model(y)[0, -1, :shared]).item() == out[t + 1]

prefixes: Counter = Counter()
starts = 0
for r in ranks:
    for t in range(len(r)):
        starts += 1
        for d in range(1, a.depth + 1):
            if t + d <= len(r):
                prefixes[tuple(r[t : t + d])] += 1


def tokens_per_pass(tree: set) -> float:
    """1 + expected accepted depth: each path in the tree counts where it is R's prefix."""
    return 1 + sum(prefixes[p] for p in tree) / starts


def side_path(p: tuple) -> bool:
    return all(x == 0 for x in p[:-1]) and 1 <= p[-1] <= SIDE_MAX


def leaf_child_path(p: tuple) -> bool:
    """A side leaf's path, or one of its children's (one level of EAGLE-2's expansion past
    the side leaves: zeros, then a rank s, then any rank r)."""
    return side_path(p) or (len(p) >= 2 and side_path(p[:-1]) and p[-1] <= SIDE_MAX)


chain = {(0,) * d for d in range(1, a.depth + 1)}
ordered = [p for p, _ in prefixes.most_common()]
top = Counter(x for r in ranks for x in r)
n = sum(top.values())
print(f"{a.target} <- {a.draft}: {len(ranks)} code prompts x {a.n} greedy tokens, {starts} starts")
print("rank of the target's token among the draft's guesses: "
      + ", ".join(f"{s}: {top[s] / n:.0%}" for s in range(6))
      + f", 6+: {sum(v for s, v in top.items() if s >= 6) / n:.0%}")  # fmt: skip
c = tokens_per_pass(chain)
print(f"chain of {a.depth}: {c:.3f} tokens/pass")
for nodes in (int(x) for x in a.nodes.split(",")):
    sides = chain | set([p for p in ordered if side_path(p)][: nodes - a.depth])
    children = chain | set([p for p in ordered if leaf_child_path(p)][: nodes - a.depth])
    best = set(ordered[:nodes])
    for name, tree in (
        (f"chain + side leaves (<= {SIDE_MAX} a depth)", sides),
        ("chain + side leaves + their children", children),
        ("best tree", best),
    ):
        tpp = tokens_per_pass(tree)
        shown = sorted(tree, key=lambda p: (len(p), p))
        print(f"{nodes} nodes, {name}: {tpp:.3f} tokens/pass, {tpp / c:.2f}x the chain"
              + (f"; paths: {shown}" if nodes <= 8 else ""))  # fmt: skip
if a.followers:
    print(
        f"side leaves holding the target's token: {kept[0]}; the token after it is the "
        f"leaf's own child {kept[1] / max(kept[0], 1):.0%} of the time, the chain's next "
        f"{kept[2] / max(kept[0], 1):.0%}"
    )
