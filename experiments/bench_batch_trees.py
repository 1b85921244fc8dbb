"""Trees in a batch against chains in a batch, side by side in one process (issue 46): B
requests decoding together (the built-in code prompts' first B), greedy, k fixed, each
request its own tree a round (`--tree 8`), the batch's sizer choosing (`auto`, from the
target's probed pass-cost curve) or each request growing EAGLE-2's tree (`expand:8`, with
``--settings off,8,expand:8``), against the same batch verifying chains (`off`).

  . scripts/env.sh && .venv/bin/python experiments/bench_batch_trees.py \
      [--target T --draft D -n 48 -k 3 --batches 1,2,4 --repeats 2 --settings off,8,auto]

Per (B, setting): tokens per target pass per request, aggregate tok/s, and both as ratios
to the chain's in the same repeat (the settings alternate within each repeat, their order
turning from one repeat to the next, each warmed up at each width first, so a slow spell of
the machine falls on all of them); and whether every request's tokens equal the chain's
(greedy: they must).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402

from specmlx.bench.data import read_jsonl  # noqa: E402
from specmlx.decoding.batch import Batch  # noqa: E402
from specmlx.decoding.decode import Decode  # noqa: E402
from specmlx.decoding.stream import encode_prompt  # noqa: E402
from specmlx.drafting.choosing.choosers import ChooserStore, K  # noqa: E402
from specmlx.drafting.choosing.tree_size import TreeSize  # noqa: E402
from specmlx.machine import blas_in_use  # noqa: E402
from specmlx.models.loading import load_pair  # noqa: E402


def run(tgt, drf, shared, ratio, prompts, k: int, n: int, tree) -> dict:
    """One batch of ``prompts`` to the end: tokens, passes, seconds, outputs, tree passes."""
    batch = Batch(tgt.model, drf.model, shared, ratio)
    rows = [
        batch.join(ids, Decode(k=K(k), max_tokens=n, tree=TreeSize.of(tree))) for ids in prompts
    ]
    t0, passes, trees = time.perf_counter(), 0, 0
    while batch.rows:
        batch.round(k)
        passes, trees = passes + 1, trees + batch.tree_pass
        for r in [r for r in batch.rows if r.done]:
            batch.leave(r)
    seconds = time.perf_counter() - t0
    tokens = sum(r.stats.generated for r in rows)
    per_row = statistics.mean(r.stats.generated / max(r.stats.rounds, 1) for r in rows)
    outs = [r.ctx[len(p) :] for r, p in zip(rows, prompts, strict=True)]
    return {"tok_s": tokens / seconds, "tok_pass": per_row, "passes": passes,
            "tree_passes": trees, "outs": outs}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="cpu-demo-target")
    ap.add_argument("--draft", default="cpu-distilled-draft")
    ap.add_argument("-n", type=int, default=48)
    ap.add_argument("-k", type=int, default=3)
    ap.add_argument("--batches", default="1,2,4")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--settings", default="off,8,auto", help="--tree settings, off first")
    a = ap.parse_args()
    settings = a.settings.split(",")
    if settings[0] != "off":
        ap.error("--settings must start with off (the chain every ratio is to)")
    tgt, drf, shared = load_pair(a.target, a.draft)
    texts = [r["prompt"] for _, r in read_jsonl(None, "prompts.jsonl", "prompts")
             if r.get("kind") == "code"]  # fmt: skip
    ids = [encode_prompt(tgt.tokenizer, t) for t in texts]
    # the curve auto reads: the target's probe, as the server's batch reads it
    ratio = ChooserStore().probe(tgt.model, tgt.identity, ids[0])
    for b in [int(x) for x in a.batches.split(",")]:
        for s in settings:  # warm-up at this width: fault in weights, first shapes
            run(tgt, drf, shared, ratio, ids[:b], a.k, 8, s)
        got: dict = {s: [] for s in settings}
        for rep in range(a.repeats):  # the order turns each repeat: no setting always first
            turn = rep % len(settings)
            for s in settings[turn:] + settings[:turn]:
                got[s].append(run(tgt, drf, shared, ratio, ids[:b], a.k, a.n, s))
        chain = got["off"]
        for s in settings:
            runs = got[s]
            print(json.dumps({
                "B": b, "k": a.k, "tree": s,
                "tok_pass": round(statistics.mean(r["tok_pass"] for r in runs), 3),
                "tok_s": round(statistics.mean(r["tok_s"] for r in runs), 2),
                "tok_pass_vs_chain": round(statistics.mean(
                    r["tok_pass"] / c["tok_pass"] for r, c in zip(runs, chain, strict=True)), 3),
                "tok_s_vs_chain": round(statistics.mean(
                    r["tok_s"] / c["tok_s"] for r, c in zip(runs, chain, strict=True)), 3),
                "tree_passes": f"{sum(r['tree_passes'] for r in runs)}/"
                               f"{sum(r['passes'] for r in runs)}",
                "same": all(r["outs"] == c["outs"] for r, c in zip(runs, chain, strict=True)),
            }), flush=True)  # fmt: skip
    print(json.dumps({"blas": blas_in_use(), "mlx": mx.__version__,
                      "device": str(mx.default_device())}))  # fmt: skip


if __name__ == "__main__":
    main()
