"""Does self-drafting's auto need to choose its exit per prompt? (issue 47, BENCHMARKS.md
"Self-drafting".) Auto chooses once per model, on a fixed passage (self_draft.choose_exit,
PROBE_TEXT). For each built-in prompt this measures every quarter exit's greedy agreement with
the target over the prompt's own tokens (the tail, up to 256), scores it as choose_exit does,
and reports how often the prompt's own best exit is the passage's, and what the passage's exit
keeps of the best value where it is not.

  . scripts/env.sh && .venv/bin/python experiments/bench_exit_choice.py smollm2-135m [--prompts 12]
"""

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402

from specmlx.bench.data import read_jsonl  # noqa: E402
from specmlx.drafting.self_draft import (  # noqa: E402
    EXIT_FRACTIONS,
    PROBE_TEXT,
    SelfDraft,
    SelfSpec,
    layer_list,
)
from specmlx.models.loading import load_model  # noqa: E402
from specmlx.models.registry import load_registry  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("target")
ap.add_argument("--prompts", type=int, default=12, help="code and edit prompts, alternately")
a = ap.parse_args()

loaded = load_model(load_registry().resolve(a.target))
target, tok = loaded.model, loaded.tokenizer
depth = len(layer_list(target))
exits = [max(1, min(depth - 1, round(depth * f))) for f in EXIT_FRACTIONS]
drafts = {e: SelfDraft(target, SelfSpec(exit=e)) for e in exits}


def values(ids: list[int]) -> dict[int, tuple[float, float]]:
    """Per exit: (agreement, choose_exit's value) over ids' tail."""
    x = mx.array(ids[-256:], dtype=mx.uint32)[None]
    want = mx.argmax(target(x), axis=-1)
    out = {}
    for e, d in drafts.items():
        agree = min((mx.argmax(d(x), axis=-1) == want).astype(mx.float32).mean().item(), 0.99)
        value = max((1 - agree ** (k + 1)) / (1 - agree) / (1 + k * e / depth) for k in range(1, 9))
        out[e] = (agree, value)
    return out


rows = [r for _, r in read_jsonl(None, "prompts.jsonl", "prompts")]
code = [r for r in rows if r.get("kind") == "code"]
edit = [r for r in rows if r.get("kind") == "edit"]
mixed = [r for pair in zip(code, edit, strict=False) for r in pair] + code[len(edit) :]
chosen = values(tok.encode(PROBE_TEXT))
fixed = max(chosen, key=lambda e: chosen[e][1])
same, kept, agree = 0, [], {e: [] for e in exits}
for r in mixed[: a.prompts]:
    v = values(tok.encode(r["prompt"]))
    best = max(v, key=lambda e: v[e][1])
    same += best == fixed
    kept.append(v[fixed][1] / v[best][1])
    for e in exits:
        agree[e].append(v[e][0])
n = min(a.prompts, len(mixed))
print(f"{a.target} ({depth} layers), exits {exits}; the passage's agreement: "
      + ", ".join(f"{e}: {chosen[e][0]:.0%}" for e in exits) + f"; its choice: exit {fixed}")  # fmt: skip
print("prompts' agreement, median (range): "
      + ", ".join(f"{e}: {statistics.median(agree[e]):.0%} ({min(agree[e]):.0%}-{max(agree[e]):.0%})"
                  for e in exits))  # fmt: skip
print(f"the prompt's own best exit is the passage's on {same} of {n} prompts; the passage's "
      f"exit keeps {min(kept):.0%}-{max(kept):.0%} of the best value (median {statistics.median(kept):.0%})")  # fmt: skip
