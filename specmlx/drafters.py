"""Drafters propose up to k tokens (and, for sampling, the distribution q each came from).

The draft model lives here, prompt lookup in lookup.py. Verification, acceptance and rollback
are the same for every drafter, which is what keeps all of them lossless: a drafter can only
change how many tokens a target pass yields.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from .sampling import Processor, sample


def draft_model_propose(
    model: nn.Module,
    cache: list,
    pending: mx.array,
    k: int,
    vocab: int,
    process: Processor | None,
    key: mx.array,
    after_step: Callable[[int], None] | None = None,
) -> tuple[mx.array, mx.array | None, mx.array]:
    """Feed the draft the tokens it has not seen yet, pending (B, L), then draft k tokens.

    Nothing waits here: each step is queued with async_eval (the host never blocks) and feeds
    the previous step's not-yet-read token.
    Returns d (B, k) uint32, q (B, k, vocab) float32 (None when greedy) and the draft's
    confidence in each token (B, k): its probability under q (greedy: under the softmax).
    MLX is lazy: the confidence costs nothing unless someone reads it. The draft cache
    grows by L + k - 1: the last drafted token is never fed, the engine accounts for that.
    ``vocab`` restricts proposals to ids the target has (Code Llama 7B has 16 more than 34B).
    The engine uses B = 1; tests batch thousands of rounds through this same function.
    ``after_step(i)``, if given, is called after step i's pass, when the cache has grown by
    L + i (the engine keeps a recurrent draft's state there, to roll back to any of them).
    """
    keys = mx.random.split(key, k)
    x, tokens, qs, confs = pending, [], [], []
    for i in range(k):
        logits = model(x, cache=cache)[:, -1, :vocab]  # (B, vocab)
        if after_step is not None:
            after_step(i)
        if process is None:
            t = mx.argmax(logits, axis=-1).astype(mx.uint32)
            confs.append(mx.softmax(logits, axis=-1).max(axis=-1))  # (B,)
        else:
            q = process(logits)
            t = sample(q, keys[i])
            qs.append(q)
            confs.append(mx.take_along_axis(q, t[:, None].astype(mx.int32), axis=-1)[:, 0])
        tokens.append(t)
        x = t[:, None]  # (B, 1)
        mx.async_eval(t)  # start computing while the next step's graph is built: no host wait
    d = mx.stack(tokens, axis=1)
    return d, (mx.stack(qs, axis=1) if qs else None), mx.stack(confs, axis=1)
