"""The toy MTP benchmark: a tiny Qwen3.5-shaped target trained on a toy language and an MTP
head trained on its hidden states (tests/mtp_toy.py), speculating through specmlx's engine.
Prints tokens per target pass by depth k (greedy and T = 0.8), the acceptance by depth the
rounds showed, and what adaptive k learned (first-draft acceptance a, later a_later) and
chose. Mechanics on a toy: it says the plumbing and the cost model work, nothing about a
real checkpoint's acceptance.

    .venv/bin/python experiments/mtp_toy.py [--prompts 8] [--tokens 64]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from mtp_toy import toy_head, toy_language, toy_target  # noqa: E402

from specmlx.core.sampling import SamplingParams  # noqa: E402
from specmlx.core.stats import Stats  # noqa: E402
from specmlx.decoding.engine import Decode, Parts, generate_tokens  # noqa: E402
from specmlx.drafting.choosing.adaptive import AdaptiveK  # noqa: E402
from specmlx.drafting.choosing.choosers import K  # noqa: E402


def run(target, head, k, temp: float, prompts: int, n: int) -> Stats:
    """One generation per prompt; their figures summed (a Stats is per generation)."""
    total = Stats()
    for p in range(prompts):
        stats = Stats()
        prompt = toy_language(1, 6, 9000 + p)[0].tolist()
        sampling = SamplingParams(temperature=temp)
        decode = Decode(sampling=sampling, k=K(k), max_tokens=n, seed=p)
        list(generate_tokens(target, head, prompt, decode, Parts(stats=stats)))
        total.generated += stats.generated
        total.rounds += stats.rounds
        total.drafted += stats.drafted
        total.accepted += stats.accepted
        hist = total.accept_hist + [0] * max(0, len(stats.accept_hist) - len(total.accept_hist))
        total.accept_hist = [h + (stats.accept_hist[i] if i < len(stats.accept_hist) else 0)
                             for i, h in enumerate(hist)]  # fmt: skip
    return total


def by_depth(stats: Stats, k: int) -> str:
    """P(draft i kept | drafts before it kept), from the rounds' accepted counts."""
    hist = list(stats.accept_hist) + [0] * (k + 1)
    out = []
    for i in range(1, k + 1):
        reached = sum(hist[i - 1 : k + 1])
        kept = sum(hist[i : k + 1])
        out.append(f"{kept / reached:.2f}" if reached else "-")
    return " ".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    target = toy_target()
    head = toy_head(target)
    print("| T | k | tokens per target pass | acceptance by depth |")
    print("|---|---|---|---|")
    for temp in (0.0, 0.8):
        for k in (1, 2, 3, 4):
            s = run(target, head, k, temp, a.prompts, a.tokens)
            print(f"| {temp} | {k} | {s.tokens_per_pass:.2f} | {by_depth(s, k)} |")
        chooser = AdaptiveK()
        s = run(target, head, chooser, temp, a.prompts, a.tokens)
        print(f"| {temp} | auto (mean k {s.drafted / s.rounds:.1f}) | {s.tokens_per_pass:.2f} | "
              f"learned a = {chooser.accept.first_rate:.2f}, "
              f"a_later = {chooser.accept.later_rate:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
