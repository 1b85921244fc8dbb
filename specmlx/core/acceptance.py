"""The acceptance rules: pure functions of (target p, draft q, draft tokens, randomness).

All functions take a leading batch shape (...) so tests can run thousands of rounds at once;
the engine calls them with a batch of one. Everything stays lazy: the engine reads back
(n, next_token) once per round.

Two sampled rules, both exact (every emitted token is distributed as the target would have
sampled it): token-wise verification (``accept_sampled``) and block verification
(``accept_block``), which decides on the drafted block jointly and never accepts fewer
tokens in expectation. Each is an ``*_outcome`` function (how many drafts are kept, and the
distribution the next token comes from) followed by one draw. Greedy decoding is their
one-hot case, ``accept_greedy``.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from ..errors import BadInput
from .sampling import sample

# (p, q, draft, u, key) -> (n accepted, next token); q None: a point mass at each draft
Rule = Callable[
    [mx.array, mx.array | None, mx.array, mx.array, mx.array], tuple[mx.array, mx.array]
]


def _count_leading(ok: mx.array) -> mx.array:
    """(..., k) bool -> (...,) number of leading True values."""
    return mx.cumprod(ok.astype(mx.int32), axis=-1).sum(axis=-1)


def _at_draft(probs: mx.array, draft: mx.array) -> mx.array:
    """probs (..., k(+1), V), draft (..., k) -> (..., k): each row's probability of its draft."""
    k = draft.shape[-1]
    return mx.take_along_axis(probs[..., :k, :], draft[..., None], axis=-1)[..., 0]


def _q_at_draft(q: mx.array | None, draft: mx.array) -> mx.array:
    """q's probability of each draft (..., k); a point mass (q None) gives each its draft 1."""
    return mx.ones(draft.shape, dtype=mx.float32) if q is None else _at_draft(q, draft)


def _next_distribution(
    p: mx.array, q: mx.array | None, draft: mx.array, n: mx.array, scale: mx.array
) -> mx.array:
    """The (unnormalized) distribution of the token after n kept drafts:
    max(scale * p_n - q_n, 0), with q_k := 0 so that n = k gives the bonus row p_k.

    p (..., k+1, V), q (..., k, V_q) with V_q <= V (ids past V_q have q = 0: a narrower draft
    vocabulary) or None for a point mass at each draft, draft (..., k), n (...,), scale
    (...,) -> (..., V). A point mass's residual is scale * p_n without d_n (scale * p_n(d_n)
    <= 1), so no one-hot is built. If the residual is empty up to rounding (p_n == q_n, where
    the rules make stopping there all but impossible) it falls back to p_n, so a draw never
    sees an all-zero row."""
    k, width = draft.shape[-1], p.shape[-1]
    p_n = mx.take_along_axis(p, n[..., None, None], axis=-2)[..., 0, :]  # (..., V)
    residual = scale[..., None] * p_n
    if k > 0:
        inside = (n < k)[..., None]  # a rejection inside the block: q_n is subtracted
        row = mx.minimum(n, k - 1)[..., None]  # (..., 1); n = k reads row k - 1, masked out
        if q is None:
            d_n = mx.take_along_axis(draft, row, axis=-1)  # (..., 1)
            hit = (mx.arange(width, dtype=draft.dtype) == d_n) & inside
            residual = mx.where(hit, 0.0, residual)
        else:
            q_n = mx.take_along_axis(q, row[..., None], axis=-2)[..., 0, :] * inside  # (..., V_q)
            if q.shape[-1] == width:
                residual = residual - q_n
            else:
                residual = residual.at[..., : q.shape[-1]].subtract(q_n)
            residual = mx.maximum(residual, 0.0)
    total = residual.sum(axis=-1, keepdims=True)
    return mx.where(total > 1e-12, residual, p_n)


def accept_greedy(target_logits: mx.array, draft: mx.array) -> tuple[mx.array, mx.array]:
    """Temperature 0: keep d_i while it equals the target's argmax; the next token is the
    target's argmax after the kept prefix (the correction, or the bonus if all k are kept).

    target_logits (..., k+1, V), draft (..., k) -> n (...,), next (...,).
    This is both sampled rules below with p and q one-hot at their argmax.
    """
    choice = mx.argmax(target_logits, axis=-1).astype(mx.uint32)  # (..., k+1)
    k = draft.shape[-1]
    n = _count_leading(choice[..., :k] == draft)
    nxt = mx.take_along_axis(choice, n[..., None], axis=-1)[..., 0]
    return n, nxt


def sampled_outcome(
    p: mx.array, q: mx.array | None, draft: mx.array, u: mx.array
) -> tuple[mx.array, mx.array]:
    """Token-wise verification, before the final draw: (n, unnormalized next distribution).

    Accept d_i with probability min(1, p_i(d_i) / q_i(d_i))  <=>  u_i * q_i(d_i) < p_i(d_i),
    stop at the first rejection n; the next token comes from max(0, p_n - q_n) (the bonus
    row p_k when all k are kept). Arguments as for accept_sampled.
    """
    n = _count_leading(u * _q_at_draft(q, draft) < _at_draft(p, draft))
    return n, _next_distribution(p, q, draft, n, mx.ones(n.shape, dtype=p.dtype))


def accept_sampled(
    p: mx.array, q: mx.array | None, draft: mx.array, u: mx.array, key: mx.array
) -> tuple[mx.array, mx.array]:
    """Leviathan et al. 2023 / Chen et al. 2023 speculative sampling, token by token.

    p (..., k+1, V) target probabilities, q (..., k, V_q) draft probabilities (the same
    processing; V_q <= V, the ids past it have q = 0) or None for a point mass at each draft
    (prompt lookup: no one-hot rows are built), draft (..., k) proposed ids, u (..., k) uniforms in [0, 1), key for the final draw.
    Returns n (...,) drafts kept and next (...,) the token after them. The rule is
    ``sampled_outcome``; then every emitted token is distributed exactly as the target would
    have sampled it.
    """
    n, dist = sampled_outcome(p, q, draft, u)
    return n, sample(dist, key)


def block_thresholds(p: mx.array, q: mx.array | None, draft: mx.array) -> tuple[mx.array, mx.array]:
    """Block verification's weights and stopping probabilities (Sun et al. 2024, Alg. 2).

    With P_i, Q_i the rows at draft position i (i = 1..k) and X_i the drafts:
        w_0 = 1,  w_i = min(w_{i-1} P_i(X_i) / Q_i(X_i), 1)
        R_i = sum_x max(w_i P_{i+1}(x) - Q_{i+1}(x), 0)
        h_i = R_i / (R_i + 1 - w_i)  (i < k),   h_k = w_k
    w_i = 1 gives h_i = 1 (R_i > 0 makes that the formula; when R_i = 0 too, the 0/0 case,
    w_{i+1} = 1 follows and a later position is kept for sure, so the value cannot matter).
    p (..., k+1, V), q (..., k, V_q) or None (a point mass: then R_i = w_i (1 - P_{i+1}(X_{i+1})),
    since w_i P <= 1 everywhere), draft (..., k) -> w (..., k+1), h (..., k).
    """
    k = draft.shape[-1]
    p_d, q_d = _at_draft(p, draft), _q_at_draft(q, draft)
    w = [mx.ones(draft.shape[:-1], dtype=p.dtype)]
    for i in range(k):  # k is small: a short chain of lazy ops
        # w p / q, clamped at 1, written so that q = 0 cannot divide (a draft never has q = 0)
        wp = w[-1] * p_d[..., i]
        clamp = (wp >= q_d[..., i]) & (wp > 0)
        w.append(mx.where(clamp, 1.0, wp / mx.maximum(q_d[..., i], 1e-30)))
    ws = mx.stack(w, axis=-1)  # (..., k+1)
    inner = ws[..., 1:k]  # w_1..w_{k-1}
    rows = p[..., 1:k, :]  # P_2..P_k
    if q is None:
        r = inner * (rows.sum(axis=-1) - p_d[..., 1:k])
    else:  # ids past q's width have Q = 0: their w P counts whole
        w_q = q.shape[-1]
        r = mx.maximum(inner[..., None] * rows[..., :w_q] - q[..., 1:k, :], 0.0).sum(axis=-1)
        r = r + inner * rows[..., w_q:].sum(axis=-1)
    h_inner = mx.where(inner >= 1.0, 1.0, r / mx.maximum(r + 1.0 - inner, 1e-30))
    return ws, mx.concatenate([h_inner, ws[..., k:]], axis=-1)


def block_outcome(
    p: mx.array, q: mx.array | None, draft: mx.array, u: mx.array
) -> tuple[mx.array, mx.array]:
    """Block verification, before the final draw: (n, unnormalized next distribution).

    n = tau, the largest i with u_i < h_i (0 if none; ``block_thresholds``); the next token
    comes from max(w_tau P_{tau+1} - Q_{tau+1}, 0) (P_{k+1} when tau = k; tau = 0 gives the
    token-wise residual). Arguments as for accept_block.
    """
    k = draft.shape[-1]
    w, h = block_thresholds(p, q, draft)
    tau = mx.max(mx.where(u < h, mx.arange(1, k + 1), 0), axis=-1)
    scale = mx.take_along_axis(w, tau[..., None], axis=-1)[..., 0]
    return tau, _next_distribution(p, q, draft, tau, scale)


def accept_block(
    p: mx.array, q: mx.array | None, draft: mx.array, u: mx.array, key: mx.array
) -> tuple[mx.array, mx.array]:
    """Block verification (Sun, Mendlovic, Leviathan et al. 2024, arXiv 2403.10444).

    Same arguments and results as accept_sampled, and the same output distribution, but the
    drafted block is judged jointly: a draft the token-wise rule would reject can be kept when
    later drafts make up for it, so the expected number kept is never smaller (the paper
    proves it optimal). The rule is ``block_outcome``, then one draw.
    """
    n, dist = block_outcome(p, q, draft, u)
    return n, sample(dist, key)


def point_mass(tokens: mx.array, vocab: int) -> mx.array:
    """One-hot rows (..., k, V): what q None stands for in the rules (they never build it;
    the tests check the two agree). Acceptance is then p(d) and the residual is p with d
    removed, renormalized."""
    return (tokens[..., None] == mx.arange(vocab, dtype=tokens.dtype)).astype(mx.float32)


RULES: dict[str, Rule] = {"token": accept_sampled, "block": accept_block}
# the rule everything uses unless told otherwise: block keeps the same distribution and never
# fewer drafts in expectation (+2.9% tokens per pass measured, BENCHMARKS.md), for an extra
# (k - 1, V) residual per round that a target pass dwarfs
DEFAULT_VERIFY = "block"


def sampled_rule(verify: str) -> Rule:
    """The sampled acceptance rule called ``verify``: "token" (token-wise) or "block"; the
    one place a verify setting is checked (BadInput for anything else)."""
    if verify not in RULES:
        raise BadInput(f"verify must be one of {', '.join(RULES)}, got {verify!r}")
    return RULES[verify]


def accept_proposal(
    logits: mx.array,
    drafts: mx.array,
    q: mx.array | None,
    process: Callable[[mx.array], mx.array] | None,
    rule: Rule,
    u_key: mx.array | None,
    draw_key: mx.array | None,
) -> tuple[mx.array, mx.array]:
    """One sequence's round, lazy: (n accepted, the next token) from the target's logits at
    the k + 1 verified positions (k + 1, V), the k drafts (k,) and their q (k, V') or None
    (a point mass: no one-hot rows; a narrower q needs no padding). process None is greedy;
    with no drafts the next token is a plain sample; otherwise ``rule`` with uniforms drawn
    from u_key and the next token from draw_key."""
    if process is None:
        return accept_greedy(logits, drafts)
    k = drafts.shape[0]
    if k == 0:
        return mx.array(0), sample(process(logits[0]), draw_key)
    p = process(logits)  # (k + 1, V)
    u = mx.random.uniform(shape=(k,), key=u_key)
    return rule(p, q, drafts, u, draw_key)
