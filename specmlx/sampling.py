"""Sampling settings and the logits → probabilities processing shared by target and draft.

Speculative sampling is exact only if the target's p and the draft's q come out of the *same*
processing, so there is exactly one place that turns logits into a distribution.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from .errors import BadInput

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
    """Build once: logits (..., V) -> float32 probabilities (..., V) after
    temperature, then top-k, then top-p, then min-p (each filter renormalizes implicitly
    by the final division). Ties at a threshold are kept, identically for p and q."""
    temp, top_p, top_k, min_p = params.temperature, params.top_p, params.top_k, params.min_p

    def process(logits: mx.array) -> mx.array:
        probs = mx.softmax(logits.astype(mx.float32) / temp, axis=-1)
        if top_k and top_k < probs.shape[-1]:
            # the k-th largest value per row, (..., 1)
            kth = -mx.partition(-probs, top_k - 1, axis=-1)[..., top_k - 1 : top_k]
            probs = mx.where(probs >= kth, probs, 0.0)
        if top_p < 1.0:
            total = probs.sum(axis=-1, keepdims=True)
            desc = -mx.sort(-probs, axis=-1)  # (..., V), largest first
            before = mx.cumsum(desc, axis=-1) - desc  # mass strictly above each entry
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            n_keep = (before < top_p * total).sum(axis=-1, keepdims=True)
            threshold = mx.take_along_axis(desc, n_keep - 1, axis=-1)
            probs = mx.where(probs >= threshold, probs, 0.0)
        if min_p > 0.0:
            probs = mx.where(probs >= min_p * probs.max(axis=-1, keepdims=True), probs, 0.0)
        return probs / probs.sum(axis=-1, keepdims=True)

    return process


def sample(probs: mx.array, key: mx.array) -> mx.array:
    """Draw one id per row from probabilities (..., V) -> (...,) uint32."""
    return mx.random.categorical(mx.log(probs), key=key).astype(mx.uint32)
