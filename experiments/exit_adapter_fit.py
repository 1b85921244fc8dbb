"""How far could a trained exit adapter lift an early exit's agreement? (issue 47, BENCHMARKS.md
"Self-drafting".) The issue's optional adapter is a norm and a projection on layer E's hidden
states (as in Kangaroo), read by the target's LM head. This fits that adapter in closed form
(ridge least squares from rmsnorm(h_E) to the target's final normed hidden state) over
teacher-forced passes through Python source files, then measures on the built-in prompts
(held out: other text) how often the adapter's argmax is the target's, beside the untrained
exit's. A least-squares fit is not a KL-trained adapter: read it as an estimate of what the
adapter's shape can reach, not a bound.

  . scripts/env.sh && .venv/bin/python experiments/exit_adapter_fit.py smollm2-135m [--tokens 60000]
"""

import argparse
import glob
import statistics
import sys
import sysconfig
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from specmlx.bench.data import read_jsonl  # noqa: E402
from specmlx.drafting.self_draft import EXIT_FRACTIONS, layer_list  # noqa: E402
from specmlx.models.loading import load_model  # noqa: E402
from specmlx.models.registry import load_registry  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("target", help="a llama-layout model (its .model.layers, .norm, tied or lm_head)")
ap.add_argument("--tokens", type=int, default=60_000, help="training tokens (Python sources)")
ap.add_argument("--window", type=int, default=512, help="tokens a teacher-forced pass")
ap.add_argument("--ridge", type=float, default=1e-2)
a = ap.parse_args()

loaded = load_model(load_registry().resolve(a.target))
target, tok = loaded.model, loaded.tokenizer
inner = target.model
depth = len(layer_list(target))
exits = sorted({max(1, min(depth - 1, round(depth * f))) for f in EXIT_FRACTIONS})


def head(y: mx.array) -> mx.array:
    """The target's LM head over normed hidden states (..., F)."""
    if getattr(target, "lm_head", None) is not None:
        return target.lm_head(y)
    return inner.embed_tokens.as_linear(y)


def rms(h: mx.array) -> mx.array:
    return h * mx.rsqrt(mx.mean(h * h, axis=-1, keepdims=True) + 1e-6)


def hiddens(ids: list[int]) -> tuple[dict[int, np.ndarray], np.ndarray, np.ndarray]:
    """Per exit rmsnorm(h_E) (T, F), the final normed hidden (T, F) and the target's argmax
    (T,), teacher-forced over ids in one pass."""
    x = mx.array(ids, dtype=mx.uint32)[None]
    h = inner.embed_tokens(x)
    out = {}
    for i, layer in enumerate(inner.layers):
        h = layer(h, "causal", None)
        if i + 1 in exits:
            out[i + 1] = rms(h)[0]
    final = inner.norm(h)[0]
    want = mx.argmax(head(final), axis=-1)
    mx.eval(final, want, *out.values())
    conv = {e: np.array(v, dtype=np.float64) for e, v in out.items()}
    return conv, np.array(final, dtype=np.float64), np.array(want)


# training text: the Python standard library's sources, in a fixed order
files = sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "*.py")))
F = inner.norm.weight.shape[0]
xtx = {e: np.zeros((F + 1, F + 1)) for e in exits}
xty = {e: np.zeros((F + 1, F)) for e in exits}
seen = 0
for f in files:
    ids = tok.encode(Path(f).read_text(errors="replace"))
    for s in range(0, len(ids) - 1, a.window):
        chunk = ids[s : s + a.window]
        if len(chunk) < 32:
            continue
        hs, y, _ = hiddens(chunk)
        for e in exits:
            x = np.concatenate([hs[e], np.ones((len(chunk), 1))], axis=1)
            xtx[e] += x.T @ x
            xty[e] += x.T @ y
        seen += len(chunk)
        if seen >= a.tokens:
            break
    if seen >= a.tokens:
        break
W = {e: np.linalg.solve(xtx[e] + a.ridge * seen / F * np.eye(F + 1), xty[e]) for e in exits}

# held out: the built-in prompts (code and edits), each its own pass
plain = {e: [] for e in exits}
fitted = {e: [] for e in exits}
tested = 0
for _, r in read_jsonl(None, "prompts.jsonl", "prompts"):
    ids = tok.encode(r["prompt"])[-a.window :]
    hs, _, want = hiddens(ids)
    tested += len(ids)
    for e in exits:
        x = mx.array(hs[e], dtype=mx.float32)
        untrained = mx.argmax(head(inner.norm(x)), axis=-1)  # the norm ignores h's scale
        xb = np.concatenate([hs[e], np.ones((len(ids), 1))], axis=1)
        adapted = mx.argmax(head(mx.array(xb @ W[e], dtype=mx.float32)), axis=-1)
        plain[e].append(float(np.mean(np.array(untrained) == want)))
        fitted[e].append(float(np.mean(np.array(adapted) == want)))
print(f"{a.target} ({depth} layers): adapter fitted on {seen} tokens of Python sources "
      f"({len(files)} files available), tested on {tested} prompt tokens")  # fmt: skip
for e in exits:
    print(f"exit {e:>2}: agreement untrained {statistics.mean(plain[e]):.0%}, "
          f"with the fitted adapter {statistics.mean(fitted[e]):.0%} "
          f"(per prompt {min(fitted[e]):.0%}-{max(fitted[e]):.0%})")  # fmt: skip
