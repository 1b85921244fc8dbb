"""Timing probes: how long a model's forward pass takes over n tokens, and the target's pass-cost
curve (a pass over k + 1 tokens against one) that seeds adaptive k's cost model.

These run models; the estimates in adaptive.py never do, they only read the curve.
"""

from __future__ import annotations

import time

import mlx.core as mx
import mlx.nn as nn

from ...core.caches import can_rollback, make_caches, trim
from .adaptive import SUFFIX_MAX
from .cost_curve import PROBE_SIZES


def pass_times(
    model: nn.Module, ids: list[int], ns: list[int], reps: int = 3, warm: bool = True
) -> dict[int, float]:
    """Seconds of one forward pass over n tokens after a prefill of ``ids``, for each n in
    ``ns``: the sizes take turns within each repetition, so drift hits them alike, and the
    fastest repetition is kept, since on a shared machine noise only ever adds time.

    model: the model to time; ids: the prefill (also what the timed passes repeat); ns: the
    token counts to time; reps: timed repetitions; warm: after one untimed warm-up round of
    every size (False: none, for a probe whose times only ever lower earlier ones)."""
    cache = make_caches(model)
    model(mx.array(ids, dtype=mx.uint32)[None], cache=cache)
    mx.eval([c.state for c in cache])
    best = dict.fromkeys(ns, float("inf"))
    for rep in range(reps + warm):  # with a warm-up, the first is it
        for n in ns:
            x = mx.array((ids * n)[:n], dtype=mx.uint32)[None]
            t0 = time.perf_counter()
            mx.eval(model(x, cache=cache))
            if rep or not warm:
                best[n] = min(best[n], time.perf_counter() - t0)
            if can_rollback(cache, n):  # recurrent state just runs on: the timing is the same
                trim(cache, n)
    return best


def head_step_seconds(head: nn.Module, reps: int = 3) -> float:
    """Seconds of one step of a head over the target's hidden states, the fastest of
    ``reps`` after a warm-up: a chained head's (an MTP or EAGLE-3 head: one pair in, one
    token's logits out), or a block drafter's (DFlash: one context row in, a block of its
    block_size out) divided by the block_size - 1 drafts it makes, so that k drafts cost k
    steps as for the others (at the full block; a narrower one costs more per draft).

    head: the head to time; reps: timed repetitions, after one warm-up."""
    cache = head.make_cache()
    block = getattr(head, "block_size", None)
    if block:  # one context row: the target's features at its layers, side by side
        hidden = mx.zeros((1, 1, head.fc.weight.shape[1]))
    else:  # a chained step's input: the head's own output, H wide
        hidden = mx.zeros((1, 1, head.norm.weight.shape[0]))
    token = mx.zeros((1, 1), dtype=mx.uint32)
    best = float("inf")
    for rep in range(reps + 1):
        t0 = time.perf_counter()
        if block:
            mx.eval(head.block(hidden, token[0], block, cache))
        else:
            mx.eval(head(hidden, token, cache))
        if rep:
            best = min(best, time.perf_counter() - t0)
        trim(cache, 1)
    return best / (block - 1) if block else best


def curve_from(times: dict[int, float], k_max: int) -> list[float]:
    """t_verify(k) / t_verify(0) for k in 0..k_max from passes timed over some token counts:
    linear between the counts timed, flat past the largest.

    times: n tokens -> seconds, with n = 1 among them; k_max: the last k of the curve."""
    ns = sorted(times)
    out = []
    for n in range(1, k_max + 2):
        lo = max(m for m in ns if m <= n)
        hi = min((m for m in ns if m >= n), default=lo)
        w = 0.0 if hi == lo else (n - lo) / (hi - lo)
        out.append(((1 - w) * times[lo] + w * times[hi]) / times[1])
    return out


def probe_times(
    model: nn.Module, ids: list[int], k_max: int = SUFFIX_MAX, reps: int = 3, warm: bool = True
) -> dict[int, float]:
    """Seconds of a target pass over n tokens at PROBE_SIZES (and k_max + 1), the fastest
    of ``reps`` each (pass_times): what ``probe_pass_cost`` makes its curve from, and what a
    chooser store keeps so later probes can lower it.

    model: the target; ids: a prompt to prefill (its last 64 tokens are used); k_max: the
    last k the curve will need; reps: timed repetitions of each size; warm: after an untimed
    warm-up round (False: a probe whose times only lower a kept curve's, where a cold
    timing is just not kept)."""
    sizes = sorted({n for n in PROBE_SIZES if n <= k_max + 1} | {k_max + 1})
    return pass_times(model, ids[-64:] or [0], sizes, reps, warm)


def probe_pass_cost(
    model: nn.Module, ids: list[int], k_max: int = SUFFIX_MAX, reps: int = 3
) -> list[float]:
    """t_verify(k) / t_verify(0) for k in 0..k_max: a target pass over k + 1 tokens against
    one token, timed at PROBE_SIZES (and k_max + 1) and interpolated between. On Metal this
    curve is known not to be flat; adaptive k needs it.

    model: the target; ids: a prompt to prefill (its last 64 tokens are used); k_max: the
    last k of the curve; reps: timed repetitions of each size."""
    return curve_from(probe_times(model, ids, k_max, reps), k_max)
