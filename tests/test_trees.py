"""drafting/choosing/tree_size.py and the round's tree path (decoding/round.py): the --tree setting read
once, the side-leaf sizer (a fixed size fills its nodes, auto weighs them against the
measured pass cost), one host sync a tree round, the target's caches after a tree
generation equal to a plain one's, and refusals by name where a tree cannot be verified.
Greedy identity and the sampled chi-square with its wrong-rule control are the "tree" kind
of test_drafter_kinds.py."""

import mlx.core as mx
import pytest
from families import build, noisy_copy
from helpers import count_host_syncs, generate, noisy_tiny_pair, syncs_per_round
from typer.testing import CliRunner

from specmlx.cli import app
from specmlx.core.kvstate import KVState
from specmlx.core.sampling import SamplingParams
from specmlx.core.stats import RoundReport, Stats
from specmlx.decoding.batch import Batch
from specmlx.decoding.decode import Decode
from specmlx.decoding.session import Pair, Request, Session
from specmlx.drafting.choosing.adaptive import AdaptiveK
from specmlx.drafting.choosing.choosers import ChooserStore, FixedK, K
from specmlx.drafting.choosing.cost_curve import CostCurve
from specmlx.drafting.choosing.tree_size import (
    AUTO,
    OFF,
    SIDE_MAX,
    TREE_MAX,
    SideSizer,
    TreeSize,
    side_parents,
)
from specmlx.errors import BadInput

PROMPT = [1, 5, 9, 3, 7, 2]


@pytest.fixture(scope="module")
def pair():
    return noisy_tiny_pair()


def test_the_setting_is_read_once():
    assert TreeSize.of("off") == OFF and OFF.off and str(OFF) == "off"
    assert TreeSize.of("auto") == AUTO and AUTO.auto and AUTO.value == "auto"
    assert TreeSize.of("8") == TreeSize(8) == TreeSize.of(8) and TreeSize(8).value == 8
    for bad in (0, -1, TREE_MAX + 1, "many", True, 2.5):
        with pytest.raises(BadInput, match="--tree must be 'off', 'auto', an integer"):
            TreeSize.of(bad, "--tree")


def test_side_parents_put_the_chain_first():
    # a chain of 3; two leaves under the root, one under the chain's first node
    assert side_parents(3, [2, 1, 0]) == (0, 1, 2, 0, 0, 1)


def test_a_block_drafters_leaves_continue_node_after_node():
    # leaves 4, 5 (depth 1) and 6 (depth 2); leaf 4 goes on one node, leaf 5 two
    assert side_parents(3, [2, 1, 0], [1, 2, 0]) == (0, 1, 2, 0, 0, 1, 4, 5, 8)
    assert side_parents(3, [2, 1, 0], []) == side_parents(3, [2, 1, 0])


def test_continuations_go_in_by_value_and_only_for_a_block_drafter():
    sure = _stats(0.9, 0.6)  # a chain that passes 90% a depth: a leaf's follower is likely
    block = SideSizer(TreeSize(8), FixedK(3))
    block.runs = True
    sides, runs = block.plan_runs(3, sure)
    assert sum(sides) + sum(runs) == 5 and sum(runs) > 0, (sides, runs)
    assert len(runs) == sum(sides) and all(n <= 2 for n in runs)  # (within the block)
    assert block.gain(3, sure)[1] == 5
    chain = SideSizer(TreeSize(8), FixedK(3))  # a draft model's leaves cost a step to go on
    assert chain.plan_runs(3, sure) == (chain.plan(3, sure), [])
    # a follower is worth a_(d+1) of its leaf: under a weak chain, less than the next leaf
    weak = SideSizer(TreeSize(6), FixedK(3))
    weak.runs = True
    assert weak.plan_runs(3, _stats(0.2, 0.1)) == ([3, 0, 0], [])
    assert weak.plan_runs(3, _stats(0.2, 0.5))[1] == [1, 0]  # a strong first leaf: its follower
    # a fixed size with room for all: every leaf and every follower in the block
    full = SideSizer(TreeSize(14), FixedK(2))
    full.runs = True
    assert full.plan_runs(2, Stats()) == ([SIDE_MAX, SIDE_MAX], [1] * SIDE_MAX + [0] * SIDE_MAX)


def _stats(depth_rate: float, rank_rate: float) -> Stats:
    """Statistics of 100 rounds whose chain passed depth_rate at each depth and whose
    rank-0 side leaf held the target's token rank_rate of the time."""
    s = Stats()
    s.depth_tried, s.depth_accepted = [100] * 4, [int(100 * depth_rate)] * 4
    s.rank_tried, s.rank_kept = [100] * SIDE_MAX, [int(100 * rank_rate)] + [5] * (SIDE_MAX - 1)
    return s


def test_a_fixed_size_fills_its_nodes_with_the_most_valuable_leaves():
    sizer = SideSizer(TreeSize(8), FixedK(3))
    sides = sizer.plan(3, _stats(0.5, 0.6))
    assert sum(sides) == 5 and sides[0] >= sides[1] >= sides[2]  # shallow leaves are likelier
    assert SideSizer(TreeSize(3), FixedK(3)).plan(3, Stats()) == [0, 0, 0]  # no room: a chain
    assert SideSizer(TreeSize(64), FixedK(2)).plan(2, Stats()) == [SIDE_MAX, SIDE_MAX]


def _chooser(per_token: float) -> AdaptiveK:
    """An adaptive chooser whose measured pass over k + 1 tokens costs 1 + per_token * k."""
    cost = CostCurve(pass_ratio=[1.0 + per_token * k for k in range(40)], t_draft=0.05, level=1.0)
    return AdaptiveK(cost=cost)


def test_auto_adds_leaves_only_where_the_pass_cost_pays_for_them():
    # a weak chain whose runner-up holds the target's token 3 times in 10 where it failed:
    # a leaf at depth 1 adds about 0.2 tokens to the chain's 1.4 (+15%)
    rich = _stats(0.3, 0.3)
    assert sum(SideSizer(AUTO, _chooser(0.01)).plan(3, rich)) > 0  # a flat curve: leaves pay
    assert SideSizer(AUTO, _chooser(0.5)).plan(3, rich) == [0, 0, 0]  # +19% a row: the chain
    poor = _stats(0.3, 0.0)  # leaves that never hold it: the chain even on a flat curve
    poor.rank_kept = [0] * SIDE_MAX
    poor.rank_tried = [1000] * SIDE_MAX
    assert SideSizer(AUTO, _chooser(0.01)).plan(3, poor) == [0, 0, 0]


@pytest.mark.parametrize("temp", [0.0, 1.0])
def test_a_tree_round_has_one_host_sync(pair, monkeypatch, temp):
    target, draft = pair
    choose, counts = syncs_per_round(monkeypatch)
    stats = Stats()
    list(generate(target, draft, PROMPT, k=choose, max_tokens=40, tree=9, stats=stats,
                  sampling=SamplingParams(temp), seed=1))  # fmt: skip
    trees = [(n, last) for n, last in counts[1:] if last.chain is not None]
    assert len(trees) >= 5 and stats.tree_rounds == len(trees) + (stats.last.chain is not None)
    # one sync a round; a second where the draft was timed apart
    assert all(n == 1 + (last.draft_seconds is not None) for n, last in trees), trees


def test_the_targets_caches_after_a_tree_generation_are_a_plain_ones(pair):
    target, draft = pair
    spec_kv, plain_kv, stats = KVState(), KVState(), Stats()
    out = [e.token for e in generate(target, draft, PROMPT, k=3, max_tokens=30, tree=10,
                                     kv=spec_kv, stats=stats)]  # fmt: skip
    plain = [e.token for e in generate(target, None, PROMPT, k=0, max_tokens=30, kv=plain_kv)]
    assert out == plain and stats.tree_rounds > 0 and sum(stats.rank_kept) > 0, stats
    assert spec_kv.tokens == plain_kv.tokens
    n = len(plain_kv.tokens)
    for a, b in zip(spec_kv.target, plain_kv.target, strict=True):
        assert a.offset == b.offset == n
        assert mx.allclose(a.keys[..., :n, :], b.keys[..., :n, :], atol=1e-4).item()
        assert mx.allclose(a.values[..., :n, :], b.values[..., :n, :], atol=1e-4).item()


@pytest.mark.parametrize("family", ["llama_swa", "gemma3_text"])
def test_trees_over_sliding_windows_keep_the_targets_tokens_and_caches(family):
    """A window of 8 and 40 tokens: kept paths leave the window in turn. Greedy output and
    the window caches' last keys equal a plain generation's."""
    target = build(family, 4, 2, scale=2.0, vocab=32)
    draft = noisy_copy(family, 4, 2, noise=0.5, scale=2.0, vocab=32)
    spec_kv, plain_kv, stats = KVState(), KVState(), Stats()
    out = [e.token for e in generate(target, draft, PROMPT, k=3, max_tokens=40, tree=10,
                                     kv=spec_kv, stats=stats)]  # fmt: skip
    plain = [e.token for e in generate(target, None, PROMPT, k=0, max_tokens=40, kv=plain_kv)]
    assert out == plain and stats.tree_rounds > 0 and sum(stats.rank_kept) > 0, stats
    assert 0 < stats.accepted < stats.drafted, stats
    n = len(plain_kv.tokens)
    for a, b in zip(spec_kv.target, plain_kv.target, strict=True):
        assert a.offset == b.offset == n
        lo = max(getattr(a, "start", 0), getattr(b, "start", 0), n - 7)  # what a window keeps
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            got = x[..., lo - getattr(a, "start", 0) : n - getattr(a, "start", 0), :]
            want = y[..., lo - getattr(b, "start", 0) : n - getattr(b, "start", 0), :]
            assert mx.allclose(got, want, atol=1e-4).item(), (type(a).__name__, lo, n)


def test_a_fixed_size_is_refused_by_name_where_no_tree_can_be_verified(pair):
    target, draft = pair
    with pytest.raises(BadInput, match="n-gram lookup cannot branch"):
        list(generate(target, None, PROMPT, lookup=True, lookup_by="ngram", tree=4))
    with pytest.raises(BadInput, match="nothing drafts cannot branch"):
        list(generate(target, None, PROMPT, k=0, tree=4))
    recurrent = build("qwen3_next", 2, 0, vocab=32)
    with pytest.raises(BadInput, match="the target cannot verify a tree: its layers keep"):
        list(generate(recurrent, draft, PROMPT, tree=4))
    # auto: chains there, the same tokens
    stats = Stats()
    auto = [e.token for e in generate(recurrent, draft, PROMPT, max_tokens=12, tree="auto",
                                      stats=stats)]  # fmt: skip
    assert auto == [e.token for e in generate(recurrent, None, PROMPT, k=0, max_tokens=12)]
    assert stats.tree_rounds == 0 and stats.drafted > 0
    assert "the target cannot verify a tree: its layers keep" in stats.tree_off


def test_run_with_trees_says_so_in_its_summary(tmp_path, specmlx_home, monkeypatch):
    """`specmlx run --tree 6` over a tiny pair: its summary has a trees line (passes, drafts
    verified a pass, leaves kept by rank) beside the rest; --json has the figures."""
    import json

    from helpers import tiny_pair

    monkeypatch.setenv("SPECMLX_MODELS", str(tiny_pair(tmp_path)))
    r = CliRunner().invoke(app, ["run", "-n", "16", "--tree", "6", "-k", "3", "hello"])
    assert r.exit_code == 0, r.output
    assert "trees " in r.stderr and "drafts verified a pass" in r.stderr and "finish" in r.stderr
    r = CliRunner().invoke(app, ["run", "-n", "16", "--tree", "6", "-k", "3", "--json", "hi"])
    stats = json.loads(r.stdout)["stats"]
    assert stats["tree_rounds"] > 0 and stats["verified_per_pass"] > 3


def test_bench_rows_with_trees_count_them(tmp_path, specmlx_home, monkeypatch):
    """`specmlx bench --tree off,6`: the tree row's JSON and its caption count the passes
    that verified a tree, drafts verified a pass and leaves kept by rank; the chain row has
    none of them."""
    import json

    from helpers import tiny_pair

    monkeypatch.setenv("SPECMLX_MODELS", str(tiny_pair(tmp_path)))
    out = tmp_path / "bench.json"
    r = CliRunner().invoke(app, [
        "bench", "--limit", "1", "-k", "3", "--temp", "0", "-n", "12", "--repeats", "1",
        "--compare", "none", "--tree", "off,6", "--json", str(out),
    ])  # fmt: skip
    assert r.exit_code == 0, r.output
    rows = {row["tree"]: row for row in json.loads(out.read_text())["rows"]}
    assert "tree_passes" not in rows["off"], rows["off"]
    tree = rows[6]
    assert 0 < tree["tree_passes"] <= tree["passes"] and tree["verified_per_pass"] > 3, tree
    assert tree["same_as_target"] == "identical"
    assert "trees, tiny-d k=3 tree=6 T=0:" in " ".join(r.stdout.split())


def test_the_cli_refuses_a_bad_tree_before_loading():
    r = CliRunner().invoke(app, ["run", "--tree", "0", "def f():"])
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--tree must be 'off', 'auto', an integer" in lines[0], lines


def test_adaptive_k_weighs_a_chain_with_its_leaves():
    """A draft too weak for any chain to pay (k = 0) drafts where side leaves make a round
    pay, and stays at 0 where they add nothing."""
    chooser = _chooser(0.02)  # a flat curve, a draft step at 0.3 of a target step
    chooser.cost.t_plain, chooser.cost.t_draft = 1.0, 0.3
    for _ in range(40):  # the first draft kept one time in ten
        chooser.accept.count(1, 0)
    for _ in range(4):
        chooser.accept.count(1, 1)
    assert chooser.best_now() == 0
    assert chooser.best_now(widen=lambda k: (0.6, 4)) >= 1  # four leaves worth 0.6 tokens
    assert chooser.best_now(widen=lambda k: (0.0, 0)) == 0


def test_a_tree_after_a_queued_plain_pass(pair):
    """A chooser that promised a plain round (its pass queued early) and then drafts: the
    queued pass is given back and the tree verified from the root; the tokens are the
    target's own."""
    target, draft = pair
    ks = iter([0, 0, 3, 0, 0, 2] * 10)

    def schedule(last):
        return next(ks)

    schedule.plain_next = lambda: True  # (it breaks its word every third round)
    stats = Stats()
    out = [e.token for e in generate(target, draft, PROMPT, k=schedule, max_tokens=30, tree=8,
                                     stats=stats)]  # fmt: skip
    assert out == [e.token for e in generate(target, None, PROMPT, k=0, max_tokens=30)]
    assert stats.tree_rounds > 0


# ------------------------------------------------------------------- trees in a batch


class _Row:
    """What the sizer reads of a batch's row."""

    def __init__(self, stats: Stats, wants_trees: bool = True):
        self.stats, self.wants_trees, self.process = stats, wants_trees, None
        self.k_setting = K.of("auto")


def test_a_batchs_rows_take_one_count_of_leaves_each_from_the_curve_at_its_width():
    """Every row that takes trees gets the same count of leaves (its own best: the pass is
    as wide as its widest row), a row that asked for none gets none; auto builds them on a
    flat curve, and a curve that is flat for one row but not for four keeps a batch of four
    at chains."""
    rich, poor = _stats(0.3, 0.3), _stats(0.8, 0.3)
    rows = [_Row(rich), _Row(poor), _Row(rich, wants_trees=False)]
    sides, _ = SideSizer(TreeSize(8), FixedK(3)).plan_rows([3, 3, 3], rows)
    assert [sum(s) for s in sides] == [5, 5, 0]
    assert sides[0] != sides[1]  # each its own best: the weak chain's leaves sit shallower
    flat = SideSizer(AUTO, _chooser(0.0))
    assert sum(sum(s) for s in flat.plan_rows([3, 3], rows[:2])[0]) > 0
    # flat up to 9 tokens a pass, then +10% a token (memory-bound, then compute-bound): a lone
    # row's leaves ride the flat part; a batch of four is past the knee before any leaf
    knee = [1.0 + 0.1 * max(0, k - 8) for k in range(TREE_MAX + 1)]
    bent = SideSizer(AUTO, AdaptiveK(cost=CostCurve(pass_ratio=knee, t_draft=0.05, level=1.0)))
    assert sum(bent.plan_rows([3], [_Row(rich)])[0][0]) > 0
    assert bent.plan_rows([3] * 4, [_Row(rich)] * 4)[0] == [[0, 0, 0]] * 4


def test_a_sampled_rows_tree_is_its_lone_one_in_any_batch():
    """A sampled row's draws depend on its tree, and a seeded request must draw the same
    tokens alone and in any batch (test_batcher: "whatever moves it"): its plan is its lone
    plan, whatever rows run beside it, where a greedy row's follows the batch (the knee
    curve above keeps four greedy rows at chains)."""
    rich = _stats(0.3, 0.3)
    knee = [1.0 + 0.1 * max(0, k - 8) for k in range(TREE_MAX + 1)]
    for size in (AUTO, TreeSize(8)):
        sizer = SideSizer(size, AdaptiveK(cost=CostCurve(pass_ratio=knee, level=1.0)))
        drawn = _Row(rich)
        drawn.process = lambda logits: logits
        alone = sizer.plan_rows([2], [drawn])[0][0]
        assert sum(alone) > 0
        sides, _ = sizer.plan_rows([2, 3, 3, 3], [drawn] + [_Row(rich) for _ in range(3)])
        assert sides[0] == alone
        if size.auto:  # the batch's greedy rows: past the knee, chains
            assert sides[1:] == [[0, 0, 0]] * 3
    # with a fixed k it reads the guessed curve, not the measured one: its text may not
    # depend on a probe, which differs by machine and run
    flat = SideSizer(AUTO, _chooser(0.0))
    seeded, adaptive = _Row(rich), _Row(rich)
    seeded.process = adaptive.process = lambda logits: logits
    seeded.k_setting, adaptive.k_setting = K(3), K.of("auto")
    guessed = SideSizer(AUTO, FixedK(3)).plan_rows([3], [seeded])[0]
    assert flat.plan_rows([3], [seeded])[0] == guessed
    assert sum(flat.plan_rows([3], [adaptive])[0][0]) > sum(guessed[0])


def test_a_batch_tree_round_has_one_host_sync(pair, monkeypatch):
    """Rows of a batch, a tree each, greedy and sampled side by side: one read a round."""
    target, draft = pair
    batch = Batch(target, draft, tree=TreeSize(8))
    for i, p in enumerate([PROMPT, [2], [4, 4, 8, 15]]):
        s = SamplingParams(0.0 if i != 1 else 1.0)
        batch.join(p, Decode(s, K(3), 40, seed=i, tree=TreeSize(8)))
    batch.round(3)
    count = [0]
    count_host_syncs(monkeypatch, count)
    for _ in range(3):
        batch.round(3)
    assert count[0] == 3 and all(r.stats.tree_rounds == 4 for r in batch.rows)


def test_auto_fills_a_wider_pass_the_probe_found_cheaper_but_no_interpolated_dip():
    """Where the probe timed 16 tokens faster than 9 (this CPU's BLAS), auto fills a pass of
    16 with leaves (a chain of 3 and 12 leaves); the same dip between timed counts (at 14
    tokens, interpolated) is not trusted: the plan stays within the flat part."""
    rich = _stats(0.3, 0.3)

    def chooser(dip_at: int) -> AdaptiveK:
        ratio = [1.0 + 0.3 * min(k, 8) + 0.3 * max(0, k - 8) for k in range(32)]  # steep
        ratio[dip_at - 1] = 1.5  # a pass over dip_at tokens: cheaper than 3 tokens
        return AdaptiveK(cost=CostCurve(pass_ratio=ratio, t_draft=0.05, level=1.0))

    assert sum(SideSizer(AUTO, chooser(16)).plan(3, rich)) == 12
    assert sum(SideSizer(AUTO, chooser(14)).plan(3, rich)) < 5
    # a sampled row's acceptance costs what the probe did not time: it fills no dip, alone
    # or in a batch with a sampled row
    sampled = SideSizer(AUTO, chooser(16))
    sampled.dips = False
    assert sum(sampled.plan(3, rich)) < 5
    greedy, drawn = _Row(rich), _Row(rich)
    drawn.process = lambda logits: logits
    batch = SideSizer(AUTO, chooser(16))
    assert [sum(s) for s in batch.plan_rows([3], [greedy])[0]] == [12]
    assert sum(batch.plan_rows([3], [drawn])[0][0]) < 5


def test_a_fixed_k_sizes_auto_trees_by_the_targets_probe(pair):
    """`-k 3 --tree auto` reads the target's probe as auto k does (FixedK's cost): on the
    guessed curve a lone row never filled the wider pass the probe found cheaper, where a
    batch's row of one (which reads the probe) did."""
    target, draft = pair
    rich = _stats(0.3, 0.3)
    ratio = [1.0 + 0.3 * min(k, 8) + 0.3 * max(0, k - 8) for k in range(32)]
    ratio[15] = 1.5  # a pass over 16 tokens: cheaper than one over 3
    assert sum(SideSizer(AUTO, FixedK(3, CostCurve(pass_ratio=ratio))).plan(3, rich)) == 12
    assert sum(SideSizer(AUTO, FixedK(3)).plan(3, rich)) < 12  # the guess: +10% a token
    # the session hands a fixed k's auto trees the curve its store knows; a chain's k,
    # a fixed size or a store that knows none, nothing (a fixed k runs no probe itself)
    known, none = ChooserStore(persist=False, pass_ratio=ratio), ChooserStore(persist=False)
    cases = (
        (known, AUTO, ratio),
        (known, OFF, None),
        (known, TreeSize(8), None),
        (none, AUTO, None),
    )
    for store, tree, curve in cases:
        gen = Session(Pair(target, draft), choosers=store).start(
            Request(prompt_ids=PROMPT, k=K(3), tree=tree, max_tokens=4)
        )
        assert isinstance(gen.parts.chooser, FixedK)
        assert gen.parts.chooser.cost.pass_ratio == curve
        assert len(list(gen.tokens())) == 4


def test_a_generation_starts_from_the_side_leaves_earlier_ones_kept():
    """A side leaf's rate by rank is learned per generation from a prior (1 in 5): a weak
    draft's short runs each learned anew that its leaves miss, filling a cheap wide pass
    with them run after run. An adaptive chooser keeps what tree rounds kept by rank (decayed,
    saved with it), and a generation's rates start from that."""
    fresh = AdaptiveK()
    learned = AdaptiveK()
    miss = RoundReport(k=6, accepted=0, seconds=1.0, chain=2, sides=(4, 0), side=-1)
    for _ in range(10):  # the chain rejected at depth 1, none of its 4 leaves the target's
        learned.accept.count_tree(miss)
    assert [round(t, 3) for _, t in learned.accept.ranks] == [round(sum(
        0.95**i for i in range(10)), 3)] * 4  # fmt: skip
    assert all(k == 0 for k, _ in learned.accept.ranks)
    hit = RoundReport(k=6, accepted=1, seconds=1.0, chain=2, sides=(4, 0), side=1)
    learned.accept.count_tree(hit)  # ranks 0 and 1 tried, rank 1 kept
    assert (
        learned.accept.ranks[1][0] == 1.0
        and learned.accept.ranks[2][1] < learned.accept.ranks[1][1]
    )
    stats = Stats()  # a generation's start
    weak = SideSizer(TreeSize(8), learned)._ranked(2, stats)[0]
    prior = SideSizer(TreeSize(8), fresh)._ranked(2, stats)[0]
    worth = lambda nodes, s: next(v for v, d, r, _ in nodes if (d, r) == (0, s))  # noqa: E731
    assert worth(weak, 0) == 0 and worth(prior, 0) > 0  # rank 0 never kept: worth nothing now
    assert 0 < worth(weak, 1)  # (rank 1 was kept once)
    # a FixedK keeps nothing: the prior
    assert SideSizer(TreeSize(8), FixedK(2))._ranked(2, stats)[0] == prior
