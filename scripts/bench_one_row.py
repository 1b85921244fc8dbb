"""A batch of one against the serial path (issue 38's 1-client target): three prompts of the
built-in set, 64 tokens each, greedy, twice over, alternating: the session (as the serial
server runs a request) and decoding/batch.Batch with one row, both at a fixed k = 3 (the
per-round cost alone), then both with their own auto-k choosers (AdaptiveK fresh; BatchK).

  . scripts/env.sh && .venv/bin/python scripts/bench_one_row.py
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_batch import (  # noqa: E402
    BatchK,
    ChooserStore,
    Pair,
    SamplingParams,
    Session,
    encode_prompt,
    load_pair,
    read_jsonl,
)

from specmlx.decoding.batch import Batch  # noqa: E402
from specmlx.decoding.request import Decode  # noqa: E402
from specmlx.decoding.session import Request  # noqa: E402
from specmlx.drafting.choosing.choosers import AUTO, K  # noqa: E402
from specmlx.machine import blas_in_use  # noqa: E402

tgt, drf, shared = load_pair("cpu-demo-target", "cpu-demo-draft")
pair = Pair.of(tgt, drf, shared)
texts = [p["prompt"] if isinstance(p, dict) else p
         for _, p in read_jsonl(None, "prompts.jsonl", "prompts")]  # fmt: skip
ids = [encode_prompt(tgt.tokenizer, t) for t in texts][:3]
store = ChooserStore(persist=False)
session = Session(Pair(pair.target, pair.draft, None, "t", "d", shared), choosers=store)
greedy = SamplingParams(0.0)


def serial(k, p, n=64):
    t0 = time.perf_counter()
    gen = session.start(Request(p, greedy, k=k, max_tokens=n, seed=1))
    out = [e.token for e in gen.tokens()]
    gen.finish()
    return time.perf_counter() - t0, out


def one_row(k, p, n=64, chooser=None):
    t0 = time.perf_counter()
    batch = Batch(pair.target, pair.draft, pair.shared)
    row = batch.join(p, Decode(greedy, K(k) if chooser is None else AUTO, n, seed=1))
    out = []
    while batch.rows:
        kk = k if chooser is None else chooser(1)
        r0 = time.perf_counter()
        events = batch.round(kk)
        out += [e.token for e in events[0]]
        if chooser is not None:
            chooser.observe(1, kk, len(events[0]), time.perf_counter() - r0)
        if row.done:
            batch.leave(row)
    return time.perf_counter() - t0, out


serial(K(3), ids[0], 16)
one_row(3, ids[0], 16)  # warm-up: compile paths, fault the weights in
chooser, results, same = BatchK(), {}, True
for _ in range(2):
    for p in ids:
        runs = {
            "serial, k 3": lambda p=p: serial(K(3), p),
            "batch of one, k 3": lambda p=p: one_row(3, p),
            "serial, auto (AdaptiveK)": lambda p=p: serial(AUTO, p),
            "batch of one, auto (BatchK)": lambda p=p: one_row(3, p, chooser=chooser),
        }
        outs = []
        for name, run in runs.items():
            seconds, out = run()
            results.setdefault(name, []).append((seconds, len(out)))
            outs.append(out)
        same = same and all(o == outs[0] for o in outs)
print(f"BLAS: {blas_in_use() or 'none found'}; every run's tokens equal: {same}")
for name, v in results.items():
    print(f"{name}: {sum(n for _, n in v) / sum(s for s, _ in v):.2f} tok/s")
