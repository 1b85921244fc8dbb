"""Self-drafting (issue 47) on a real model: for an exit at each quarter of the depth, a
skip list and auto, greedy, on the built-in code prompts: acceptance by depth, tokens per
target pass, the draft step's cost against a target step, decode tok/s against target-only
(and against the model's draft model, where its pair has one), and peak memory. Every
configuration runs once per prompt, target-only interleaved before each, in one process.

  . scripts/env.sh && .venv/bin/python experiments/bench_self.py smollm2-135m [--draft ALIAS]
      [--prompts 4] [-n 96] [-k 4] [--only "self (auto"]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402

from specmlx.bench.data import read_jsonl  # noqa: E402
from specmlx.core.kvstate import KVState  # noqa: E402
from specmlx.core.stats import Stats  # noqa: E402
from specmlx.decoding.decode import Decode, Parts  # noqa: E402
from specmlx.decoding.engine import generate_tokens  # noqa: E402
from specmlx.drafting.choosing.choosers import AUTO, K  # noqa: E402
from specmlx.drafting.self_draft import EXIT_FRACTIONS, SelfDraft, SelfSpec, shares_caches  # noqa: E402
from specmlx.machine import blas_in_use  # noqa: E402
from specmlx.models.loading import kept_exit, load_model, load_pair  # noqa: E402
from specmlx.models.registry import load_registry  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("target")
ap.add_argument("--draft", default=None, help="a draft model alias to compare with")
ap.add_argument("--prompts", type=int, default=4)
ap.add_argument("-n", type=int, default=96)
ap.add_argument("-k", type=int, default=4)
ap.add_argument("--only", default=None, help="run the configurations whose name starts so")
a = ap.parse_args()

if a.draft:
    tgt, drf, shared_ids = load_pair(a.target, a.draft)
else:
    tgt, drf, shared_ids = load_model(load_registry().resolve(a.target)), None, None
target, tok = tgt.model, tgt.tokenizer
depth = SelfDraft(target, SelfSpec(exit=1)).depth
prompts = [r["prompt"] for _, r in read_jsonl(None, "prompts.jsonl", "prompts")
           if r.get("kind") == "code"][: a.prompts]  # fmt: skip
ids = [tok.encode(p) for p in prompts]

exits = sorted({max(1, min(depth - 1, round(depth * f))) for f in EXIT_FRACTIONS})
auto = kept_exit(tgt)
configs = [(f"self:exit={e}", SelfDraft(target, SelfSpec(exit=e)), a.k) for e in exits]
configs.append((f"self:skip={depth // 2}-{depth - 2}", SelfDraft(target, SelfSpec(
    skip=tuple(range(depth // 2, depth - 1)))), a.k))  # fmt: skip
configs.append((f"self (auto: exit={auto.exit}), -k auto", SelfDraft(target, auto), AUTO))
# the same exit without auto's measured agreement: the chooser starts from its own prior
configs.append((f"self (auto: exit={auto.exit}, no prior), -k auto",
                SelfDraft(target, SelfSpec(exit=auto.exit)), AUTO))  # fmt: skip
if drf is not None:
    configs.append((f"{a.draft}, -k {a.k}", drf.model, a.k))
    configs.append((f"{a.draft}, -k auto", drf.model, AUTO))
if a.only:
    configs = [c for c in configs if c[0].startswith(a.only)]


def run(draft, k, p):
    stats = Stats()
    mx.reset_peak_memory()
    decode = Decode(k=K.of(k) if draft is not None else K(0), max_tokens=a.n)
    parts = Parts(kv=KVState(), stats=stats, vocab_size=shared_ids)
    t0 = time.perf_counter()
    out = [e.token for e in generate_tokens(target, draft, p, decode, parts)]
    return out, stats, time.perf_counter() - t0, mx.get_peak_memory()


run(None, 0, ids[0])  # warm-up
rows = []
for name, draft, k in configs:
    base_tps, tps, mem_ratio, same = [], [], [], True
    stats_all = []
    for p in ids:
        ref, s0, _, m0 = run(None, 0, p)
        out, s1, _, m1 = run(draft, k, p)
        same &= out == ref
        base_tps.append(s0.decode_tps)
        tps.append(s1.decode_tps)
        mem_ratio.append(m1 / m0)
        stats_all.append(s1)
    tried = [sum(col) for col in zip(*[s.depth_tried + [0] * 8 for s in stats_all], strict=False)]
    acc = [sum(col) for col in zip(*[s.depth_accepted + [0] * 8 for s in stats_all], strict=False)]
    by_depth = " ".join(f"{x / t:.0%}" for x, t in zip(acc, tried, strict=True) if t)[:40]
    drafted = sum(s.drafted for s in stats_all)
    passes = sum(s.rounds for s in stats_all)
    gen = sum(s.generated for s in stats_all)
    timed = sum(s.timed_drafted for s in stats_all)
    step = sum(s.timed_draft_s for s in stats_all) / timed if timed else float("nan")
    target_step = 1 / statistics.median(base_tps)
    share = "shared" if isinstance(draft, SelfDraft) and shares_caches(draft) else "own"
    rows.append(
        f"| {name} | {share} | {by_depth or '-'} | {gen / passes:.2f} | "
        f"{drafted / passes:.2f} | {step / target_step:.2f} | "
        f"{statistics.median(tps) / statistics.median(base_tps):.2f}x | "
        f"{max(mem_ratio):.2f} | {'yes' if same else 'NO'} |"
    )
    print(rows[-1], flush=True)

print()
print(f"{a.target} ({depth} layers), {len(ids)} code prompts, -n {a.n}, greedy, "
      f"BLAS {blas_in_use()}")  # fmt: skip
print("| draft | its KV | accepted by depth | tokens/pass | drafts/pass | draft step / target "
      "step | tok/s vs target-only | peak memory vs target-only | output identical |")  # fmt: skip
print("|---|---|---|---|---|---|---|---|---|")
for r in rows:
    print(r)
