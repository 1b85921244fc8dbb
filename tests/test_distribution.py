"""Speculative sampling reproduces the target's distribution: chi-square on the joint
distribution of the first two tokens, from 20,000 rounds batched through the engine's own
drafting, processing and acceptance functions (the same ones a B=1 round calls); and on whole
three-token sequences generated one by one through the public generate_tokens, with top-k,
top-p and min-p on, under per-token stopping and through a sliding window, a recurrent state
and Mamba 2's. Each chi-square is beside a control that a wrong rule fails. Each drafter
kind's own whole-sequence test (a draft model, lookup, heads, a batch's rows) is
test_drafter_kinds.py's."""

import mlx.core as mx
import numpy as np
import pytest
from families import build, noisy_copy
from helpers import RecurrentTableLM, TableLM, WindowTableLM, make_tiny
from kit_distribution import (
    JOINT_SAMPLING,
    JV,
    REJECT_P,
    engine_sequences,
    pooled_chi2,
    rejects,
    sequence_joint,
)
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from specmlx.core import caches
from specmlx.core.acceptance import accept_sampled, point_mass
from specmlx.core.recurrent import PassRecorder
from specmlx.core.sampling import SamplingParams, make_processor, sample
from specmlx.core.stats import KChooser
from specmlx.drafting.drafters import draft_model_propose
from specmlx.drafting.lookup.memory import lookup_propose

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


def _feeder(model, cache):
    """draft_model_propose's ``feed`` over a bare batched cache (no cursor: the test trims)."""
    return lambda x: model(x, cache=cache)


def speculative_first_two(target, draft, process, key, drafter="model", rule=accept_sampled):
    """Two batched rounds with uniform cache trims; rows that got only one token in round 1
    take their second token from round 2 (a draft-model round, with a 2-token catch-up when
    round 1 was a lookup round)."""
    k1, k2, k3, k4 = mx.random.split(key, 4)
    tcache = _prefilled(target, N)
    dcache = _prefilled(draft, N)
    last = mx.full((N, 1), PROMPT[-1], dtype=mx.uint32)
    if drafter == "model":
        d, q, _ = draft_model_propose(_feeder(draft, dcache), last, K, V, process, k1)
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
    d2, q2, _ = draft_model_propose(_feeder(draft, dcache), x, K, V, process, k3)
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
@pytest.mark.parametrize("drafter", ["model", "lookup"])
def test_chi_square_rejects_a_wrong_rule(pair, params, drafter):
    target, draft = pair
    process = make_processor(params)
    joint = exact_joint(target, process)
    t1, t2, _ = speculative_first_two(
        target, draft, process, mx.random.key(0), drafter, accept_everything
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


# ------------------------------------------- whole sequences through the public API

# generations per test (the engine's per-round MLX ops make most of each one's time): 12,000
# over the 154 possible sequences keeps every cell's expected count high for the pooled
# chi-square, at four times the generations that show each wrong rule below at p < 1e-6; the
# exact enumeration in test_acceptance.py carries the fine math
N_JOINT = 7_500  # 2.5x the control's count, as each drafter kind's (test_drafter_kinds)
N_WRONG = 3_000  # a wrong rule is far off: fewer generations show it


@pytest.fixture(scope="module")
def small_pair():
    """A table target and a draft with a noisy table: the draft's first proposal is kept
    about two times in three."""
    target = TableLM(JV, seed=20, scale=0.5)
    draft = TableLM(JV, seed=20, scale=0.5)
    draft.table = target.table + 0.5 * mx.random.normal(target.table.shape, key=mx.random.key(7))
    mx.eval(target.table, draft.table)
    return target, draft


def test_the_table_model_reads_its_cache(small_pair):
    """What makes the sequence tests catch a bad rollback: fed through its cache, the table
    model predicts as from the whole context, and a cache left one token long does not."""
    target, _ = small_pair
    whole = target(mx.array([[3, 5, 1]]))[0, -1]
    cache = make_prompt_cache(target)
    target(mx.array([[3, 5]]), cache=cache)
    assert mx.array_equal(target(mx.array([[1]]), cache=cache)[0, -1], whole)
    trim_prompt_cache(cache, 1)  # drop the 1: the cache holds [3, 5] again, as after a rollback
    assert mx.array_equal(target(mx.array([[1]]), cache=cache)[0, -1], whole)
    stale = make_prompt_cache(target)
    target(mx.array([[3, 5, 2]]), cache=stale)  # a draft (2) that was never rolled back
    assert not mx.array_equal(target(mx.array([[1]]), cache=stale)[0, -1], whole)


class ConfidencePlan(KChooser):
    """A k chooser with per-token stopping by a fixed confidence threshold: start each round
    with one draft, draft on while the last draft's confidence is at least ``bar``. With
    ``own`` it also drops a draft for its own low confidence: the wrong way to stop."""

    plans = True

    def __init__(self, bar: float, own: bool = False):
        self.bar, self.own = bar, own

    def __call__(self, _last) -> int:
        return 1

    def draft_plan(self, confidences, drafted=0):
        m = len(confidences)
        if m == 0 or confidences[-1] >= self.bar:
            return m, 1
        return (m - 1 if self.own else m), 0


def test_per_token_stopping_keeps_the_joint(small_pair):
    """Per-token stopping decides each draft's fate from the confidences before it: whole
    sequences still follow the target's joint distribution (every path taken)."""
    target, draft = small_pair
    joint = sequence_joint(target, make_processor(JOINT_SAMPLING))
    counts, kept = engine_sequences(
        target, draft, "token", N_JOINT, k=ConfidencePlan(0.25), draft_stop=True
    )
    assert pooled_chi2(counts, joint) > 1e-3
    assert all(kept > 0.05 * kept.sum()), kept


def test_the_sequence_test_rejects_stopping_on_a_drafts_own_confidence(small_pair):
    target, draft = small_pair
    joint = sequence_joint(target, make_processor(JOINT_SAMPLING))
    plan = ConfidencePlan(0.25, own=True)
    made = lambda n, first: engine_sequences(  # noqa: E731
        target, draft, "token", n, k=plan, draft_stop=True, first=first
    )[0]
    assert rejects(made, N_WRONG, joint) < REJECT_P


# ------------------------------- the same through a sliding window and a recurrent state

KIND_PROMPT = [3, 5, 1, 3]  # past the window of 2: the ring has wrapped before round one
# their controls reject at their first look (375 generations, p = 0 at 1f7a71a): 1,000 caps
# them, and 2.5x that tests the right rollback
N_KIND, N_KIND_WRONG = 2_500, 1_000


@pytest.fixture(scope="module", params=["window", "recurrent"])
def kind_pair(request):
    """Table models whose context lives in a sliding-window cache or a recurrent state, a
    target and a noisy draft of the same kind: each rolls back in its own way."""
    cls = {"window": WindowTableLM, "recurrent": RecurrentTableLM}[request.param]
    target, draft = cls(JV, seed=20, scale=0.5), cls(JV, seed=20, scale=0.5)
    draft.table = target.table + 0.5 * mx.random.normal(target.table.shape, key=mx.random.key(7))
    mx.eval(target.table, draft.table)
    return request.param, target, draft


def test_window_and_recurrent_sequences_follow_the_target_joint(kind_pair):
    _, target, draft = kind_pair
    joint = sequence_joint(target, make_processor(JOINT_SAMPLING), KIND_PROMPT)
    counts, kept = engine_sequences(target, draft, "block", N_KIND, prompt=KIND_PROMPT)
    assert pooled_chi2(counts, joint) > 1e-3
    assert all(kept > 0.05 * kept.sum()), kept


def test_the_kind_test_rejects_a_wrong_rollback(kind_pair, monkeypatch):
    """The old behaviour for windows (mlx-lm's rotating cache trimmed as if nothing had left
    the ring) and, for recurrent state, a restore that keeps the advanced state."""
    kind, target, draft = kind_pair
    joint = sequence_joint(target, make_processor(JOINT_SAMPLING), KIND_PROMPT)
    if kind == "window":
        monkeypatch.setattr(caches, "_convert", lambda c, slack: c)
        monkeypatch.setattr(caches, "_trimmable", lambda c, n: True)
    else:
        monkeypatch.setattr(caches, "restore", lambda cache, snap, offset: None)
    made = lambda n, first: engine_sequences(  # noqa: E731
        target, draft, "block", n, prompt=KIND_PROMPT, first=first
    )[0]
    assert rejects(made, N_KIND_WRONG, joint) < REJECT_P


# a real family: mlx-lm's Mamba 2, whose rollback recomputes the SSM state from the recorded
# verify pass (specmlx/core/recurrent.py); ~8 ms a generation, so fewer than the table models
MAMBA_PROMPT = [3, 5, 1, 3, 6, 2]
N_MAMBA = 2_000  # 2.5x the control's cap; the control rejected at its first look (250, p = 0)
N_MAMBA_WRONG = 800


@pytest.fixture(scope="module")
def mamba_pair():
    target = build("mamba2", 2, 0, 1.0, vocab=JV)
    return target, noisy_copy("mamba2", 2, 0, 0.3, 1.0, vocab=JV)


def test_mamba2_sequences_follow_the_target_joint(mamba_pair):
    target, draft = mamba_pair
    joint = sequence_joint(target, make_processor(JOINT_SAMPLING), MAMBA_PROMPT)
    counts, kept = engine_sequences(target, draft, "block", N_MAMBA, prompt=MAMBA_PROMPT)
    assert pooled_chi2(counts, joint) > 1e-3
    assert all(kept > 0.05 * kept.sum()), kept


def test_the_mamba2_test_rejects_a_state_left_advanced(mamba_pair, monkeypatch):
    target, draft = mamba_pair
    joint = sequence_joint(target, make_processor(JOINT_SAMPLING), MAMBA_PROMPT)
    monkeypatch.setattr(PassRecorder, "settle", lambda self, m, states: True)
    made = lambda n, first: engine_sequences(  # noqa: E731
        target, draft, "block", n, prompt=MAMBA_PROMPT, first=first
    )[0]
    assert rejects(made, N_MAMBA_WRONG, joint) < REJECT_P
