"""The acceptance rule: pure functions of (target p, draft q, draft tokens, randomness).

All functions take a leading batch shape (...) so tests can run thousands of rounds at once;
the engine calls them with a batch of one. Everything stays lazy: the engine reads back
(n, next_token) once per round.
"""

from __future__ import annotations

import mlx.core as mx

from .sampling import sample


def _count_leading(ok: mx.array) -> mx.array:
    """(..., k) bool -> (...,) number of leading True values."""
    return mx.cumprod(ok.astype(mx.int32), axis=-1).sum(axis=-1)


def accept_greedy(target_logits: mx.array, draft: mx.array) -> tuple[mx.array, mx.array]:
    """Temperature 0: keep d_i while it equals the target's argmax; the next token is the
    target's argmax after the kept prefix (the correction, or the bonus if all k are kept).

    target_logits (..., k+1, V), draft (..., k) -> n (...,), next (...,).
    This is the Leviathan rule below with p and q one-hot at their argmax.
    """
    choice = mx.argmax(target_logits, axis=-1).astype(mx.uint32)  # (..., k+1)
    k = draft.shape[-1]
    n = _count_leading(choice[..., :k] == draft)
    nxt = mx.take_along_axis(choice, n[..., None], axis=-1)[..., 0]
    return n, nxt


def accept_sampled(
    p: mx.array, q: mx.array, draft: mx.array, u: mx.array, key: mx.array
) -> tuple[mx.array, mx.array]:
    """Leviathan et al. 2023 / Chen et al. 2023 speculative sampling.

    p (..., k+1, V) target probabilities, q (..., k, V) draft probabilities (same processing),
    draft (..., k) proposed ids, u (..., k) uniforms in [0, 1), key for the final draw.

    Accept d_i with probability min(1, p_i(d_i) / q_i(d_i))  <=>  u_i * q_i(d_i) < p_i(d_i).
    At the first rejection n, draw from normalize(max(0, p_n - q_n)); if all k are accepted,
    draw the bonus from p_k (q_k := 0 makes that the same formula). Then every emitted token is
    distributed exactly as the target would have sampled it.
    """
    k = draft.shape[-1]
    idx = draft[..., None]
    p_d = mx.take_along_axis(p[..., :k, :], idx, axis=-1)[..., 0]  # (..., k)
    q_d = mx.take_along_axis(q, idx, axis=-1)[..., 0]  # (..., k)
    n = _count_leading(u * q_d < p_d)
    q_pad = mx.concatenate([q, mx.zeros_like(p[..., :1, :])], axis=-2)  # (..., k+1, V)
    row = n[..., None, None]
    p_n = mx.take_along_axis(p, row, axis=-2)[..., 0, :]  # (..., V)
    q_n = mx.take_along_axis(q_pad, row, axis=-2)[..., 0, :]
    residual = mx.maximum(p_n - q_n, 0.0)
    # p_n == q_n up to rounding makes a rejection (almost) impossible; fall back to p_n then
    total = residual.sum(axis=-1, keepdims=True)
    residual = mx.where(total > 1e-12, residual, p_n)
    return n, sample(residual, key)


def point_mass(tokens: mx.array, vocab: int) -> mx.array:
    """q for a deterministic proposal (prompt lookup): one-hot rows (..., k, V).
    Then acceptance is p(d) and the residual is p with d removed, renormalized."""
    return (tokens[..., None] == mx.arange(vocab, dtype=tokens.dtype)).astype(mx.float32)
