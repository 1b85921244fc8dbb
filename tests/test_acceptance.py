"""Acceptance math and sampling filters on hand-built probability arrays, and both sampled
rules checked exactly: every draft block enumerated, the uniforms integrated out."""

import itertools
import math

import mlx.core as mx
import numpy as np
import pytest

from specmlx.core.acceptance import (
    accept_block,
    accept_greedy,
    accept_sampled,
    block_outcome,
    block_thresholds,
    point_mass,
    sampled_outcome,
    sampled_rule,
)
from specmlx.core.sampling import SamplingParams, make_processor
from specmlx.errors import BadInput

P = [0.5, 0.3, 0.2, 0.0]
Q = [0.1, 0.6, 0.1, 0.2]


def _run(p_rows, q_rows, draft, u, seed=0):
    p = mx.array(p_rows, dtype=mx.float32)
    q = mx.array(q_rows, dtype=mx.float32)
    n, nxt = accept_sampled(
        p, q, mx.array(draft, dtype=mx.uint32), mx.array(u), mx.random.key(seed)
    )
    return int(n.item()), int(nxt.item())


def test_accept_when_u_below_ratio():
    # p(1)/q(1) = 0.3/0.6 = 0.5: accepted for u < 0.5, rejected above
    assert _run([P, P], [Q], [1], [0.49])[0] == 1
    assert _run([P, P], [Q], [1], [0.51])[0] == 0


def test_always_accept_when_p_exceeds_q():
    # p(0)/q(0) = 5 > 1: accepted whatever u is
    assert _run([P, P], [Q], [0], [0.999])[0] == 1


def test_never_accept_token_target_cannot_emit():
    assert _run([P, P], [Q], [3], [0.0])[0] == 0


def test_residual_distribution_is_normalized_max_p_minus_q():
    # rejecting d=1: residual = max(p - q, 0) = [0.4, 0, 0.1, 0] / 0.5 = [0.8, 0, 0.2, 0]
    batch = 20000
    p = mx.broadcast_to(mx.array([P, P]), (batch, 2, 4))
    q = mx.broadcast_to(mx.array([Q]), (batch, 1, 4))
    d = mx.ones((batch, 1), dtype=mx.uint32)
    u = mx.full((batch, 1), 0.99)
    n, nxt = accept_sampled(p, q, d, u, mx.random.key(1))
    assert int(n.sum().item()) == 0
    freq = np.bincount(np.array(nxt), minlength=4) / batch
    np.testing.assert_allclose(freq, [0.8, 0.0, 0.2, 0.0], atol=0.015)


def test_bonus_token_drawn_from_last_target_row():
    # both drafts accepted (p >= q at them), so the bonus comes from p row 2 = one-hot at 3
    p = [[0.1, 0.9, 0, 0], [0.1, 0.9, 0, 0], [0, 0, 0, 1.0]]
    q = [[0.1, 0.9, 0, 0], [0.1, 0.9, 0, 0]]
    assert _run(p, q, [1, 1], [0.5, 0.5]) == (2, 3)


def test_first_rejection_stops_counting():
    p = [[0, 1.0, 0, 0], [1.0, 0, 0, 0], [0, 1.0, 0, 0]]
    q = [[0, 1.0, 0, 0], [0, 0, 1.0, 0]]
    # d2 = 2 rejected (p=0), residual is p row 1 = one-hot at 0
    assert _run(p, q, [1, 2], [0.1, 0.1]) == (1, 0)


def test_point_mass_acceptance_is_p_of_d():
    # lookup proposals: q one-hot, so accept with probability p(d) and the residual is p \ d
    batch = 20000
    q = point_mass(mx.full((batch, 1), 1, dtype=mx.uint32), 4)
    p = mx.broadcast_to(mx.array([P, P]), (batch, 2, 4))
    u = mx.random.uniform(shape=(batch, 1), key=mx.random.key(2))
    n, nxt = accept_sampled(p, q, mx.full((batch, 1), 1, dtype=mx.uint32), u, mx.random.key(3))
    assert abs(float(n.astype(mx.float32).mean().item()) - 0.3) < 0.015
    rejected = np.array(nxt)[np.array(n) == 0]
    freq = np.bincount(rejected, minlength=4) / len(rejected)
    np.testing.assert_allclose(freq, [0.5 / 0.7, 0.0, 0.2 / 0.7, 0.0], atol=0.02)


@pytest.mark.parametrize("rule", [accept_sampled, accept_block], ids=["token", "block"])
def test_greedy_is_the_one_hot_case_of_the_rule(rule):
    rng = np.random.default_rng(0)
    for _ in range(30):
        logits = rng.normal(size=(4, 6)).astype(np.float32)
        draft = rng.integers(0, 6, size=3)
        m = int(rng.integers(0, 4))  # the first m drafts agree with the target
        draft[:m] = logits.argmax(-1)[:m]
        g = accept_greedy(mx.array(logits), mx.array(draft, dtype=mx.uint32))
        onehot_p = np.eye(6, dtype=np.float32)[logits.argmax(-1)]
        onehot_q = np.eye(6, dtype=np.float32)[draft]
        s = rule(
            mx.array(onehot_p),
            mx.array(onehot_q),
            mx.array(draft, dtype=mx.uint32),
            mx.array(rng.uniform(size=3).astype(np.float32)),
            mx.random.key(0),
        )
        assert (int(g[0].item()), int(g[1].item())) == (int(s[0].item()), int(s[1].item()))


def _block(p_rows, q_rows, draft, u, seed=0):
    p = mx.array(p_rows, dtype=mx.float32)
    q = mx.array(q_rows, dtype=mx.float32)
    d = mx.array(draft, dtype=mx.uint32)
    n, nxt = accept_block(p, q, d, mx.array(u), mx.random.key(seed))
    return int(n.item()), int(nxt.item())


# the paper's example: context-free target (1/3, 2/3) and draft (2/3, 1/3) over {a, b}
PAPER_P = [1 / 3, 2 / 3]
PAPER_Q = [2 / 3, 1 / 3]


def test_block_thresholds_by_hand():
    p, q = mx.array([PAPER_P] * 3), mx.array([PAPER_Q] * 2)
    # draft (a, b): w1 = 1/2, w2 = min(1/2 * 2, 1) = 1; R1 = sum max(w1 P - Q, 0) = 0 -> h1 = 0
    w, h = block_thresholds(p, q, mx.array([0, 1], dtype=mx.uint32))
    np.testing.assert_allclose(np.array(w), [1, 0.5, 1], atol=1e-6)
    np.testing.assert_allclose(np.array(h), [0, 1], atol=1e-6)
    # draft (b, a): w1 = 1 -> h1 = 1; w2 = 1/2 = h2
    w, h = block_thresholds(p, q, mx.array([1, 0], dtype=mx.uint32))
    np.testing.assert_allclose(np.array(w), [1, 1, 0.5], atol=1e-6)
    np.testing.assert_allclose(np.array(h), [1, 0.5], atol=1e-6)
    # draft (a, a): w = (1, 1/2, 1/4), R1 = 0; and a draft the target cannot emit: w = 0 after
    w, h = block_thresholds(p, q, mx.array([0, 0], dtype=mx.uint32))
    np.testing.assert_allclose(np.array(h), [0, 0.25], atol=1e-6)
    p0 = mx.array([[1.0, 0.0], [0.5, 0.5], [0.5, 0.5]])
    w, h = block_thresholds(p0, q, mx.array([1, 1], dtype=mx.uint32))
    np.testing.assert_allclose(np.array(w), [1, 0, 0], atol=1e-6)
    np.testing.assert_allclose(np.array(h), [0, 0], atol=1e-6)


def test_block_keeps_a_block_token_wise_rejects():
    # draft (a, b): token-wise rejects a for u1 >= 1/2; block keeps both whatever u is, since
    # b makes up for a (w2 = 1), and draws the bonus from the last row
    p = [PAPER_P, PAPER_P, [0, 1.0]]
    assert _run(p, [PAPER_Q] * 2, [0, 1], [0.9, 0.9]) == (0, 1)  # residual (0, 1/3) -> b
    for u in ([0.9, 0.9], [0.0, 0.99], [0.6, 0.3]):
        assert _block(p, [PAPER_Q] * 2, [0, 1], u) == (2, 1)


def test_block_stops_at_the_largest_position_under_its_threshold():
    p = [PAPER_P, PAPER_P, [0, 1.0]]
    # draft (b, a): h = (1, 1/2). u2 < 1/2 keeps both; u2 >= 1/2 keeps b, and the next token
    # comes from max(w1 P2 - Q2, 0) = max((1/3, 2/3) - (2/3, 1/3), 0) -> b
    assert _block(p, [PAPER_Q] * 2, [1, 0], [0.99, 0.4]) == (2, 1)
    assert _block(p, [PAPER_Q] * 2, [1, 0], [0.0, 0.6]) == (1, 1)
    # draft (a, a): h = (0, 1/4). Nothing kept for u2 >= 1/4: the token-wise residual -> b
    assert _block(p, [PAPER_Q] * 2, [0, 0], [0.0, 0.3]) == (0, 1)
    assert _block(p, [PAPER_Q] * 2, [0, 0], [0.9, 0.2]) == (2, 1)


def test_block_with_point_mass_drafts_matches_its_closed_form():
    # lookup proposals (q one-hot): w_i = p_1(d_1)...p_i(d_i), h_i = (w_i - w_{i+1}) / (1 - w_{i+1})
    p = np.array([[0.5, 0.3, 0.2], [0.2, 0.6, 0.2], [0.1, 0.1, 0.8]], dtype=np.float32)
    d = mx.array([1, 1], dtype=mx.uint32)
    w, h = block_thresholds(mx.array(p), point_mass(d, 3), d)
    np.testing.assert_allclose(np.array(w), [1, 0.3, 0.18], rtol=1e-5)
    np.testing.assert_allclose(np.array(h), [(0.3 - 0.18) / (1 - 0.18), 0.18], rtol=1e-5)


def test_sampled_rule_names_the_two_rules():
    assert sampled_rule("token") is accept_sampled and sampled_rule("block") is accept_block
    with pytest.raises(BadInput, match="verify"):
        sampled_rule("blocks")


# ------------------------------------------------- exact check by enumeration


def _tree(rng, vocab, depth, zeros):
    """A random next-token distribution after every prefix of length 0..depth; ``zeros``
    knocks out entries, as top-k/top-p/min-p filters do (never all of a row)."""
    tree = {}
    for length in range(depth + 1):
        for prefix in itertools.product(range(vocab), repeat=length):
            x = np.exp(rng.normal(size=vocab) * rng.uniform(0.5, 3.0))
            if zeros:
                x[rng.random(vocab) < 0.3] = 0.0
                x[rng.integers(vocab)] += 0.1
            tree[prefix] = (x / x.sum()).astype(np.float32)
    return tree


def _paper_tree(row, depth):
    return {
        pre: np.array(row, dtype=np.float32)
        for length in range(depth + 1)
        for pre in itertools.product(range(2), repeat=length)
    }


def exact_round(rule, P, Q, vocab, k):
    """One round over every draft block (weighted by Q) and every pattern of which uniforms
    fall under their thresholds (weighted by the thresholds), with the next token's exact
    distribution: returns ({emitted prefix: probability}, E[drafts kept]).

    Both rules depend on u only through the events u_i < a_i (a_i: min(1, p/q) token-wise,
    h_i for blocks), so u_i = a_i / 2 or (1 + a_i) / 2 stands for each event."""
    drafts = [x for x in itertools.product(range(vocab), repeat=k)]
    p = np.stack([[P[x[:j]] for j in range(k + 1)] for x in drafts])  # (D, k+1, V)
    q = np.stack([[Q[x[:j]] for j in range(k)] for x in drafts])  # (D, k, V)
    d = np.array(drafts)
    q_x = np.take_along_axis(q, d[..., None], -1)[..., 0]  # (D, k)
    p_x = np.take_along_axis(p[:, :k], d[..., None], -1)[..., 0]
    if rule == "block":
        a = np.array(block_thresholds(mx.array(p), mx.array(q), mx.array(d, dtype=mx.uint32))[1])
    else:
        a = np.minimum(1.0, p_x / np.maximum(q_x, 1e-30))
    patterns = np.array(list(itertools.product([True, False], repeat=k)))  # (2^k, k)
    u = np.where(patterns[None], a[:, None] / 2, (1 + a[:, None]) / 2)  # (D, 2^k, k)
    weight = np.prod(np.where(patterns[None], a[:, None], 1 - a[:, None]), -1)  # (D, 2^k)
    weight *= np.prod(q_x, -1)[:, None]
    outcome = block_outcome if rule == "block" else sampled_outcome
    rep = lambda x: mx.array(np.repeat(x, len(patterns), axis=0))  # noqa: E731
    n, dist = outcome(
        rep(p), rep(q), rep(d).astype(mx.uint32), mx.array(u.reshape(-1, k).astype(np.float32))
    )
    n, dist = np.array(n), np.array(dist, dtype=np.float64)
    dist /= dist.sum(-1, keepdims=True)
    emitted: dict[tuple, float] = {}
    for row, (m, nn_) in enumerate(zip(weight.reshape(-1), n, strict=True)):
        prefix = tuple(int(t) for t in d[row // len(patterns), :nn_])
        for y in np.flatnonzero(dist[row]):
            s = prefix + (int(y),)
            emitted[s] = emitted.get(s, 0.0) + m * dist[row, y]
    mean_kept = float((weight.reshape(-1) * n).sum())
    return emitted, mean_kept


def completed(emitted, P, vocab, length):
    """Continue every emitted prefix with the target to ``length`` tokens: the distribution
    of whole sequences, as decoding would go on after the round."""
    out = np.zeros((vocab,) * length)
    for s, m in emitted.items():
        for rest in itertools.product(range(vocab), repeat=length - len(s)):
            seq, prob = s + rest, m
            for j in range(len(s), length):
                prob *= P[seq[:j]][seq[j]]
            out[seq] += prob
    return out


def target_joint(P, vocab, length):
    out = np.zeros((vocab,) * length)
    for seq in itertools.product(range(vocab), repeat=length):
        out[seq] = np.prod([P[seq[:j]][seq[j]] for j in range(length)])
    return out


def test_the_papers_example_exactly():
    """Sun et al.'s motivating example: 10/9 drafts kept token-wise, 11/9 by blocks."""
    P, Q = _paper_tree(PAPER_P, 2), _paper_tree(PAPER_Q, 2)
    joint = target_joint(P, 2, 3)
    kept = {}
    for rule in ("token", "block"):
        emitted, kept[rule] = exact_round(rule, P, Q, 2, 2)
        np.testing.assert_allclose(completed(emitted, P, 2, 3), joint, atol=1e-6)
    assert kept["token"] == pytest.approx(10 / 9, abs=1e-6)
    assert kept["block"] == pytest.approx(11 / 9, abs=1e-6)


@pytest.mark.parametrize(
    "seed,vocab,k,zeros",
    [(0, 4, 2, False), (1, 4, 3, False), (2, 4, 3, True), (3, 3, 3, True), (4, 4, 1, True)],
)
def test_both_rules_emit_the_target_distribution_exactly(seed, vocab, k, zeros):
    """Every draft block and every outcome of the uniforms, summed with their probabilities:
    the round's output, continued by the target, is the target's joint distribution, and
    blocks keep at least as many drafts in expectation as token-wise verification."""
    rng = np.random.default_rng(seed)
    P, Q = _tree(rng, vocab, k, zeros), _tree(rng, vocab, k, zeros)
    joint = target_joint(P, vocab, k + 1)
    kept = {}
    for rule in ("token", "block"):
        emitted, kept[rule] = exact_round(rule, P, Q, vocab, k)
        np.testing.assert_allclose(completed(emitted, P, vocab, k + 1), joint, atol=2e-6)
    assert kept["block"] >= kept["token"] - 1e-6, kept
    if k == 1:  # one draft: the block is the token, and so are the rules
        assert kept["block"] == pytest.approx(kept["token"], abs=1e-6)


def test_top_k_and_top_p_masking_applied_identically():
    logits = mx.log(mx.array([[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]]))
    top_k = make_processor(SamplingParams(temperature=1.0, top_k=2))(logits)
    np.testing.assert_allclose(np.array(top_k), [[4 / 7, 3 / 7, 0, 0], [0, 0, 3 / 7, 4 / 7]], 1e-5)
    # top-p 0.6: smallest set whose mass reaches 0.6 is {0.4, 0.3}
    top_p = make_processor(SamplingParams(temperature=1.0, top_p=0.6))(logits)
    np.testing.assert_allclose(np.array(top_p), [[4 / 7, 3 / 7, 0, 0], [0, 0, 3 / 7, 4 / 7]], 1e-5)
    min_p = make_processor(SamplingParams(temperature=1.0, min_p=0.6))(logits)
    np.testing.assert_allclose(np.array(min_p), [[4 / 7, 3 / 7, 0, 0], [0, 0, 3 / 7, 4 / 7]], 1e-5)


def test_temperature_sharpens():
    logits = mx.array([[1.0, 0.0]])
    probs = np.array(make_processor(SamplingParams(temperature=0.5))(logits))[0]
    assert math.isclose(probs[0], 1 / (1 + math.exp(-2)), rel_tol=1e-5)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -1.0},
        {"temperature": float("nan")},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -1},
        {"min_p": 1.0},
    ],
)
def test_bad_sampling_params_are_refused(kwargs):
    with pytest.raises(BadInput):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("outcome", [sampled_outcome, block_outcome], ids=["token", "block"])
def test_a_point_mass_and_a_narrow_q_need_no_dense_rows(outcome):
    # q None stands for one-hot rows at the drafts, and a q narrower than p for q padded with
    # zeros: both give the same (n, next distribution) as the dense arrays, for every u
    rng = np.random.default_rng(4)
    batch, k, v, w = 2000, 2, 7, 5
    p = rng.dirichlet(np.ones(v) * 0.5, size=(batch, k + 1)).astype(np.float32)
    q = rng.dirichlet(np.ones(w) * 0.5, size=(batch, k)).astype(np.float32)
    d = np.stack([[rng.choice(w, p=q[b, i]) for i in range(k)] for b in range(batch)])
    d, u = mx.array(d, dtype=mx.uint32), mx.array(rng.uniform(size=(batch, k)), mx.float32)
    p = mx.array(p)
    dense = mx.concatenate([mx.array(q), mx.zeros((batch, k, v - w))], axis=-1)
    pairs = [(None, point_mass(d, v)), (mx.array(q), dense)]
    for light, heavy in pairs:
        n1, r1 = outcome(p, light, d, u)
        n2, r2 = outcome(p, heavy, d, u)
        assert np.array_equal(np.array(n1), np.array(n2))
        np.testing.assert_allclose(np.array(r1), np.array(r2), atol=1e-6)
        assert 0 < int((np.array(n1) < k).sum()) < batch  # rejections and full blocks both
