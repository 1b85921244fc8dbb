"""Speculative sampling reproduces the target's distribution: chi-square on the joint
distribution of the first two tokens, from 20,000 rounds batched through the engine's own
drafting, processing and acceptance functions (the same ones a B=1 round calls)."""

import mlx.core as mx
import numpy as np
import pytest
from helpers import make_tiny
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
from scipy.stats import chisquare

from specmlx.acceptance import accept_sampled, point_mass
from specmlx.drafters import draft_model_propose, lookup_propose
from specmlx.engine import generate_tokens
from specmlx.sampling import SamplingParams, make_processor, sample
from specmlx.stats import Stats

V = 12
N = 20_000
K = 2
PROMPT = [3, 4, 5, 6, 3, 4]  # lookup proposes [5, 6]


@pytest.fixture(scope="module")
def pair():
    """A target and a related draft: the target's weights with a noisy output head, so the
    two agree often but not always (as a real smaller sibling would)."""
    target = make_tiny(10, vocab=V, hidden=16, sharpen=3.0)
    draft = make_tiny(10, vocab=V, hidden=16, sharpen=3.0)
    w = draft.lm_head.weight
    draft.lm_head.weight = w + 0.8 * w.std() * mx.random.normal(w.shape, key=mx.random.key(7))
    mx.eval(draft.parameters())
    return target, draft


def exact_joint(target, process):
    """P(t1, t2 | prompt) by enumeration: (V, V)."""
    p1 = np.array(process(target(mx.array([PROMPT]))[0, -1]))
    ctx = mx.concatenate(
        [mx.broadcast_to(mx.array(PROMPT), (V, len(PROMPT))), mx.arange(V)[:, None]], 1
    )
    p2 = np.array(process(target(ctx)[:, -1]))  # (V, V): row t1
    joint = p1[:, None].astype(np.float64) * p2
    return joint / joint.sum()


def _prefilled(model, batch):
    cache = make_prompt_cache(model)
    model(mx.broadcast_to(mx.array(PROMPT[:-1]), (batch, len(PROMPT) - 1)), cache=cache)
    return cache


def _verify(target, tcache, last, d, q, process, key):
    ku, kr = mx.random.split(key)
    logits = target(mx.concatenate([last, d], axis=1), cache=tcache)  # (B, k+1, V)
    u = mx.random.uniform(shape=d.shape, key=ku)
    return accept_sampled(process(logits), q, d, u, kr)


def speculative_first_two(target, draft, process, key, drafter="model", rule=accept_sampled):
    """Two batched rounds with uniform cache trims; rows that got only one token in round 1
    take their second token from round 2 (a draft-model round, with a 2-token catch-up when
    round 1 was a lookup round)."""
    k1, k2, k3, k4 = mx.random.split(key, 4)
    tcache = _prefilled(target, N)
    dcache = _prefilled(draft, N)
    last = mx.full((N, 1), PROMPT[-1], dtype=mx.uint32)
    if drafter == "model":
        d, q = draft_model_propose(draft, dcache, last, K, V, process, k1)
        pending = None  # draft saw PROMPT[-1] and d1; rows needing round 2 trim back to PROMPT
    else:
        prop = lookup_propose(PROMPT, K)
        assert prop == [5, 6]
        d = mx.broadcast_to(mx.array(prop, dtype=mx.uint32), (N, K))
        q = point_mass(d, V)
        pending = last  # the draft model has not seen PROMPT[-1] yet
    n, nxt = rule(target, tcache, last, d, q, process, k2)
    t1 = mx.where(n >= 1, d[:, 0], nxt)
    t2_round1 = mx.where(n >= 2, d[:, 1], nxt)
    # round 2 for rows with n == 0: the context is PROMPT + t1
    trim_prompt_cache(tcache, K)
    if pending is None:
        trim_prompt_cache(dcache, K - 1)
        x = t1[:, None]
    else:
        x = mx.concatenate([pending, t1[:, None]], axis=1)
    d2, q2 = draft_model_propose(draft, dcache, x, K, V, process, k3)
    n2, nxt2 = rule(target, tcache, t1[:, None], d2, q2, process, k4)
    t2_round2 = mx.where(n2 >= 1, d2[:, 0], nxt2)
    t2 = mx.where(n >= 1, t2_round1, t2_round2)
    return np.array(t1), np.array(t2), np.array(n)


def leviathan(target, tcache, last, d, q, process, key):
    return _verify(target, tcache, last, d, q, process, key)


def accept_everything(target, tcache, last, d, q, process, key):
    """A deliberately wrong rule: keep every draft token, bonus from p."""
    logits = target(mx.concatenate([last, d], axis=1), cache=tcache)
    n = mx.full((d.shape[0],), d.shape[1])
    return n, sample(process(logits[:, -1]), key)


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


def chi2_pvalue(t1, t2, joint):
    return pooled_chi2(np.bincount(t1 * V + t2, minlength=V * V), joint.reshape(-1))


SETTINGS = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.8)]


@pytest.mark.parametrize("params", SETTINGS, ids=["temp1", "top_p0.8"])
@pytest.mark.parametrize("drafter", ["model", "lookup"])
def test_speculative_sampling_matches_target(pair, params, drafter):
    target, draft = pair
    process = make_processor(params)
    joint = exact_joint(target, process)
    t1, t2, n = speculative_first_two(target, draft, process, mx.random.key(0), drafter, leviathan)
    assert chi2_pvalue(t1, t2, joint) > 1e-3
    assert 0 < (n == 0).mean() < 1  # both the accept and the residual paths were exercised


@pytest.mark.parametrize("params", SETTINGS, ids=["temp1", "top_p0.8"])
def test_chi_square_rejects_a_wrong_rule(pair, params):
    target, draft = pair
    process = make_processor(params)
    joint = exact_joint(target, process)
    t1, t2, _ = speculative_first_two(
        target, draft, process, mx.random.key(0), "model", accept_everything
    )
    assert chi2_pvalue(t1, t2, joint) < 1e-6


def test_acceptance_beats_exact_token_matching(pair):
    """mlx-lm keeps a draft token only if the target samples the same one: sum p*q.
    The Leviathan rule accepts with sum min(p, q), never less."""
    target, draft = pair
    process = make_processor(SamplingParams(temperature=1.0))
    _, _, n = speculative_first_two(target, draft, process, mx.random.key(1), "model", leviathan)
    ours = (n >= 1).mean()
    p = np.array(process(target(mx.array([PROMPT]))[0, -1]))
    q = np.array(process(draft(mx.array([PROMPT]))[0, -1]))
    exact_match = float((p * q).sum())
    assert abs(ours - np.minimum(p, q).sum()) < 0.02
    assert ours > exact_match + 0.05, (ours, exact_match)


def test_engine_first_token_distribution(pair):
    """The engine itself (B = 1, hybrid lookup + draft) over 1,500 seeds: first-token chi-square."""
    target, draft = pair
    process = make_processor(SamplingParams(temperature=1.0))
    p1 = np.array(process(target(mx.array([PROMPT]))[0, -1]))
    firsts = []
    for seed in range(1500):
        ev = next(
            iter(
                generate_tokens(
                    target,
                    draft,
                    PROMPT,
                    num_draft=K,
                    lookup=True,
                    sampling=SamplingParams(1.0),
                    max_tokens=2,
                    seed=seed,
                    stats=Stats(),
                )
            )
        )
        firsts.append(ev.token)
    assert pooled_chi2(np.bincount(firsts, minlength=V), p1) > 1e-3
