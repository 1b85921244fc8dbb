"""Bench math on synthetic numbers (no timing asserted)."""

import pytest

from specmlx.bench import (
    BenchSettings,
    Run,
    System,
    _timed,
    spread,
    summarize,
    theoretical_speedup,
)


def test_theoretical_speedup_formula():
    # a = 0.8, k = 4, c = 0.1: (1 - 0.8^5) / (0.2 * 1.4)
    assert theoretical_speedup(0.8, 4, 0.1) == pytest.approx((1 - 0.8**5) / (0.2 * 1.4))
    assert theoretical_speedup(1.0, 3, 0.0) == 4.0  # everything accepted, free draft
    assert theoretical_speedup(0.0, 5, 0.2) == pytest.approx(1 / 2.0)  # useless draft costs
    assert theoretical_speedup(0.5, 0, 0.3) == 1.0


def test_decode_timing_starts_at_the_first_target_token():
    tokens, decoded, secs = _timed([(5, True), (6, False), (7, True), (8, False)])
    assert tokens == [5, 6, 7, 8] and decoded == 2
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
    rows = summarize(runs, [base, spec], s, draft_cost=0.1)
    row = rows[1]
    assert row["tokens_per_sec"] == 20.0 and row["tokens_per_sec_min"] == 20.0
    assert row["speedup"] == pytest.approx(2.2)  # the median of 20/10 and 20/(100/12)
    assert row["acceptance_rate"] == 0.75 and row["tokens_per_pass"] == 2.5
    theory = theoretical_speedup(0.75, 2, 0.1)
    assert row["theoretical_speedup"] == pytest.approx(theory)
    assert row["efficiency"] == pytest.approx(row["speedup"] / theory)
    assert row["identical_to_target"] is True
