"""Batched speculation against serial speculation, batched plain decoding and mlx-lm's own
batching, side by side in one process (issue 38): B requests arriving together, for B in
1, 2, 4, 8, greedy and T = 0.8.

  . scripts/env.sh && .venv/bin/python scripts/bench_batch.py [--target T --draft D -n 64]

Rows, each over the same B prompts (the built-in prompt set's first B):
- serial: today's one-at-a-time server: each request through the session (adaptive k, its
  state kept across requests as the server keeps it), one after another;
- batch spec: decoding/batch.Batch with serving/batcher.BatchK choosing k per round (one
  per temperature, kept across the runs as the server keeps it);
- batch k=0: the same batch, no drafts (batched plain decoding);
- mlx-lm: mlx_lm.generate.batch_generate (its BatchGenerator; no draft: mlx-lm batches only
  without one), greedy only.
Aggregate tok/s is all requests' tokens over the wall time from the first request to the
last token; a request's latency is from the start until its last token. Greedy rows also say
whether every request's tokens equal its serial run's.
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
from mlx_lm.generate import batch_generate  # noqa: E402

from specmlx.bench.data import read_jsonl  # noqa: E402
from specmlx.core.sampling import SamplingParams  # noqa: E402
from specmlx.decoding.batch import Batch  # noqa: E402
from specmlx.decoding.request import Decode  # noqa: E402
from specmlx.decoding.session import Pair, Request, Session  # noqa: E402
from specmlx.decoding.stream import encode_prompt  # noqa: E402
from specmlx.drafting.choosing.choosers import AUTO, ChooserStore, K  # noqa: E402
from specmlx.machine import blas_in_use  # noqa: E402
from specmlx.models.loading import load_pair  # noqa: E402
from specmlx.serving.batch_k import BatchK  # noqa: E402


def serial(session, prompts, sampling, n, seed):
    t0, ends, outs = time.perf_counter(), [], []
    for i, ids in enumerate(prompts):
        req = Request(ids, sampling, k=AUTO, max_tokens=n, seed=seed + i)
        gen = session.start(req)
        outs.append([e.token for e in gen.tokens()])
        gen.finish()
        ends.append(time.perf_counter() - t0)
    return outs, ends


def batched(pair, prompts, sampling, n, seed, chooser):
    t0 = time.perf_counter()
    batch = Batch(pair.target, pair.draft, pair.shared)
    rows = [batch.join(ids, Decode(sampling, K(0) if chooser is None else AUTO, n, seed=seed + i))
            for i, ids in enumerate(prompts)]  # fmt: skip
    outs, ends = {id(r): [] for r in rows}, {}
    while batch.rows:
        live = len(batch.rows)
        k = chooser(live) if chooser is not None else 0
        r0 = time.perf_counter()
        events = batch.round(k)
        made = 0
        for r, evs in zip(list(batch.rows), events, strict=True):
            outs[id(r)] += [e.token for e in evs]
            made += len(evs)
        if chooser is not None:
            chooser.observe(live, k, made, time.perf_counter() - r0)
        for r in [r for r in batch.rows if r.done]:
            batch.leave(r)
            ends[id(r)] = time.perf_counter() - t0
    return [outs[id(r)] for r in rows], [ends[id(r)] for r in rows]


def mlx_lm_rows(pair, prompts, n):
    t0 = time.perf_counter()
    got = batch_generate(pair.target, pair.tokenizer, prompts, max_tokens=n, return_token_ids=True)
    wall = time.perf_counter() - t0
    toks = getattr(got, "token_ids", None) or [[0] * n for _ in prompts]
    return [list(t) for t in toks], [wall] * len(prompts)


def row(name, outs, ends):
    tokens = sum(len(o) for o in outs)
    wall = max(ends)
    lat = sorted(ends)
    p95 = lat[min(len(lat) - 1, round(0.95 * (len(lat) - 1)))]
    return {"system": name, "tok_s": tokens / wall, "p50_s": statistics.median(lat), "p95_s": p95,
            "tokens": tokens}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="cpu-demo-target")
    ap.add_argument("--draft", default="cpu-demo-draft")
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--json", dest="json_out")
    a = ap.parse_args()
    tgt, drf, shared = load_pair(a.target, a.draft)
    pair = Pair.of(tgt, drf, shared)
    texts = [p for _, p in read_jsonl(None, "prompts.jsonl", "prompts")]
    texts = [t["prompt"] if isinstance(t, dict) else t for t in texts]
    all_ids = [encode_prompt(tgt.tokenizer, t) for t in texts]
    store = ChooserStore(persist=False)
    session = Session(Pair(pair.target, pair.draft, None, "t", "d", shared), choosers=store)
    results = []
    for temp in (0.0, 0.8):
        sampling = SamplingParams(temp, 0.95 if temp else 1.0)
        # warm-up: compile paths, fault in weights, let both adaptive choosers learn; each
        # then lives across the B runs, as a server keeps its own
        chooser = BatchK()
        serial(session, all_ids[:2], sampling, 32, 0)
        batched(pair, all_ids[:2], sampling, 32, 0, chooser)
        for b in [int(x) for x in a.batches.split(",")]:
            prompts = all_ids[:b]
            ref, ends = serial(session, prompts, sampling, a.n, 100)
            rows = [row("serial (today's server)", ref, ends)]
            for name, k_of in (("batch spec", chooser), ("batch k=0", None)):
                outs, ends = batched(pair, prompts, sampling, a.n, 100, k_of)
                rows.append(row(name, outs, ends))
                rows[-1]["same"] = outs == ref if temp == 0 else None
            if temp == 0:
                outs, ends = mlx_lm_rows(pair, prompts, a.n)
                rows.append(row("mlx-lm batch_generate (no draft)", outs, ends))
            base = rows[0]["tok_s"]
            for r in rows:
                r.update(B=b, T=temp, vs_serial=r["tok_s"] / base)
                print(json.dumps(r), flush=True)
            results += rows
    info = {"blas": blas_in_use(), "mlx": mx.__version__, "device": str(mx.default_device())}
    print(json.dumps(info))
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({"rows": results, "env": info}, indent=1))


if __name__ == "__main__":
    main()
