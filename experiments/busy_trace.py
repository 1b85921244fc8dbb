"""Lookup on the agent trace from a fresh chooser home, on a quiet machine and beside a busy
core (issue 65): does auto's course swing with what ran beside its probe, and does the
default lookup keep up with n-gram lookup in every run?

Each run is what a first `specmlx run --draft lookup` session over the trace does: a fresh
ChooserStore (nothing saved: the pass-cost probe runs at the first request, on whatever the
machine is doing then), one lookup memory for the whole trace, greedy, -k auto --tree auto,
every output checked against target-only. "busy" runs `python -c "while 1: pass"` beside the
whole run, probe included. Conditions alternate (quiet, busy, quiet, ...) so drift hits both,
and within each the lookup kinds run one after the other, each from its own fresh store.
A kind "lookup@N" is the default capped at N drafts a pass (n-gram lookup's cap is 15:
"lookup@15" compares the two at equal caps); "none" is target-only (-k 0), the floor.

    . scripts/env.sh && .venv/bin/python experiments/busy_trace.py smollm2-135m --runs 3
      [--kinds lookup,lookup@15,lookup:ngram] [-n 192] [--sequences FILE]

--sequences: another trace (a JSONL of edit sequences, as `specmlx bench --set edit-sequence
--prompts FILE` takes; experiments/sets/rewrite3.jsonl: whole-file rewrites of three stdlib
modules); default: the built-in agent trace.

Prints per run and kind: tokens per target pass, decode tok/s, the probe's t(16)/t(1) and
t(32)/t(1); then per condition and kind the median and the spread of tokens per pass
((max - min) / median), and each run's tok/s against the last kind's (n-gram's) in that run.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specmlx.bench.data import code_of, edit_step, load_sequences  # noqa: E402
from specmlx.core.sampling import SamplingParams  # noqa: E402
from specmlx.decoding.session import DrafterChoice, Pair, Request, Session  # noqa: E402
from specmlx.decoding.stream import encode_prompt  # noqa: E402
from specmlx.drafting.choosing.choosers import AUTO, ChooserStore, K  # noqa: E402
from specmlx.drafting.choosing.tree_size import AUTO as TREE_AUTO  # noqa: E402
from specmlx.drafting.lookup import rows as lookup_rows  # noqa: E402
from specmlx.drafting.lookup.kinds import LookupKind  # noqa: E402
from specmlx.drafting.lookup.memory import LookupMemory  # noqa: E402
from specmlx.models.loading import load_pair  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("target")
ap.add_argument("-n", type=int, default=192)
ap.add_argument("--runs", type=int, default=3, help="runs of each condition")
ap.add_argument("--kinds", default="lookup,lookup@15,lookup:ngram", help="--draft's forms")
ap.add_argument("--conditions", default="quiet,busy")
ap.add_argument("--sequences", default=None, help="a JSONL of edit sequences")
a = ap.parse_args()
tgt, _, _ = load_pair(a.target, None)
pair = Pair.of(tgt, None, None)
CAP = lookup_rows.SUFFIX_MAX
greedy = SamplingParams(temperature=0.0)


def trace(session: Session, kind: LookupKind, plain: dict) -> tuple[int, int, float]:
    """The whole trace once: (tokens, target passes, decode seconds); each output checked
    against target-only's (``plain``: filled on the first call)."""
    made = passes = 0
    seconds = 0.0
    for seq in load_sequences(a.sequences):
        file = seq["file"]
        for step in range(len(seq["edits"])):
            row = edit_step(seq, step, file)
            ids = encode_prompt(tgt.tokenizer, row["prompt"], chat=True)
            if kind is None:  # target-only
                req = Request(ids, greedy, K(0), a.n, drafter=DrafterChoice(False, None))
            else:
                drafter = DrafterChoice(False, kind)
                req = Request(ids, greedy, AUTO, a.n, drafter=drafter, tree=TREE_AUTO)
            gen = session.start(req)
            out = [e.token for e in gen.tokens()]
            gen.finish()
            if row["id"] not in plain:
                base = Request(ids, greedy, K(0), a.n, drafter=DrafterChoice(False, None))
                plain[row["id"]] = [e.token for e in Session(pair).start(base).tokens()]
            if out != plain[row["id"]]:
                raise SystemExit(f"{row['id']}: output differs from target-only")
            made += len(out)
            passes += gen.stats.rounds
            seconds += gen.stats.decode_s
            file = code_of(tgt.tokenizer.decode(out))
    return made, passes, seconds


def kind_of(name: str) -> LookupKind | None:
    """The lookup kind, its cap set (lookup@N: the default with at most N drafts a pass);
    None: target-only."""
    if name == "none":
        return None
    name, _, cap = name.partition("@")
    lookup_rows.SUFFIX_MAX = int(cap) if cap else CAP
    return LookupKind.of(name)


kinds = a.kinds.split(",")
plain: dict = {}
for name in kinds:  # warm-up, and target-only's outputs
    store = ChooserStore(persist=False)
    trace(Session(pair, choosers=store, memory=LookupMemory()), kind_of(name), plain)
results: dict[tuple[str, str], list[tuple[float, float, float, float]]] = {}
for r in range(a.runs):
    for cond in a.conditions.split(","):
        busy = None
        if cond == "busy":
            busy = subprocess.Popen([sys.executable, "-c", "while 1: pass"])
            time.sleep(0.5)
        try:
            for name in kinds:
                store = ChooserStore(persist=False)
                session = Session(pair, choosers=store, memory=LookupMemory())
                made, passes, seconds = trace(session, kind_of(name), plain)
                ratio = store.cached_probe(pair.target_id, 31) or [0.0] * 32
                row = (made / passes, made / seconds, ratio[15], ratio[31])
                results.setdefault((cond, name), []).append(row)
                print(f"run {r + 1} {cond:5s} {name:14s}: {row[0]:.2f} tok/pass, {row[1]:.1f} "
                      f"tok/s, probe t(16)/t(1) {row[2]:.2f}, t(32)/t(1) {row[3]:.2f}",
                      flush=True)  # fmt: skip
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()
refs = [kinds[-1]] + (["none"] if "none" in kinds[:-1] else [])
for (cond, name), rows in results.items():
    tpp = [x[0] for x in rows]
    med = statistics.median(tpp)
    spread = (max(tpp) - min(tpp)) / med
    against = []
    for ref in refs:
        vs = [x[1] / y[1] for x, y in zip(rows, results[cond, ref], strict=True)]
        against.append(f"vs {ref} each run {', '.join(f'{v:.2f}x' for v in vs)}")
    print(
        f"{cond:5s} {name:14s}: tok/pass median {med:.2f} (spread {spread:.0%}), tok/s "
        f"median {statistics.median(x[1] for x in rows):.1f}, tok/s {'; '.join(against)}"
    )
for name in kinds:
    tpp = [x[0] for (c, n), rows in results.items() if n == name for x in rows]
    spread = (max(tpp) - min(tpp)) / statistics.median(tpp)
    print(f"{name}: tok/pass spread over all runs {spread:.0%}")
