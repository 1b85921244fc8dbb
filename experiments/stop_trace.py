"""Draft traces for studying per-token stopping offline (issue 14, part 2).

Greedy: the output is fixed, and so is what the draft proposes from any point of it: at each
output position i, draft K tokens from prompt + out[:i] and record the draft's confidence in
each and how many of them the target's output confirms (n).

Sampled (--temp > 0): along one sampled target output, at each position i the draft samples
K tokens from q, the target scores them in one pass, and the trace records each draft's
confidence q(x_j) and its token-wise acceptance probability alpha_j = min(1, p(x_j) / q(x_j))
(given drafts 1..j-1 accepted), and two other confidences: q's top probability and sum q^2. The replay draws the outcomes (experiments/stop_sim.py --draws).

Any stopping rule can then be replayed on the trace without timing noise:

    .venv/bin/python experiments/stop_trace.py experiments/sets/code6.jsonl -n 64 -o bench-out/trace.json
    .venv/bin/python experiments/stop_trace.py experiments/sets/code6.jsonl -n 64 --temp 0.8 \
        --top-p 0.95 -o bench-out/trace-t08.json
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from specmlx.core.sampling import SamplingParams, make_processor
from specmlx.decoding.engine import Decode, generate_tokens
from specmlx.drafting.drafters import draft_model_propose
from specmlx.models.loading import load_model
from specmlx.models.registry import load_registry


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("prompts")
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("-K", type=int, default=12, help="drafts per position")
    ap.add_argument("--temp", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target", default="cpu-demo-target")
    ap.add_argument("--draft", default="cpu-demo-draft")
    ap.add_argument("-o", "--out", required=True)
    a = ap.parse_args()
    reg = load_registry()
    target, draft = load_model(reg.resolve(a.target)), load_model(reg.resolve(a.draft))
    vocab = min(target.vocab_size, draft.vocab_size)
    params = SamplingParams(a.temp, top_p=a.top_p)
    process = None if params.greedy else make_processor(params)
    key = mx.random.key(a.seed)
    rows = []
    for line in open(a.prompts):
        row = json.loads(line)
        prompt = target.tokenizer.encode(row["prompt"])
        gen = generate_tokens(
            target.model, None, prompt, Decode(sampling=params, max_tokens=a.n, seed=a.seed)
        )
        out = [e.token for e in gen]
        cache = make_prompt_cache(draft.model)
        draft.model(mx.array(prompt[:-1], dtype=mx.uint32)[None], cache=cache)
        tcache = make_prompt_cache(target.model)
        if process is not None:
            target.model(mx.array(prompt[:-1], dtype=mx.uint32)[None], cache=tcache)
        pending, steps = [prompt[-1]], []
        for i in range(len(out)):
            x = mx.array(pending, dtype=mx.uint32)[None]
            key, sub = mx.random.split(key)
            d, q, conf = draft_model_propose(
                lambda x, cache=cache: draft.model(x, cache=cache), x, a.K, vocab, process, sub
            )
            trim_prompt_cache(cache, a.K - 1)  # keep prompt + out[:i]
            step = {"conf": [round(c, 5) for c in conf[0].tolist()], "left": len(out) - i}
            if process is None:
                d, truth, n = d[0].tolist(), out[i : i + a.K], 0
                while n < len(truth) and d[n] == truth[n]:
                    n += 1
                step["n"] = n
            else:  # the target's p of each draft, given the drafts before it: one pass
                fed = mx.concatenate([x[:, -1:], d[:, :-1]], axis=1)  # (1, K)
                p = process(target.model(fed, cache=tcache)[0, :, :vocab])  # (K, vocab)
                pd = mx.take_along_axis(p, d[0][:, None].astype(mx.int32), axis=-1)[:, 0]
                alpha = mx.minimum(1.0, pd / mx.maximum(conf[0], 1e-12))
                trim_prompt_cache(tcache, a.K - 1)  # keep prompt + out[:i]
                step["alpha"] = [round(v, 5) for v in alpha.tolist()]
                # other confidences a rule could read: q's top and sum q^2 (two draws agree)
                step["top"] = [round(v, 5) for v in q[0].max(axis=-1).tolist()]
                step["agree"] = [round(v, 5) for v in (q[0] * q[0]).sum(axis=-1).tolist()]
            steps.append(step)
            pending = [out[i]]
        rows.append({"id": row["id"], "steps": steps})
        score = [s.get("n", s.get("alpha", [0])[0]) for s in steps]
        print(row["id"], sum(score) / len(steps), flush=True)
    with open(a.out, "w") as f:
        meta = {"target": a.target, "draft": a.draft, "K": a.K, "temp": a.temp, "top_p": a.top_p}
        json.dump({**meta, "prompts": rows}, f)


if __name__ == "__main__":
    main()
