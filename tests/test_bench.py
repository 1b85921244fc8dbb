"""Bench math on synthetic numbers (no timing asserted), the rows it runs, the greedy
verdicts on hand-built logits, and the like-for-like sampler it gives mlx-lm."""

import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from helpers import generate, make_tiny
from mlx_lm.sample_utils import make_sampler

from specmlx.bench.data import BenchSettings, Run, System, runs_at
from specmlx.bench.report import (
    classify_difference,
    first_difference,
    git_revision,
    greedy_verdict,
    spread,
    summarize,
    target_logits_after,
    theoretical_speedup,
    tie_tolerance,
    to_markdown,
)
from specmlx.bench.suite import _timed, like_for_like_sampler, systems
from specmlx.core.sampling import SamplingParams, make_processor
from specmlx.drafting.choosing.choosers import AUTO as AUTO_K
from specmlx.drafting.choosing.choosers import K


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
    s = BenchSettings(ks=[K(2)], temps=[0.0], repeats=2, compare_mlx_lm=False)
    base, spec = System("target-only", "none", K(0)), System("specmlx", "d", K(2))
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
    assert row["identical_to_target"] is True and row["same_as_target"] == "identical"
    assert row["verify"] == "block" and rows[0]["verify"] is None  # the default rule


def test_verdicts_fold_into_the_worst_one_per_row():
    s = BenchSettings(ks=[K(2)], temps=[0.0], repeats=1, compare_mlx_lm=False)
    base, spec = System("target-only", "none", K(0)), System("specmlx", "d", K(2))
    ref = Run(base.label, "p", 0.0, 0, [1, 2, 3], 3, 1.0, 0, 0, "identical")
    tie = Run(spec.label, "p", 0.0, 0, [1, 2, 4], 3, 1.0, 2, 1, "near-tie")
    other = Run(spec.label, "q", 0.0, 0, [5, 6], 2, 1.0, 2, 1, "identical")
    base_q = Run(base.label, "q", 0.0, 0, [5, 6], 2, 1.0, 0, 0, "identical")
    rows = summarize([ref, base_q, tie, other], [base, spec], s, None)
    assert rows[1]["same_as_target"] == "near-tie" and rows[1]["identical_to_target"] is False
    unchecked = Run(spec.label, "q", 0.0, 0, [5, 7], 2, 1.0, 2, 1)  # no verdict: tokens decide
    rows = summarize([ref, base_q, tie, unchecked], [base, spec], s, None)
    assert rows[1]["same_as_target"] == "diverged"
    table = to_markdown({"rows": rows, "pass_curve": {1: 1.0}})
    assert "**diverged**" in table and "| verify |" in table


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_a_difference_is_a_near_tie_only_between_two_tokens_at_the_top():
    logits = mx.array([10.0, 30.0, 29.99, 20.0])  # tokens 1 and 2: 0.01 apart at 30
    assert tie_tolerance(30.0, mx.float32) == pytest.approx(0.03)  # 1e-3 of the top logit
    assert classify_difference(logits, 1, 2) == "near-tie"
    assert classify_difference(logits, 2, 1) == "near-tie"
    assert classify_difference(logits, 1, 3) == "diverged"  # 10 below the top: a real choice
    assert classify_difference(mx.array([30.0, 29.9, 0.0]), 0, 1) == "diverged"  # 0.1 > 0.03
    # bfloat16 rounds at 2^-8 of a value: 30 and 29.875 are neighbours there, a tie
    bf16 = mx.array([30.0, 29.875, 0.0], dtype=mx.bfloat16)
    assert classify_difference(bf16, 0, 1) == "near-tie"
    assert classify_difference(mx.array([30.0, 29.0, 0.0], dtype=mx.bfloat16), 0, 1) == "diverged"
    assert tie_tolerance(0.01, mx.float32) == pytest.approx(1e-3)  # small logits: absolute floor


def test_identity_recomputes_the_targets_logits_where_runs_differ():
    target = make_tiny(0)
    prompt = [1, 5, 9]
    ref = plain_tokens(target, prompt, 6)
    assert greedy_verdict(target, prompt, ref, ref) == "identical"
    logits = np.array(target_logits_after(target, prompt + ref[:3]))
    assert int(logits.argmax()) == ref[3]  # the recomputed position is the one that differs
    worst = int(logits.argmin())
    assert greedy_verdict(target, prompt, ref, ref[:3] + [worst] + ref[4:]) == "diverged"
    assert (
        greedy_verdict(target, prompt, ref, ref[:4]) == "diverged"
    )  # ended early: no tie to judge


def plain_tokens(target, prompt, n):
    return [e.token for e in generate(target, None, prompt, max_tokens=n)]


def test_block_rows_sit_beside_token_rows_and_run_sampled_only():
    s = BenchSettings(ks=[K(0), K(2), AUTO_K], temps=[0.0, 0.8], verifies=["token", "block"])
    rows = [(sy.system, sy.k.value, sy.verify) for sy in systems("d", s)]
    spec = [(k, v) for system, k, v in rows if system == "specmlx"]
    assert spec == [(0, "token"), (2, "token"), (2, "block"), ("auto", "token"), ("auto", "block")]
    block, token = System("specmlx", "d", K(2), "block"), System("specmlx", "d", K(2), "token")
    # the default rule's rows keep the plain label
    assert block.label == "specmlx d k=2" and token.label == "specmlx d k=2 verify=token"
    assert System("specmlx", "d", K(2)).verify == "block"
    assert not runs_at(block, 0.0, s) and runs_at(block, 0.8, s)
    only_block = BenchSettings(ks=[K(2)], temps=[0.0], verifies=["block"])
    assert runs_at(block, 0.0, only_block)  # no token-wise row to stand for it


def test_mlx_lm_gets_specmlx_sampling_temperature_first():
    """top-p 0.5 at T = 2 on (0.6, 0.3, 0.1): mlx-lm's own sampler filters the untempered
    distribution (keeps token 0 alone); specmlx's tempers first, then keeps tokens 0 and 1."""
    logits = mx.log(mx.array([[0.6, 0.3, 0.1]]))
    params = SamplingParams(2.0, top_p=0.5)
    want = np.array(make_processor(params)(logits))[0]
    assert want[0] > 0 and want[1] > 0 and want[2] == 0
    mx.random.seed(0)
    ours = like_for_like_sampler(params)
    draws = np.array(ours(mx.broadcast_to(logits, (4000, 3))))
    freq = np.bincount(draws, minlength=3) / len(draws)
    np.testing.assert_allclose(freq, want, atol=0.03)
    theirs = make_sampler(2.0, top_p=0.5)(mx.broadcast_to(logits, (4000, 3)))
    assert set(np.array(theirs).tolist()) == {0}  # the order the bench no longer compares
    greedy = like_for_like_sampler(SamplingParams(0.0))
    assert greedy(logits).item() == 0


def test_the_revision_is_the_running_codes_not_the_working_directorys(tmp_path, monkeypatch):
    """It was read from wherever the bench was started, and at its end: a run from another
    repository, or one that outlived a commit, recorded a revision that never ran."""
    import specmlx

    here = Path(specmlx.__file__).resolve().parent
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                          text=True).stdout.strip()  # fmt: skip
    monkeypatch.chdir(tmp_path)  # not a checkout
    rev = git_revision()
    if not head:
        assert rev is None  # an installed copy: no revision to claim
    else:
        assert rev.removesuffix("+dirty") == head
