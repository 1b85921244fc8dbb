"""Acceptance math and sampling filters on hand-built probability arrays."""

import math

import mlx.core as mx
import numpy as np
import pytest

from specmlx.acceptance import accept_greedy, accept_sampled, point_mass
from specmlx.errors import BadInput
from specmlx.sampling import SamplingParams, make_processor

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


def test_greedy_is_the_one_hot_case_of_the_rule():
    rng = np.random.default_rng(0)
    for _ in range(20):
        logits = rng.normal(size=(4, 6)).astype(np.float32)
        draft = rng.integers(0, 6, size=3)
        m = int(rng.integers(0, 4))  # the first m drafts agree with the target
        draft[:m] = logits.argmax(-1)[:m]
        g = accept_greedy(mx.array(logits), mx.array(draft, dtype=mx.uint32))
        onehot_p = np.eye(6, dtype=np.float32)[logits.argmax(-1)]
        onehot_q = np.eye(6, dtype=np.float32)[draft]
        s = accept_sampled(
            mx.array(onehot_p),
            mx.array(onehot_q),
            mx.array(draft, dtype=mx.uint32),
            mx.array(rng.uniform(size=3).astype(np.float32)),
            mx.random.key(0),
        )
        assert (int(g[0].item()), int(g[1].item())) == (int(s[0].item()), int(s[1].item()))


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
