"""Bench math and the adaptive-k chooser on synthetic numbers (no timing asserted)."""

import copy
import random
import statistics

import pytest
from tiny import make_tiny

from specmlx.adaptive import AdaptiveK, best_k, expected_tokens, remember, remembered
from specmlx.bench import (
    BenchSettings,
    Run,
    System,
    _timed,
    spread,
    summarize,
    theoretical_speedup,
)
from specmlx.engine import Stats, generate_tokens


def test_theoretical_speedup_formula():
    # a = 0.8, k = 4, c = 0.1: (1 - 0.8^5) / (0.2 * 1.4)
    assert theoretical_speedup(0.8, 4, 0.1) == pytest.approx((1 - 0.8**5) / (0.2 * 1.4))
    assert theoretical_speedup(1.0, 3, 0.0) == 4.0  # everything accepted, free draft
    assert theoretical_speedup(0.0, 5, 0.2) == pytest.approx(1 / 2.0)  # useless draft costs
    assert theoretical_speedup(0.5, 0, 0.3) == 1.0


def test_decode_timing_starts_at_the_first_target_token():
    tokens, decoded, secs = _timed([(5, True), (6, False), (7, True), (8, False)])
    assert tokens == [5, 6, 7, 8] and decoded == 2 and secs >= 0.0
    # a short budget filled by accepted drafts alone, or an immediate EOS: nothing to time
    assert _timed([(1, True), (2, True)]) == ([1, 2], 0, 0.0)
    assert _timed([]) == ([], 0, 0.0)


def test_spread_is_median_min_max():
    assert spread([3.0, 1.0, 2.0, 10.0]) == {"median": 2.5, "min": 1.0, "max": 10.0}


def test_summarize_rows_speedup_and_efficiency():
    s = BenchSettings(ks=[2], temps=[0.0], repeats=2, compare_mlx_lm=False)
    base, spec = System("target-only", "none", 0), System("specmlx", "d", 2)
    runs = []
    for rep, (tb, ts) in enumerate([(10.0, 5.0), (12.0, 5.0)]):
        # 100 tokens each; specmlx accepted 60 of 80 drafted in 40 passes
        runs.append(Run(base.label, "p", 0.0, rep, list(range(100)), 100, tb, 0, 0))
        runs.append(Run(spec.label, "p", 0.0, rep, list(range(100)), 100, ts, 80, 60))
    rows = summarize(runs, [base, spec], s, c=0.1)
    row = rows[1]
    assert row["tokens_per_sec"] == 20.0 and row["tokens_per_sec_min"] == 20.0
    assert row["speedup"] == pytest.approx(2.2)  # the median of 20/10 and 20/(100/12)
    assert row["acceptance_rate"] == 0.75 and row["tokens_per_pass"] == 2.5
    theory = theoretical_speedup(0.75, 2, 0.1)
    assert row["theoretical_speedup"] == pytest.approx(theory)
    assert row["efficiency"] == pytest.approx(row["speedup"] / theory)
    assert row["identical_to_target"] is True


def test_expected_tokens():
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.0, 8) == 1.0


def test_chooser_flat_curve_high_acceptance_picks_large_k():
    assert best_k(0.9, 0.05, [1.0 + 0.02 * k for k in range(9)], 8) >= 6


def test_chooser_steep_curve_or_low_acceptance_picks_zero():
    assert best_k(0.9, 0.05, [1.0 + 1.0 * k for k in range(9)], 8) == 0
    assert best_k(0.05, 0.1, [1.0 + 0.02 * k for k in range(9)], 8) == 0
    assert best_k(0.5, 2.0, [1.0] * 9, 8) == 0  # draft dearer than the target


def test_chooser_learns_from_rounds():
    chooser = AdaptiveK(k_max=8)
    stats = Stats()
    assert chooser(stats) == 2  # nothing measured yet
    for _ in range(30):  # every draft accepted, draft at 0.3 of a step, flat verify curve
        k = chooser(stats)
        stats.rounds += 1
        stats.last_k, stats.last_accepted = k, k
        stats.last_draft_s, stats.last_round_s = 0.03 * k, 0.1 + 0.031 * k
    assert chooser(stats) >= 6
    ks = []
    for _ in range(120):  # now nothing is accepted
        ks.append(chooser(stats))
        stats.rounds += 1
        stats.last_k, stats.last_accepted = ks[-1], 0
        stats.last_draft_s, stats.last_round_s = None, 0.1 + 0.031 * ks[-1]
    # ~30 trials of memory: a few misses do not end drafting, a long run of them does; near
    # break-even it may still draft now and then
    assert all(k > 0 for k in ks[:5]), ks
    assert ks[-60:].count(0) >= 48, ks


def _steady(chooser, stats, rounds, accept, draft_s=0.03, verify=lambda k: 0.1 + 0.005 * k):
    """Feed ``rounds`` rounds: each draft accepted with probability ``accept`` (seeded), the
    drafting timed apart on one drafting round in eight, as the engine does. Returns the ks."""
    rng = random.Random(0)
    ks = []
    for _ in range(rounds):
        k = chooser(stats)
        ks.append(k)
        n = next((i for i in range(k) if rng.random() >= accept), k)  # leading acceptances
        timed = k > 0 and (stats.timed_rounds == 0 or rng.random() < 1 / 8)
        stats.rounds += 1
        stats.timed_rounds += timed
        stats.last_k, stats.last_accepted = k, n
        stats.last_round_s = draft_s * k + verify(k)
        stats.last_draft_s = draft_s * k if timed else None
    return ks


def test_chooser_learns_draft_time_from_the_timed_rounds():
    chooser, stats = AdaptiveK(), Stats()
    _steady(chooser, stats, 48, accept=0.75)
    assert chooser.t_draft == pytest.approx(0.03, rel=0.05)


def test_one_slow_round_does_not_move_the_plan():
    chooser, stats = AdaptiveK(neighbor_every=0), Stats()
    _steady(chooser, stats, 30, accept=0.75)
    twin, twin_stats = copy.deepcopy(chooser), copy.deepcopy(stats)
    _steady(twin, twin_stats, 1, accept=0.75)
    slow = copy.deepcopy(stats)
    _steady(chooser, slow, 1, accept=0.75, verify=lambda k: 1.0)  # descheduled for a second
    assert chooser(slow) == twin(twin_stats)
    # the slow round counts as at most 2x the prediction, then is averaged in
    assert chooser.verify_curve()[0] < 1.25 * twin.verify_curve()[0]


def test_verify_times_follow_the_machine_at_every_k():
    """The curve is one level times a shape: rounds at k = 4 update t_verify(0) too, so a
    slowdown is not mistaken for speculation getting cheaper relative to plain steps."""
    chooser, stats = AdaptiveK(neighbor_every=0), Stats()
    _steady(chooser, stats, 40, accept=1.0)
    t0 = chooser.verify_curve()[0]
    _steady(chooser, stats, 40, accept=1.0, draft_s=0.06, verify=lambda k: 0.2 + 0.01 * k)
    assert chooser.verify_curve()[0] == pytest.approx(2 * t0, rel=0.1)


def test_chooser_tries_the_neighbours_of_its_k():
    chooser, stats = AdaptiveK(neighbor_every=4), Stats()
    ks = _steady(chooser, stats, 40, 0.75, draft_s=0.01, verify=lambda k: 0.1 + 0.002 * k)
    settled = max(set(ks[8:]), key=ks[8:].count)
    assert settled > 1 and {settled - 1, settled + 1} <= set(ks[8:]), ks


def _useless(chooser, stats, rounds):
    """Feed rounds in which nothing is accepted: a plain round takes 0.42 s, a round with k
    drafts 0.61 + 0.08 (k - 1) s of which 3 ms a draft token. Returns the ks."""
    ks = []
    for _ in range(rounds):
        ks.append(chooser(stats))
        stats.rounds += 1
        stats.last_k, stats.last_accepted = ks[-1], 0
        stats.last_round_s = 0.42 if ks[-1] == 0 else 0.61 + 0.08 * (ks[-1] - 1)
        stats.last_draft_s = 0.003 * ks[-1]
    return ks


def test_plain_rounds_are_timed_directly():
    """The probe says a 2-token pass costs 1.1 plain steps, but a round with a draft costs
    1.45 (catch-up, rollback, acceptance). The second round is a plain one that measures what
    speculation must beat, so a useless draft is still dropped within a few rounds."""
    chooser = AdaptiveK(verify_ratio=[1.0 + 0.1 * k for k in range(9)])
    ks = _useless(chooser, Stats(), 24)
    assert ks[:2] == [2, 0], ks  # measure a drafting round, then a plain one
    assert chooser.t_plain == pytest.approx(0.42)
    assert ks[8:].count(0) >= 10, ks  # plain, bar probes while the estimates settle


def test_chooser_reprobes_after_a_run_of_zeros():
    chooser = AdaptiveK(k_max=4, reprobe_every=5, a=0.0, prior_weight=100.0)
    stats = Stats(rounds=1, last_k=0, last_round_s=0.1)
    ks = []
    for _ in range(12):
        ks.append(chooser(stats))
        stats.rounds += 1
        stats.last_k, stats.last_accepted, stats.last_round_s = ks[-1], 0, 0.1 + 0.01 * ks[-1]
    assert ks.count(0) >= 9 and 1 in ks


def test_plain_next_keeps_its_word():
    """When the chooser says the next round is plain (so the engine queues its pass early),
    the next call returns 0 whatever the round in between brought; and once the draft is
    dropped it says so on most rounds, so plain decoding overlaps like target-only."""
    chooser, stats, rng = AdaptiveK(), Stats(), random.Random(3)
    promised, promises, broken = False, 0, 0
    for _ in range(400):
        k = chooser(stats)
        broken += promised and k != 0
        promised = chooser.plain_next()
        promises += promised
        n = sum(1 for _ in range(k) if rng.random() < 0.05)  # rarely, a probe scores
        stats.rounds += 1
        stats.last_k, stats.last_accepted = k, n
        stats.last_round_s = rng.uniform(0.3, 0.5) + (0.2 + 0.08 * k if k else 0.0)
        stats.last_draft_s = 0.003 * k if k else None
    assert broken == 0
    assert promises > 300


def test_useless_draft_settles_at_zero():
    """End to end: a draft that never agrees gets k = 0 within a few rounds, losslessly."""
    target = make_tiny(0, layers=4, hidden=64)
    draft = make_tiny(5, layers=4, hidden=64)  # random weights: useless and as dear as the target
    ks = []
    chooser = AdaptiveK()

    def record(stats):
        ks.append(chooser(stats))
        return ks[-1]

    gen = generate_tokens(target, draft, [1, 2, 3], num_draft=record, max_tokens=40)
    out = [e.token for e in gen]
    assert out == [e.token for e in generate_tokens(target, None, [1, 2, 3], max_tokens=40)]
    assert ks[6:].count(0) >= len(ks[6:]) - 2, ks  # settled, except an occasional re-probe


def test_expected_tokens_when_acceptance_comes_in_runs():
    # the first draft passes with a = 0.8, each later one with c = 0.9 once those before passed
    assert expected_tokens(0.8, 5, 0.9) == pytest.approx(1 + 0.8 * (1 - 0.9**5) / 0.1)
    assert expected_tokens(0.8, 0, 0.9) == 1.0
    assert expected_tokens(0.5, 3, 1.0) == 2.5
    # on the same costs, runs of acceptance make long drafts pay where independence would not
    curve = [1.0 + 0.15 * k for k in range(9)]
    assert best_k(0.8, 0.1, curve, 8, c=0.95) > best_k(0.8, 0.1, curve, 8) + 2


def test_chooser_learns_first_and_later_acceptance_apart():
    """Rounds whose first draft passes 80% of the time and later ones 95%: the chooser
    estimates both, and drafts longer than it would if they were one rate."""
    chooser, stats, rng, ks = AdaptiveK(neighbor_every=0), Stats(), random.Random(1), []
    for _ in range(200):
        k = chooser(stats)
        ks.append(k)
        n = 0
        while n < k and rng.random() < (0.8 if n == 0 else 0.95):
            n += 1
        stats.rounds += 1
        stats.last_k, stats.last_accepted = k, n
        stats.last_round_s, stats.last_draft_s = 0.1 + 0.02 * k, 0.005 * k
    assert chooser.acceptance == pytest.approx(0.8, abs=0.15)
    assert chooser.continuation == pytest.approx(0.95, abs=0.05)
    settled = statistics.median(ks[-100:])
    pooled = (0.8 + 0.95) / 2
    assert settled > best_k(pooled, 0.005, chooser.verify_curve(), 8, k_min=1), ks


def test_estimates_carry_over_to_the_next_generation():
    """One chooser per pair: a new Stats starts a new generation without re-learning, so a
    draft found useless is not tried again on the next prompt's first rounds."""
    chooser = AdaptiveK()
    ks = [k for _ in range(3) for k in _useless(chooser, Stats(), 24)]  # a Stats per generation
    assert ks[:2] == [2, 0]  # calibration happens once, on the first generation
    # later generations start where the last one ended: plain, bar rare (backed-off) probes
    assert ks[24:28] == [0, 0, 0, 0] and ks[24:].count(0) >= 44, ks
    assert ks[48:].count(0) >= 23, ks


def test_remembered_state_resumes(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECMLX_HOME", str(tmp_path))
    model, ids = make_tiny(0, layers=2, hidden=32), [1, 2, 3, 4]
    fresh, path = remembered(model, "tiny", "tiny|tiny|greedy", ids)
    assert fresh.level is None and len(fresh.verify_ratio) == 9  # seeded with the probe
    _steady(fresh, Stats(), 30, accept=0.7)
    remember(fresh, path)
    again, same_path = remembered(model, "tiny", "tiny|tiny|greedy", ids)
    assert same_path == path and again.state() == fresh.state()
    assert again.choose() == fresh.choose()
    other, _ = remembered(model, "tiny", "tiny|tiny|T=0.8", ids)  # another sampler: its own
    assert other.level is None
    path.write_text("{not json")  # a damaged file is ignored, not fatal
    assert remembered(model, "tiny", "tiny|tiny|greedy", ids)[0].level is None
