"""The distribution kit: the whole-sequence chi-square that every exactness test of a
drafter uses (test_drafter_kinds.py's, one per drafter kind; test_distribution.py's for
per-token stopping and the window, recurrent and Mamba 2 caches). The exact joint
distribution of three-token sequences by enumeration, counts of the sequences the engine
generates through the public generate_tokens, a pooled chi-square between them, and the
wrong-rule control (``skips_the_residual``) that each test's chi-square must reject."""

import mlx.core as mx
import numpy as np
from helpers import generate
from scipy.stats import chisquare

from specmlx.core.sampling import SamplingParams, sample
from specmlx.core.stats import Stats

JV = 8  # vocabulary: 8**3 = 512 possible sequences, 154 of them possible after the filters
JOINT_PROMPT = [3]  # one token: nothing to prefill, each generation is just its rounds
JOINT_SAMPLING = SamplingParams(1.0, top_p=0.9, top_k=6, min_p=0.05)


def pooled_chi2(observed, probs):
    """Chi-square p-value of counts against probabilities, pooling cells expected < 5."""
    observed = np.asarray(observed, dtype=np.float64)
    expected = np.asarray(probs, dtype=np.float64) / np.sum(probs) * observed.sum()
    if observed[expected == 0].sum() > 0:
        return 0.0  # sampled a token the target cannot produce
    big = expected >= 5
    obs, exp = list(observed[big]), list(expected[big])
    if expected[~big].sum() > 0:
        obs.append(observed[~big].sum())
        exp.append(expected[~big].sum())
    exp = np.array(exp) / np.sum(exp) * np.sum(obs)
    return chisquare(obs, exp).pvalue


def sequence_joint(target, process, prompt=JOINT_PROMPT) -> np.ndarray:
    """P(t1, t2, t3 | prompt) by enumeration, (JV**3,): one batched pass over every
    prompt + t1 + t2 gives p(t1), p(t2 | t1) and p(t3 | t1, t2)."""
    ctx = mx.array([prompt + [a, b] for a in range(JV) for b in range(JV)])
    p = np.array(process(target(ctx)), dtype=np.float64)  # (JV * JV, 3, JV)
    p = p[:, -3:]  # the rows that predict t1, t2 and t3
    p1, p2, p3 = p[0, 0], p[::JV, 1], p[:, 2].reshape(JV, JV, JV)
    return (p1[:, None, None] * p2[:, :, None] * p3).reshape(-1)


def engine_sequences(
    target, draft, verify: str, n: int, k=2, prompt=JOINT_PROMPT, first: int = 0, **settings
) -> tuple[np.ndarray, np.ndarray]:
    """Counts of the three-token sequences from n seeded generations (seeds first, first +
    1, ...; k = 2, or a chooser object), and how many rounds kept 0, 1 and 2 drafts.
    settings: more of generate's keywords (``lookup``, ``draft_stop``)."""
    counts, kept = np.zeros(JV**3), np.zeros(3)
    for seed in range(first, first + n):
        stats = Stats()
        out = [
            e.token
            for e in generate(
                target,
                draft,
                prompt,
                sampling=JOINT_SAMPLING,
                k=k,
                max_tokens=3,
                seed=seed,
                vocab_size=JV,
                stats=stats,
                verify=verify,
                **settings,
            )
        ]
        counts[(out[0] * JV + out[1]) * JV + out[2]] += 1
        kept[: len(stats.accept_hist)] += stats.accept_hist
    return counts, kept


REJECT_P = 1e-6  # a wrong rule's chi-square p-value is below this
LOOKS = 4  # a control looks at its counts after each quarter of its generations


def rejects(sequences, n: int, joint) -> float:
    """A wrong-rule control's p-value: ``sequences(count, first)`` (counts of that many
    generations, seeds from ``first``) in LOOKS parts of n / LOOKS, stopping once the pooled
    chi-square rejects (p < REJECT_P): a wrong rule is far off, and most controls show it
    within half their count. Under a right rule the chance that any of the LOOKS looks
    rejects is at most LOOKS x REJECT_P, so a control that passes still shows the test
    rejects that wrong rule."""
    counts, part = np.zeros(JV**3), -(-n // LOOKS)
    for first in range(0, n, part):
        counts += sequences(min(part, n - first), first)
        p = pooled_chi2(counts, joint)
        if p < REJECT_P:
            break
    return p


def skips_the_residual(outcome):
    """A wrong rule: keep what ``outcome`` keeps, then draw the next token from the target's
    row there instead of the residual (the correction the rules depend on)."""

    def rule(p, q, draft, u, key):
        n, _ = outcome(p, q, draft, u)
        return n, sample(mx.take_along_axis(p, n[..., None, None], axis=-2)[..., 0, :], key)

    return rule
