"""Sampling settings and the logits → probabilities processing shared by target and draft.

Speculative sampling is exact only if the target's p and the draft's q come out of the *same*
processing, so there is exactly one place that turns logits into a distribution.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from ..errors import BadInput

Processor = Callable[[mx.array], mx.array]


@dataclass(frozen=True)
class SamplingParams:
    """Temperature 0 means greedy; top_p=1, top_k=0 and min_p=0 switch those filters off."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        t, p, m = self.temperature, self.top_p, self.min_p
        if not (isinstance(t, (int, float)) and math.isfinite(t) and t >= 0):
            raise BadInput(f"temperature must be a finite number >= 0, got {t}")
        if not (isinstance(p, (int, float)) and 0 < p <= 1):
            raise BadInput(f"top-p must be in (0, 1], got {p}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise BadInput(f"top-k must be an integer >= 0, got {self.top_k}")
        if not (isinstance(m, (int, float)) and 0 <= m < 1):
            raise BadInput(f"min-p must be in [0, 1), got {m}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def make_processor(params: SamplingParams) -> Processor:
    """Build once: logits (..., V) -> float32 probabilities (..., V) after temperature, then
    mlx-lm's own top-k, top-p and min-p filters, renormalized. The same function serves the
    target's p and the draft's q, which is what keeps speculative sampling exact."""
    temp, top_p, top_k, min_p = params.temperature, params.top_p, params.top_k, params.min_p

    def process(logits: mx.array) -> mx.array:
        logprobs = nn.log_softmax(logits.astype(mx.float32) / temp, axis=-1)
        if 0 < top_k < logprobs.shape[-1]:
            logprobs = apply_top_k(logprobs, top_k)
        if top_p < 1.0:
            logprobs = apply_top_p(logprobs, top_p)
        if min_p > 0.0:
            logprobs = apply_min_p(logprobs, min_p)
        return mx.softmax(logprobs, axis=-1)

    return process


def sample(probs: mx.array, key: mx.array | None) -> mx.array:
    """Draw one id per row from probabilities (..., V) -> (...,) uint32; the rows need not
    sum to 1. key None draws from MLX's global generator (as mlx-lm's samplers do)."""
    return mx.random.categorical(mx.log(probs), key=key).astype(mx.uint32)


_MASK64 = (1 << 64) - 1


def round_keys(seed: int, position: int) -> tuple[mx.array, mx.array, mx.array]:
    """The keys of the round that starts at ``position`` (the tokens so far, prompt
    included) of a generation seeded with ``seed``: (draft, u, draw), for the drafter's
    samples, the acceptance rule's uniforms and the next token's draw.

    A round's randomness is a function of the seed and where it starts, not of the rounds
    before it: a request that moves (runs alone, then as a row of a batch; parked for a
    newer editor request, then resumed) draws what it would have drawn had it stayed, so
    with the same k a seeded request's text does not depend on what joined it. Exact: every
    round starts further on than the one before (it emits at least one token), so no key is
    used twice in one generation, and keys of distinct positions are independent.

    The mix is splitmix64's (Steele, Lea and Flood 2014): 0x9E3779B97F4A7C15 is 2^64 over
    the golden ratio, its step between seeds, and two xor-shift-multiply rounds spread
    neighbouring (seed, position) pairs over all 64 bits before MLX's own key schedule."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    draft, u, draw = mx.random.split(mx.random.key(z ^ (z >> 31)), 3)
    return draft, u, draw
