"""What a round's acceptance step costs under each sampled rule, at a target's vocabulary.

Usage: .venv/bin/python experiments/rule_cost.py [VOCAB ...]   (default: 49152, SmolLM2's)

Times the processing of the target's k + 1 rows and the draft's k rows (temperature 0.8,
top-p 0.95, as the sampled benchmarks use) plus the token-wise or block rule on random
logits, for k = 2, 4, 8: the median of 30 runs each. Block verification adds a (k - 1, V)
residual to token-wise; this shows what that costs next to the processing both need.
"""

from __future__ import annotations

import sys
import time

import mlx.core as mx

from specmlx.core.acceptance import accept_block, accept_sampled
from specmlx.core.sampling import SamplingParams, make_processor

RUNS = 30


def step_ms(rule, process, target_logits, draft_logits, draft) -> float:
    """Median milliseconds of processing both models' rows and applying ``rule`` once."""
    times = []
    for rep in range(RUNS):
        key = mx.random.key(rep)
        t0 = time.perf_counter()
        p, q = process(target_logits), process(draft_logits)
        u = mx.random.uniform(shape=draft.shape, key=key)
        mx.eval(*rule(p, q, draft, u, key))
        times.append(time.perf_counter() - t0)
    return sorted(times)[RUNS // 2] * 1e3


def main(vocabs: list[int]) -> None:
    process = make_processor(SamplingParams(0.8, top_p=0.95))
    for vocab in vocabs:
        for k in (2, 4, 8):
            target_logits = 3 * mx.random.normal((k + 1, vocab), key=mx.random.key(1))
            draft_logits = target_logits[:k] + mx.random.normal((k, vocab), key=mx.random.key(2))
            draft = mx.argmax(draft_logits, axis=-1).astype(mx.uint32)
            mx.eval(target_logits, draft_logits, draft)
            token = step_ms(accept_sampled, process, target_logits, draft_logits, draft)
            block = step_ms(accept_block, process, target_logits, draft_logits, draft)
            print(
                f"V={vocab} k={k}: token-wise {token:.1f} ms, block {block:.1f} ms "
                f"({block - token:+.1f} ms; processing p and q included) on {mx.default_device()}"
            )


if __name__ == "__main__":
    main([int(v) for v in sys.argv[1:]] or [49152])
