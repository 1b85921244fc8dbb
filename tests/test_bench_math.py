"""Bench math and the adaptive-k chooser on synthetic numbers (no timing asserted)."""

import pytest
from tiny import make_tiny

from specmlx.adaptive import AdaptiveK, best_k, expected_tokens
from specmlx.bench import BenchSettings, Run, System, spread, summarize, theoretical_speedup
from specmlx.engine import Stats, generate_tokens


def test_theoretical_speedup_formula():
    # a = 0.8, k = 4, c = 0.1: (1 - 0.8^5) / (0.2 * 1.4)
    assert theoretical_speedup(0.8, 4, 0.1) == pytest.approx((1 - 0.8**5) / (0.2 * 1.4))
    assert theoretical_speedup(1.0, 3, 0.0) == 4.0  # everything accepted, free draft
    assert theoretical_speedup(0.0, 5, 0.2) == pytest.approx(1 / 2.0)  # useless draft costs
    assert theoretical_speedup(0.5, 0, 0.3) == 1.0


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


def test_chooser_reprobes_after_a_run_of_zeros():
    chooser = AdaptiveK(k_max=4, reprobe_every=5, a=0.0, prior_weight=100.0)
    stats = Stats(rounds=1, last_k=0, last_round_s=0.1)
    ks = []
    for _ in range(12):
        ks.append(chooser(stats))
        stats.rounds += 1
        stats.last_k, stats.last_accepted, stats.last_round_s = ks[-1], 0, 0.1 + 0.01 * ks[-1]
    assert ks.count(0) >= 9 and 1 in ks


def test_useless_draft_settles_at_zero():
    """End to end: a draft that never agrees gets k = 0 within a few rounds, losslessly."""
    target = make_tiny(0, layers=4, hidden=64)
    draft = make_tiny(5, layers=4, hidden=64)  # random weights: useless and as dear as the target
    ks = []

    class Recorded(AdaptiveK):  # a subclass, so the engine still sees time_draft
        def __call__(self, stats):
            ks.append(super().__call__(stats))
            return ks[-1]

    gen = generate_tokens(target, draft, [1, 2, 3], num_draft=Recorded(), max_tokens=40)
    out = [e.token for e in gen]
    assert out == [e.token for e in generate_tokens(target, None, [1, 2, 3], max_tokens=40)]
    assert ks[6:].count(0) >= len(ks[6:]) - 2, ks  # settled, except an occasional re-probe
