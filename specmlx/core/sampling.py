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
