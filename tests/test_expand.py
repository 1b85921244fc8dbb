"""EAGLE-2's grown tree (``--tree expand:N``, drafting/trees/expand.py): the tree a draft grows
level by level is the one plain passes over every path would grow; a generation with it
keeps the target's greedy tokens, and the draft's caches hold the kept path's keys as a
plain pass would; a grown round reads the host twice (the tree's shape, then the round's);
a batch's rows grow together the trees they grow alone, and a seeded sampled row draws
alike alone and in a batch; what cannot grow one is refused by name."""

import copy
import math

import mlx.core as mx
import mlx.nn as nn
import pytest
from families import build
from helpers import generate, noisy_tiny_pair, syncs_per_round, tiny_pair
from mlx.utils import tree_map_with_path
from typer.testing import CliRunner

from specmlx.cli import app
from specmlx.core.batch_caches import rows_of, solo_of
from specmlx.core.caches import make_caches
from specmlx.core.kvstate import KVState
from specmlx.core.sampling import SamplingParams, make_processor
from specmlx.core.stats import Stats
from specmlx.decoding.batch import Batch
from specmlx.decoding.decode import Decode
from specmlx.drafting.choosing.choosers import K
from specmlx.drafting.choosing.tree_size import TreeSize
from specmlx.drafting.heads import eagle3
from specmlx.drafting.trees import expand
from specmlx.errors import BadInput

PROMPT = [1, 5, 9, 3, 7, 2]


@pytest.fixture(scope="module")
def pair():
    return noisy_tiny_pair()


def _reference(draft, ctx: list[int], k: int, nodes: int, w: int) -> set[tuple[int, ...]]:
    """EAGLE-2's tree from a plain pass over each path (no cache, no tree mask): the paths
    of its N best nodes by summed log-probability."""

    def logp(path: tuple[int, ...]) -> list[float]:
        logits = draft(mx.array([ctx + list(path)]))[0, -1].astype(mx.float32)
        return nn.log_softmax(logits).tolist()

    return _reference_from(logp, k, nodes, w)


def _reference_from(logp, k: int, nodes: int, w: int) -> dict[tuple[int, ...], float]:
    """EAGLE-2's tree from ``logp(path)``: the draft's log-probabilities after a path; each
    chosen node's path and score."""

    def best(scores: list[float]) -> list[int]:
        return sorted(range(len(scores)), key=lambda t: -scores[t])[:w]

    root = logp(())
    level = [((t,), root[t]) for t in best(root)]
    grown = list(level)
    for _ in range(1, k):
        frontier = sorted(level, key=lambda n: -n[1])[:w]
        level = []
        for path, s in frontier:
            lp = logp(path)
            level += [(path + (t,), s + lp[t]) for t in best(lp)]
        grown += level
    grown = [n for n in grown if n[1] > -math.inf]  # (a token filtered out: never proposed)
    grown.sort(key=lambda n: (-n[1], len(n[0])))
    return dict(grown[:nodes])


def _paths(g: expand.Grown) -> dict[tuple[int, ...], float]:
    """Each node's path of tokens and its score."""
    out, parents = {}, g.tree.parents
    for i in range(1, len(parents) + 1):
        path, at = [], i
        while at:
            path.append(g.tokens[at - 1])
            at = parents[at - 1]
        out[tuple(reversed(path))] = g.scores[i - 1]
    return out


def _same(got: dict, want: dict) -> bool:
    """The same paths, each scored alike (float32 sums)."""
    return got.keys() == want.keys() and all(abs(got[p] - want[p]) < 1e-4 for p in got)


@pytest.mark.parametrize("k, nodes, w", [(3, 9, 2), (4, 12, 3), (4, 30, 3), (1, 3, 4)])
def test_a_grown_tree_is_the_one_plain_passes_over_every_path_grow(pair, k, nodes, w):
    _, draft = pair
    ctx = PROMPT + [4, 8]
    cache = rows_of(None, make_caches(draft))
    logits = draft(mx.array([ctx]), cache=cache)[0, -1]
    feed = expand.model_feed(draft, cache, 32)
    g = expand.grow(feed, [len(ctx)], logits[None], [k], nodes, w)[0]
    assert len(g.tokens) == nodes and max(g.tree.depths()) == k
    assert _same(_paths(g), _reference(draft, ctx, k, nodes, w))
    assert cache[0].lens == [len(ctx) + (k - 1) * w]  # every level's entries, until kept


def test_a_sampled_rows_tree_is_scored_by_its_own_sampling(pair):
    """A sampled row scores its nodes by the draft's probabilities after the row's own
    processing (what its target's p goes through): with top-k 2, no node is a token its
    filters leave out, so at most 2 children a node."""
    _, draft = pair
    ctx = PROMPT + [4, 8]
    process = make_processor(SamplingParams(0.7, top_k=2))
    cache = rows_of(None, make_caches(draft))
    logits = draft(mx.array([ctx]), cache=cache)[:, -1]
    feed = expand.model_feed(draft, cache, 32)
    g = expand.grow(feed, [len(ctx)], logits, [3], 9, 4, process=[process])[0]

    def logp(path: tuple[int, ...]) -> list[float]:
        out = draft(mx.array([ctx + list(path)]))[0, -1]
        return mx.log(process(out)).tolist()

    assert _same(_paths(g), _reference_from(logp, 3, 9, 4))
    assert len(g.tokens) == 9 and max(len(c) for c in g.tree.children()) == 2


def _eagle3_head(target, width: int):
    """A random EAGLE-3 head (its full vocabulary) over ``target``, weights as the reference
    tests give one (norms near one, the rest at 0.3)."""
    config = eagle3.Eagle3Config(
        hidden=width, heads=4, kv_heads=2, head_dim=8, intermediate=64, eps=1e-5,
        rope_theta=10000.0, rope_scaling=None, max_positions=2048, vocab=32, draft_vocab=32,
        target_hidden=width, layers=(0, 1, 3),
    )  # fmt: skip
    head = eagle3.Eagle3Head(target, config)
    mx.random.seed(4)
    head.update(tree_map_with_path(
        lambda name, p: float(name.endswith("norm.weight")) + 0.3 * mx.random.normal(p.shape),
        head.parameters(),
    ))  # fmt: skip
    mx.eval(head.parameters())
    return head


def test_a_heads_grown_tree_is_the_one_its_chained_steps_over_every_path_grow():
    """An EAGLE-3 head grows from its features: each level's nodes read their parent's output,
    as its chained steps along each path would."""
    target = build("llama", 4, 0, vocab=32)
    width = target.model.embed_tokens.weight.shape[1]
    head = _eagle3_head(target, width)
    feats = mx.random.normal((1, 5, 3 * width), key=mx.random.key(2))
    pairs = mx.array([[5, 9, 3, 7, 2]])
    cache = rows_of(None, head.make_cache())
    g, logits = head(feats, pairs, cache)
    mx.eval(g, logits, cache[0].keys)
    before = copy.deepcopy(cache)
    k, nodes, w = 4, 20, 3
    feed = expand.HeadFeed(head, cache, g[:, -1:])
    grown = expand.grow(feed, [5], logits[:, -1], [k], nodes, w)[0]

    def logp(path: tuple[int, ...]) -> list[float]:
        c, h, out = copy.deepcopy(before), g[:, -1:], logits[0, -1]
        for t in path:  # the head's chained steps, node after node
            h, step = head(h, mx.array([[t]]), c)
            out = step[0, -1]
        return nn.log_softmax(out.astype(mx.float32)).tolist()

    assert _same(_paths(grown), _reference_from(logp, k, nodes, w))


def test_the_draft_keeps_the_kept_paths_keys_as_a_plain_pass_would(pair):
    """Keep a path of the grown tree: the draft's caches then hold the context and the
    path's fed nodes, each key as a plain pass over them computes it."""
    _, draft = pair
    ctx = PROMPT + [4, 8]
    cache = rows_of(None, make_caches(draft))
    logits = draft(mx.array([ctx]), cache=cache)[:, -1]
    g = expand.grow(expand.model_feed(draft, cache, 32), [len(ctx)], logits, [4], 14, 3)[0]
    deepest = max(range(1, g.tree.size + 1), key=lambda i: (g.tree.depths()[i], -i))
    path = [g.tokens[j - 1] for j in g.tree.path(deepest)]
    slots = g.kept(path)
    assert len(slots) == 3  # (the last level's node was never fed)
    expand.keep(cache, [len(ctx)], [slots])
    n = len(ctx) + 3
    assert cache[0].lens == [n]
    plain = make_caches(draft)
    draft(mx.array([ctx + path[:3]]), cache=plain)
    for a, b in zip(cache, plain, strict=True):
        assert mx.allclose(a.keys[..., :n, :], b.keys[..., :n, :], atol=1e-4).item()
        assert mx.allclose(a.values[..., :n, :], b.values[..., :n, :], atol=1e-4).item()


def test_a_grown_generation_keeps_the_targets_tokens_and_both_caches(pair, monkeypatch):
    target, draft = pair
    grown = []
    real = expand.grow
    monkeypatch.setattr(
        "specmlx.drafting.row_drafters.grow", lambda *a, **kw: grown.append(1) or real(*a, **kw)
    )
    spec_kv, plain_kv, stats = KVState(), KVState(), Stats()
    out = [e.token for e in generate(target, draft, PROMPT, k=3, max_tokens=40,
                                     tree="expand:8", kv=spec_kv, stats=stats)]  # fmt: skip
    plain = [e.token for e in generate(target, None, PROMPT, k=0, max_tokens=40, kv=plain_kv)]
    assert out == plain and stats.tree_rounds == len(grown) >= 5, stats
    assert 0 < stats.accepted < stats.drafted and stats.verified_per_pass > 4, stats
    n = len(plain_kv.tokens)
    for a, b in zip(spec_kv.target, plain_kv.target, strict=True):
        assert a.offset == b.offset == n
        assert mx.allclose(a.keys[..., :n, :], b.keys[..., :n, :], atol=1e-4).item()
    held = spec_kv.draft_held
    assert held >= n - 3, (held, n)  # (a round's last kept nodes wait to be fed)
    plain = make_caches(draft)
    draft(mx.array([spec_kv.tokens[:held]]), cache=plain)
    for a, b in zip(spec_kv.draft, plain, strict=True):
        assert a.offset == held
        assert mx.allclose(a.keys[..., :held, :], b.keys[..., :held, :], atol=1e-4).item()


def test_a_grown_round_reads_the_host_twice(pair, monkeypatch):
    """The tree's shape (the target's mask) once, then the round's one sync."""
    target, draft = pair
    choose, counts = syncs_per_round(monkeypatch)
    list(generate(target, draft, PROMPT, k=choose, max_tokens=40, tree="expand:8"))
    trees = [(n, last) for n, last in counts[1:] if last.chain is not None]
    assert len(trees) >= 5
    assert all(n == 2 + (last.draft_seconds is not None) for n, last in trees), trees


def test_a_sampled_row_grows_and_draws_alike_alone_and_in_a_batch(pair, monkeypatch):
    """A sampled row grows its tree (point masses: its draws come from the target and its
    keys only), and a seeded row draws the same tokens alone and in a batch beside other
    rows, sampled and greedy, that grow theirs."""
    target, draft = pair
    grown = []
    real = expand.grow
    monkeypatch.setattr(
        "specmlx.drafting.row_drafters.grow", lambda *a, **kw: grown.append(1) or real(*a, **kw)
    )
    hot, stats = SamplingParams(1.0), Stats()
    alone = [e.token for e in generate(target, draft, PROMPT, k=3, max_tokens=30,
                                       tree="expand:8", sampling=hot, seed=4, stats=stats)]  # fmt: skip
    assert stats.tree_rounds == len(grown) > 0 and stats.accepted > 0, stats
    batch, out = Batch(target, draft, tree=TreeSize(8, expand=True)), {}
    ask = lambda s, seed: Decode(s, K(3), 30, seed=seed, tree=TreeSize(8, expand=True))  # noqa: E731
    rows = [batch.join([4, 4, 8, 15], ask(SamplingParams(0.7), 9)),
            batch.join(PROMPT, ask(hot, 4)), batch.join([2, 6], ask(SamplingParams(), 0))]  # fmt: skip
    while batch.rows:
        for r, events in zip(list(batch.rows), batch.round(3), strict=True):
            out.setdefault(id(r), []).extend(e.token for e in events)
        for r in [r for r in batch.rows if r.done]:
            batch.leave(r)
    assert out[id(rows[1])] == alone
    assert all(r.stats.tree_rounds > 0 for r in rows)
    other = [e.token for e in generate(target, draft, PROMPT, k=3, max_tokens=30,
                                       tree="expand:8", sampling=hot, seed=5)]  # fmt: skip
    assert other != alone  # (the seed matters: the comparison means something)


@pytest.mark.parametrize("head", [False, True])
def test_a_batchs_rows_grow_the_trees_they_grow_alone(pair, head):
    """Rows of three lengths grow in one pass a level the trees each grows alone, each to its
    own depth (0: none), and each keeps its kept path's entries as alone."""
    target, draft = pair
    ctxs, ks = [PROMPT + [4, 8], [3, 1], [9, 9, 2, 7]], [4, 2, 0]
    if head:
        width = target.model.embed_tokens.weight.shape[1]
        model = _eagle3_head(build("llama", 4, 0, vocab=32), width)
        feats = [mx.random.normal((1, len(c) - 1, 3 * width), key=mx.random.key(i))
                 for i, c in enumerate(ctxs)]  # fmt: skip

        def start(i):
            cache = rows_of(None, model.make_cache())
            g, logits = model(feats[i], mx.array([ctxs[i][1:]]), cache)
            return cache, g[:, -1:], logits[:, -1], len(ctxs[i]) - 1

        feed = lambda cache, g: expand.HeadFeed(model, cache, g)  # noqa: E731
    else:

        def start(i):
            cache = rows_of(None, make_caches(draft))
            return cache, None, draft(mx.array([ctxs[i]]), cache=cache)[:, -1], len(ctxs[i])

        feed = lambda cache, g: expand.model_feed(draft, cache, 32)  # noqa: E731
    nodes = 30 if head else 9  # (the random head's tree is wide: all 30 nodes, to depth 4)
    solo = [start(i) for i in range(3)]
    alone = [expand.grow(feed(c, g), [n], x, [ks[i]], nodes, 3)[0]
             for i, (c, g, x, n) in enumerate(solo)]  # fmt: skip
    assert [max(g.tree.depths()) for g in alone] == [4, 2, 0]
    rows = [start(i) for i in range(3)]
    cache = None
    for c, *_ in rows:
        cache = rows_of(cache, solo_of(c, 0))
    g = mx.concatenate([r[1] for r in rows]) if head else None
    held = [r[3] for r in rows]
    logits = mx.concatenate([r[2] for r in rows])
    both = expand.grow(feed(cache, g), held, logits, ks, nodes, 3)
    for one, many in zip(alone, both, strict=True):
        assert one.tree == many.tree and one.tokens == many.tokens and one.slots == many.slots
        assert _same(_paths(one), _paths(many))
    if head:
        return
    paths = [[g.tokens[j - 1] for j in g.tree.path(g.tree.size)] for g in alone]
    expand.keep(cache, held, [g.kept(p) for g, p in zip(both, paths, strict=True)])
    for i, (c, _, _, n) in enumerate(solo):
        expand.keep(c, [n], [alone[i].kept(paths[i])])
        m = c[0].lens[0]
        assert cache[0].lens[i] == m
        for a, b in zip(cache, c, strict=True):
            assert mx.allclose(a.keys[i, :, :m], b.keys[0, :, :m], atol=1e-4).item()


def test_the_setting_and_what_cannot_grow_a_tree(pair):
    target, draft = pair
    assert TreeSize.of("expand:8") == TreeSize(8, expand=True)
    assert TreeSize.of("expand:8").value == "expand:8" and not TreeSize.of("expand:8").auto
    for bad in ("expand:0", "expand:", "expand:x", "expand:65"):
        with pytest.raises(BadInput, match="'expand:' and one"):
            TreeSize.of(bad, "--tree")
    with pytest.raises(
        BadInput, match="expand:4: only a draft model or a chained head grows one, none drafts"
    ):
        list(generate(target, None, PROMPT, lookup=True, tree="expand:4"))
    with pytest.raises(BadInput, match="per-token stopping drafts chains"):
        list(generate(target, draft, PROMPT, k="auto", draft_stop=True, tree="expand:4"))
    window = build("llama_swa", 4, 2, vocab=32)
    with pytest.raises(BadInput, match="sliding windows"):
        list(generate(target, window, PROMPT, tree="expand:4"))
    recurrent = build("qwen3_next", 2, 0, vocab=32)
    with pytest.raises(BadInput, match="the draft cannot grow it: its layers keep"):
        list(generate(target, recurrent, PROMPT, tree="expand:4"))


def test_run_grows_trees_from_the_cli(tmp_path, specmlx_home, monkeypatch):
    monkeypatch.setenv("SPECMLX_MODELS", str(tiny_pair(tmp_path)))
    r = CliRunner().invoke(app, ["run", "-n", "16", "--tree", "expand:6", "-k", "3", "hello"])
    assert r.exit_code == 0, r.output
    assert "trees " in r.stderr
    r = CliRunner().invoke(app, ["run", "-n", "4", "--tree", "expand:0", "hello"])
    assert r.exit_code == 2 and "--tree must be" in r.stderr, r.output


def test_serve_refuses_a_grown_tree_it_cannot_grow_before_listening(
    tmp_path, specmlx_home, monkeypatch
):
    monkeypatch.setenv("SPECMLX_MODELS", str(tiny_pair(tmp_path)))
    r = CliRunner().invoke(app, ["serve", "--draft", "lookup", "--tree", "expand:4",
                                 "--port", "0"])  # fmt: skip
    assert r.exit_code == 2, r.output
    assert (
        "--tree expand:4: only a draft model or a chained head grows one, none drafts" in r.stderr
    )


def test_a_batch_grows_for_every_row_and_keeps_chains_beside_a_row_without_trees(pair, monkeypatch):
    """A server's batch: its greedy rows, joining at other lengths and asking other k, grow
    their trees together; a row that asked for no tree keeps the batch on chains and side
    leaves while it is there. Each row's text is the target's alone."""
    target, draft = pair
    grown = []
    real = expand.grow
    monkeypatch.setattr("specmlx.drafting.row_drafters.grow",
                        lambda *a, **kw: grown.append(len(a[2])) or real(*a, **kw))  # fmt: skip
    batch = Batch(target, draft, tree=TreeSize(8, expand=True))
    prompts = [PROMPT, [4, 4, 8, 15], [2, 6], [5, 5, 5]]
    rows = [batch.join(p, Decode(SamplingParams(0.0), K(k), 30, tree=TreeSize(8, expand=True)))
            for p, k in zip(prompts[:3], (3, 2, 4), strict=True)]  # fmt: skip
    for _ in range(3):
        batch.round(3)
    assert grown == [3, 3, 3]
    chained = batch.join(prompts[3], Decode(SamplingParams(0.0), K(3), 8))  # (leaves first)
    for _ in range(2):
        batch.round(3)
    assert len(grown) == 3 and rows[0].stats.tree_rounds == 5
    while batch.rows:
        batch.round(3)
        for r in [r for r in batch.rows if r.done]:
            batch.leave(r)
    assert len(grown) > 3  # (the rows grow again once it has left)
    for row, prompt, n in zip([*rows, chained], prompts, (30, 30, 30, 8), strict=True):
        plain = [e.token for e in generate(target, None, prompt, k=0, max_tokens=n)]
        assert row.ctx[len(prompt) :] == plain
