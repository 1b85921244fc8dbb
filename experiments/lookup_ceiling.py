"""What any copying drafter could keep on the agent-style trace, under greedy decoding
(issue 48, BENCHMARKS.md "Suffix lookup and lookahead").

The trace is the bench's: the editing sequences, each request rewriting the file the request
before it wrote (`specmlx bench --set edit-sequence`). Greedy, the target writes the same
tokens whatever is drafted, so its outputs are generated once, target alone, and each round is
then replayed from the known future. A copying drafter (n-gram lookup, suffix lookup, a
memory of past outputs: anything that proposes continuations of earlier occurrences of the
context's tail) keeps at most, from position i, the longest L <= cap such that the last
confirmed token and the next L target tokens occur, in that order, in text it has seen: the
prompt and the output so far, and, with memory, every earlier output of the trace. The round
keeps L + 1 tokens. That bound (every occurrence of a one-token tail at once: a tree as wide as
it needs) is an upper bound on tokens per pass for any lookup anchored by its last token,
whatever it scores or sizes. "anywhere" drops the anchor: the longest run of the next target
tokens found anywhere in seen text, which bounds a copier that aligns by position too (one
that, after the target wrote a token the source never had, continues the source from the
aligned place): every copier's ceiling.

Beside it, in the same replay:
- "ngram": the lookup of git 2ff7373 as it drafts a chain (the latest earlier occurrence of the
  longest tail of 4 tokens down to 1, in the context, else in memory; up to `cap` tokens);
- "best of 16": the best continuation among only the 16 most recent occurrences of the longest
  tail that occurs (4 down to 1), in the context and in memory each: what suffix lookup's
  tries read, as one chain, picked by hindsight;
- "suffix chain", "suffix tree": specmlx's suffix lookup itself (drafting/lookup), drafting
  to the cap every round (no chooser shortening it): its likeliest path, and its whole tree of
  up to TREE_MAX nodes (the longest path the target's tokens take through it is kept).
  What separates these from the default's real runs is the chooser's k and tree size.

  . scripts/env.sh; .venv/bin/python experiments/lookup_ceiling.py smollm2-135m [-n 192] [--cap 31]
      [--sequences experiments/sets/rewrite3.jsonl] [--outputs bench-out/rewrite3-192.json]

--outputs keeps the target's outputs (generated when the file is missing, read when present).
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specmlx.bench.data import code_of, edit_step, load_sequences  # noqa: E402
from specmlx.decoding.decode import Decode  # noqa: E402
from specmlx.decoding.engine import generate_tokens  # noqa: E402
from specmlx.decoding.stream import encode_prompt  # noqa: E402
from specmlx.drafting.choosing.adaptive import TREE_MAX  # noqa: E402
from specmlx.drafting.choosing.choosers import K  # noqa: E402
from specmlx.drafting.lookup.memory import Lookup, LookupMemory  # noqa: E402
from specmlx.models.loading import load_pair  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("target")
ap.add_argument("-n", type=int, default=192)
ap.add_argument("--cap", type=int, default=31, help="the most tokens one round drafts")
ap.add_argument("--sequences", default=None, help="a JSONL of edit sequences (default: built-in)")
ap.add_argument("--outputs", default=None, help="a JSON file keeping the target's outputs")
a = ap.parse_args()
tgt, _, _ = load_pair(a.target, None)
WHAT = ("oracle", "anywhere", "ngram", "best of 16", "suffix chain", "suffix tree")


def run_len(text: np.ndarray, starts: np.ndarray, want: list[int], cap: int) -> np.ndarray:
    """For each start s (text[s] is the tail's token), how many of ``want`` follow it in
    ``text`` (at most cap, never past the end)."""
    got = np.zeros(len(starts), dtype=int)
    live = np.ones(len(starts), dtype=bool)
    for j, w in enumerate(want[:cap]):
        pos = starts + 1 + j
        ok = live & (pos < len(text))
        ok[ok] = text[pos[ok]] == w
        got += ok
        live = ok
        if not live.any():
            break
    return got


def occurrences(text: np.ndarray, end: int, tail: list[int]) -> np.ndarray:
    """Where ``tail`` ends in text[:end] (positions of its last token), oldest first."""
    if end < len(tail):
        return np.zeros(0, dtype=int)
    hit = np.ones(end - len(tail) + 1, dtype=bool)
    for j, t in enumerate(tail):
        hit &= text[j : end - len(tail) + 1 + j] == t
    return np.nonzero(hit)[0] + len(tail) - 1


def longest_tail(texts, ends, seq, n_max=4):
    """Per text, the occurrences of the longest tail of seq (n_max tokens down to 1) that
    occurs in any of them."""
    for n in range(min(n_max, len(seq)), 0, -1):
        found = [occurrences(t, e, seq[-n:]) for t, e in zip(texts, ends, strict=True)]
        if any(len(f) for f in found):
            return found
    return [np.zeros(0, dtype=int) for _ in texts]


def replay(ids, out, memory, cap):
    """Tokens and rounds for the three drafters over one request's known output; memory: the
    earlier outputs, oldest first, each after a separator no token equals (so no copied run
    crosses from one output into the next, and the most recent occurrences come last)."""
    res = {}
    for what in WHAT:
        if what.startswith("suffix"):
            res[what] = replay_suffix(ids, out, memory, cap, tree=what == "suffix tree")
            continue
        i = rounds = 0
        while i < len(out):
            seq = ids + out[:i]
            ctx = np.array(seq + out[i:], dtype=np.int64)  # the future sits past ctx_end
            texts = [ctx, memory]
            ends = [len(seq) - 1, len(memory)]  # in the context, occurrences strictly earlier
            want = out[i:]
            if what in ("oracle", "anywhere"):
                L = 0
                for t, e in zip(texts, ends, strict=True):
                    # anywhere: every place whose next token is the first wanted one
                    st = np.arange(-1, e) if what == "anywhere" else occurrences(t, e, seq[-1:])
                    if len(st):
                        lens = run_len(t, st, want, cap)
                        if t is ctx:  # the copied tokens must be confirmed text
                            lens = np.minimum(lens, len(seq) - 1 - st)
                        L = max(L, int(lens.max()))
            else:
                found = longest_tail(texts, ends, seq)
                L = 0
                for t, st in zip(texts, found, strict=True):
                    if not len(st):
                        continue
                    st = st[-1:] if what == "ngram" else st[-16:]
                    lens = run_len(t, st, want, cap)
                    if t is ctx:
                        lens = np.minimum(lens, len(seq) - 1 - st)
                    L = max(L, int(lens.max()))
                    if what == "ngram":
                        break  # the context's latest occurrence, else memory's
            i += L + 1
            rounds += 1
        res[what] = (len(out), rounds)
    return res


def replay_suffix(ids, out, memory, cap, tree):
    """(tokens, rounds) of suffix lookup (lookup.Lookup.speculate) drafting up to ``cap``
    tokens a round over the known output: its likeliest path, or (tree) the longest path of
    its tree of up to TREE_MAX nodes that the output follows."""
    store = LookupMemory(None)
    docs = [d for d in np.split(memory, np.nonzero(memory == SEP)[0]) if len(d)]
    for d in docs:
        store.add([int(x) for x in d if x != SEP])
    look = Lookup(list(ids), store)
    i = rounds = 0
    while i < len(out):
        spec = look.speculate(min(cap, len(out) - i), TREE_MAX if tree else cap)
        L = 0
        if tree:
            child = {
                (p, t): j + 1
                for j, (p, t) in enumerate(zip(spec.parents, spec.tokens, strict=True))
            }
            at = 0  # follow the output down the tree: the child with its next token
            while i + L < len(out) and (at, out[i + L]) in child:
                at, L = child[(at, out[i + L])], L + 1
        else:
            for j in spec.chain()[:cap]:
                if i + L >= len(out) or spec.tokens[j - 1] != out[i + L]:
                    break
                L += 1
        look.extend(out[i : i + L + 1])
        i += L + 1
        rounds += 1
    return len(out), rounds


def outputs() -> list[tuple[str, list[int], list[int]]]:
    """(id, prompt ids, target output) for every step of the trace, in order."""
    kept = Path(a.outputs) if a.outputs else None
    if kept is not None and kept.exists():
        return [tuple(r) for r in json.loads(kept.read_text())]
    steps = []
    for seq in load_sequences(a.sequences):
        file = seq["file"]
        for step in range(len(seq["edits"])):
            row = edit_step(seq, step, file)
            ids = encode_prompt(tgt.tokenizer, row["prompt"], chat=True)
            decode = Decode(k=K(0), max_tokens=a.n)
            out = [e.token for e in generate_tokens(tgt.model, None, ids, decode)]
            steps.append((row["id"], ids, out))
            file = code_of(tgt.tokenizer.decode(out))
    if kept is not None:
        kept.parent.mkdir(parents=True, exist_ok=True)
        kept.write_text(json.dumps(steps))
    return steps


totals = {m: {w: [0, 0] for w in WHAT} for m in ("memory", "none")}
SEP = -1
past: list[int] = []  # every earlier output of the trace, each after SEP
for name, ids, out in outputs():
    for m, mem in (("memory", past), ("none", [])):
        for w, (toks, rounds) in replay(ids, out, np.array(mem, dtype=np.int64), a.cap).items():
            totals[m][w][0] += toks
            totals[m][w][1] += rounds
    past += [SEP, *out]
    print(name, len(ids), "prompt tokens,", len(out), "out", flush=True)

for m, by in totals.items():
    line = ", ".join(f"{w} {t / r:.2f}" for w, (t, r) in by.items())
    print(f"tok/pass, {'+ memory' if m == 'memory' else 'no memory'}: {line}")
