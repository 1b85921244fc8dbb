"""Replay per-token stopping on draft traces (experiments/stop_trace.py), free of timing noise
(issue 14, part 2).

A round at output position i drafts m tokens (each costs c target steps), verifies L of them
(a target pass over L + 1 tokens costs curve[L + 1] steps) and keeps min(n_i, L) + 1 tokens,
where n_i is how many of the draft's proposals from i the target's output confirms. Greedy
output is fixed, so this is exact for any rule up to the cost model. A sampled trace gives
each draft's token-wise acceptance probability instead: each of ``--draws`` replays draws
every step's n_i once from them (draft j passes when u_j < alpha_j), and every rule sees the
same draws. The rules: fixed k; the
oracle (drafts exactly what will be accepted: a ceiling); each prompt at its own best fixed
k (a baseline nearer to live adaptive k, which adapts per prompt); and AdaptiveK.draft_plan, the
engine's own plan, drafting in chunks of a schedule (adaptive.DRAFT_CHUNKS is what runs),
learning acceptance per confidence bin online as the engine does. Figures: acceptance by
confidence decile, tokens per target step, and the ratio to the best fixed k on the same trace.

    .venv/bin/python experiments/stop_sim.py bench-out/trace.json --c 0.2 \
        --curve 1,1.17,1.44,1.63,1.65,1.69,1.70,1.72,1.98
    .venv/bin/python experiments/stop_sim.py bench-out/trace-t08.json --draws 20 --c 0.2 ...
"""

from __future__ import annotations

import argparse
import json
import random

from specmlx.drafting.choosing.adaptive import DRAFT_CHUNKS, Acceptance, AdaptiveK, CostCurve

SCHEDULES = {"committed": DRAFT_CHUNKS, "k then 2s": None, "2s": (2,), "1s": (1,), "1,2": (1, 2)}


def rounds(steps: list[dict], pick):
    """Walk a generation: pick(step) -> (drafted, verified, syncs); yields each round's
    (step, drafted, verified, kept, syncs)."""
    i = 0
    while i < len(steps):
        s = steps[i]
        drafted, verified, syncs = pick(s)
        verified = min(verified, s["left"] - 1)
        kept = min(s["n"], verified)
        yield s, drafted, verified, kept, syncs
        i += kept + 1


def drawn(prompts: list[dict], draws: int) -> list[dict]:
    """A sampled trace as ``draws`` greedy-like ones: each step's n drawn from its alphas."""
    rng, out = random.Random(0), []
    for _ in range(draws):
        for p in prompts:
            steps = []
            for s in p["steps"]:
                n = 0
                while n < len(s["alpha"]) and rng.random() < s["alpha"][n]:
                    n += 1
                steps.append({**s, "n": n})
            out.append({"id": p["id"], "steps": steps})
    return out


def calibration(prompts: list[dict]) -> list[tuple[float, int, float]]:
    """How often drafts are accepted by confidence decile: (bin start, drafts, acceptance).
    Greedy: a draft counts once its prefix was accepted; sampled: its mean alpha. Stopping
    at low confidence pays only if low confidence means a likely rejection."""
    bins: list[list[float]] = [[] for _ in range(10)]
    for p in prompts:
        for s in p["steps"]:
            for j, c in enumerate(s["conf"]):
                if "alpha" in s:
                    bins[min(int(c * 10), 9)].append(s["alpha"][j])
                elif j <= s["n"]:
                    bins[min(int(c * 10), 9)].append(float(j < s["n"]))
    return [(i / 10, len(b), sum(b) / len(b)) for i, b in enumerate(bins) if b]


def plan_rule(chooser: AdaptiveK, chunks: tuple[int, ...] | None, k: int):
    """The engine's loop: draft a chunk, ask draft_plan, draft the next chunk while it says
    so. ``chunks`` None: the old way, the chooser's k first, then DRAFT_CHUNKS[-1] at a time."""

    def pick(s):
        conf = s["conf"]
        m = k if chunks is None else chunks[0]
        first, syncs = m, 2  # the round's own sync and the first chunk's
        while True:
            keep, more = chooser.draft_plan(conf[:m], drafted=first)
            if chunks is not None and more:
                more = chunks[min(syncs - 1, len(chunks) - 1)]
            more = min(more, chooser.k_max - m, len(conf) - m)
            if more <= 0:
                return m, max(1, min(keep, m)), syncs
            m, syncs = m + more, syncs + 1

    return pick


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--c", type=float, default=0.2, help="draft step / target step")
    ap.add_argument("--curve", default="1,1.17,1.44,1.63,1.65,1.69,1.70,1.72,1.98")
    ap.add_argument("--sync", type=float, default=0.01, help="target steps per extra sync")
    ap.add_argument("--draws", type=int, default=20, help="sampled traces: outcome draws")
    ap.add_argument("--conf", default="conf", help="sampled traces: conf, top or agree")
    a = ap.parse_args()
    data = json.load(open(a.trace))
    for p in data["prompts"]:  # the confidence the rules read
        for s in p["steps"]:
            s["conf"] = s[a.conf]
    K = data["K"]
    cal = calibration(data["prompts"])
    print("acceptance by confidence:", ", ".join(f"{c:.1f}+: {a:.2f} ({n})" for c, n, a in cal))
    if "alpha" in data["prompts"][0]["steps"][0]:
        data["prompts"] = drawn(data["prompts"], a.draws)
    curve = [0.0] + [float(x) for x in a.curve.split(",")]
    curve += [curve[-1] + 0.1 * (i + 1) for i in range(K + 2 - len(curve))]
    prompts = [p["steps"] for p in data["prompts"]]

    def rate(pick, learn: AdaptiveK | None = None) -> tuple[float, float]:
        tokens = time = drafted = syncs = 0.0
        for steps in prompts:
            for s, m, v, n, y in rounds(steps, pick):
                tokens += n + 1
                time += m * a.c + curve[v + 1] + max(0, y - 1) * a.sync
                drafted, syncs = drafted + m, syncs + max(0, y - 1)
                if learn is not None:  # what the engine's chooser folds in
                    learn.accept.observe(s["conf"][:v], n)
        return tokens / time, drafted / max(syncs, 1)

    def fixed(steps: list[dict], k: int) -> tuple[float, float]:  # (tokens, time) at k
        tokens = time = 0.0
        for _, m, v, n, _ in rounds(steps, lambda s: (k, k, 1)):
            tokens, time = tokens + n + 1, time + m * a.c + curve[v + 1]
        return tokens, time

    ks = range(0, min(K, len(curve) - 2) + 1)
    base = {k: rate(lambda s, k=k: (k, k, 1))[0] for k in ks}
    best = max(base, key=base.get)
    print(f"c = {a.c}, curve (pass over n tokens) = {curve[1 : len(curve)]}")
    print("fixed k:", ", ".join(f"{k}: {v:.3f}" for k, v in base.items()), f"(best: k = {best})")
    # a stronger baseline, nearer to what adaptive k does live: each prompt at its own best k
    # (a sampled trace's draws of one prompt share its k)
    own, ids = [0.0, 0.0], [p["id"] for p in data["prompts"]]
    for pid in dict.fromkeys(ids):
        mine = [steps for steps, i in zip(prompts, ids, strict=True) if i == pid]
        runs = [[sum(x) for x in zip(*(fixed(st, k) for st in mine), strict=True)] for k in ks]
        tokens, time = max(runs, key=lambda r: r[0] / r[1])
        own = [own[0] + tokens, own[1] + time]
    own_rate = own[0] / own[1]
    print(f"each prompt at its own best fixed k: {own_rate:.3f} = {own_rate / base[best]:.3f}x")
    oracle = rate(lambda s: (min(s["n"], K), min(s["n"], K), 1))[0]
    print(f"oracle: {oracle:.3f} = {oracle / base[best]:.3f}x the best fixed k")

    # the chooser's acceptance and costs, fitted on the trace; confidence bins start from the
    # prior and are learned as the replay goes, carried from prompt to prompt
    first = later = (0, 0)
    for steps in prompts:
        for s in steps:
            n = min(s["n"], K - 1)
            first = (first[0] + (n > 0), first[1] + 1)
            later = (later[0] + max(0, n - 1), later[1] + (n > 0) * n)
    for name, chunks in SCHEDULES.items():
        fitted = Acceptance(first=[first[0], first[1]], later=[later[0], later[1]])
        timed = CostCurve(pass_ratio=curve[1:], level=1.0, t_draft=a.c, t_plain=1.0)
        chooser = AdaptiveK(k_max=min(8, K), accept=fitted, cost=timed)
        k = chooser.best_now()
        r, per_sync = rate(plan_rule(chooser, chunks, k), learn=chooser)
        label = f"{name} {chunks}" if chunks else f"{name} (k = {k})"
        ratios = f"{r / base[best]:.3f}x ({r / own_rate:.3f}x each prompt's own best k)"
        print(f"draft_plan, {label}: {r:.3f} = {ratios}, {per_sync:.2f} drafts/sync")


if __name__ == "__main__":
    main()
