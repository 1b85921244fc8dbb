"""Greedy draft traces for studying per-token stopping offline (issue 14, part 2).

Under greedy decoding the output is fixed, and so is what the draft proposes from any point of
it: at each output position i, draft K tokens from prompt + out[:i] and record the draft's
confidence in each and how many of them the target's output confirms. Any stopping rule can
then be replayed on the trace without timing noise (scripts/stop_sim.py).

    .venv/bin/python scripts/stop_trace.py scripts/sets/code6.jsonl -n 64 -o bench-out/trace.json
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from specmlx.drafters import draft_model_propose
from specmlx.engine import generate_tokens
from specmlx.loading import load_model
from specmlx.registry import load_registry


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("prompts")
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("-K", type=int, default=12, help="drafts per position")
    ap.add_argument("--target", default="cpu-demo-target")
    ap.add_argument("--draft", default="cpu-demo-draft")
    ap.add_argument("-o", "--out", required=True)
    a = ap.parse_args()
    reg = load_registry()
    target, draft = load_model(reg.resolve(a.target)), load_model(reg.resolve(a.draft))
    vocab = min(target.vocab_size, draft.vocab_size)
    rows = []
    for line in open(a.prompts):
        row = json.loads(line)
        prompt = target.tokenizer.encode(row["prompt"])
        out = [e.token for e in generate_tokens(target.model, None, prompt, max_tokens=a.n)]
        cache = make_prompt_cache(draft.model)
        draft.model(mx.array(prompt[:-1], dtype=mx.uint32)[None], cache=cache)
        pending, steps = [prompt[-1]], []
        for i in range(len(out)):
            x = mx.array(pending, dtype=mx.uint32)[None]
            d, _, conf = draft_model_propose(
                draft.model, cache, x, a.K, vocab, None, mx.random.key(0)
            )
            d, conf = d[0].tolist(), conf[0].tolist()
            trim_prompt_cache(cache, a.K - 1)  # keep prompt + out[:i]
            truth = out[i : i + a.K]
            n = 0
            while n < len(truth) and d[n] == truth[n]:
                n += 1
            steps.append({"conf": [round(c, 5) for c in conf], "n": n, "left": len(out) - i})
            pending = [out[i]]
        rows.append({"id": row["id"], "steps": steps})
        print(row["id"], sum(s["n"] for s in steps) / len(steps), flush=True)
    with open(a.out, "w") as f:
        json.dump({"target": a.target, "draft": a.draft, "K": a.K, "prompts": rows}, f)


if __name__ == "__main__":
    main()
