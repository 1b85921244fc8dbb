"""Batched speculation (decoding/batch.py over core/batch_caches.py): every row exactly its solo
generation, whoever else is in the batch and whoever joins or leaves; per-row rollback in
O(1); one host sync a round; kinds that cannot batch refused by name."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from families import FAMILIES, build, noisy_copy
from helpers import count_host_syncs, generate, make_tiny
from mlx_lm.models.cache import KVCache

from specmlx.core.batch_caches import BatchKVCache, batchable
from specmlx.core.kvstate import KVState
from specmlx.core.sampling import SamplingParams
from specmlx.core.stats import Stats
from specmlx.decoding.batch import Batch
from specmlx.decoding.decode import Decode
from specmlx.drafting.choosing.choosers import K
from specmlx.drafting.choosing.tree_size import TreeSize
from specmlx.errors import IncompatiblePair
from specmlx.serving.batch_k import BatchK

PROMPTS = [[1, 5, 9, 3, 7], [2], [4, 4, 4, 8, 15, 16, 23, 42, 8, 15, 16], [7, 7]]


@pytest.fixture(scope="module")
def pair():
    return make_tiny(0), make_tiny(1)


def solo(target, draft, prompt, k, n, **kw):
    return [e.token for e in generate(target, draft, prompt, k=k, max_tokens=n, **kw)]


def drain(batch, k, rows, out, leave=True, kept=None):
    """Rounds until every row in ``rows`` is done; tokens into out[row]; a done row leaves
    (its KVState into kept[row] when kept is a dict), or with leave=False stays."""
    while any(not r.done for r in rows):
        for r, events in zip(list(batch.rows), batch.round(k), strict=True):
            out.setdefault(id(r), []).extend(e.token for e in events)
        for r in [r for r in batch.rows if r.done and leave]:
            kv = batch.leave(r)
            if kept is not None:
                kept[id(r)] = kv


def test_rows_cache_writes_each_row_at_its_own_length_and_gives_back_per_row():
    c = BatchKVCache([2, 0])
    k = mx.arange(2 * 1 * 3 * 2, dtype=mx.float32).reshape(2, 1, 3, 2)  # (B, heads, L, dim)
    keys, _ = c.update_and_fetch(k, k)
    assert c.lens == [5, 3] and keys.shape[2] == 5
    got = np.array(keys[:, 0, :, 0])
    assert got[0, 2:5].tolist() == [0, 2, 4] and got[1, 0:3].tolist() == [6, 8, 10]
    mask = np.array(c.make_mask(1))  # after giving back: a query sees its own row only
    assert mask.shape == (2, 1, 1, 6) and mask[1, 0, 0].tolist() == [1, 1, 1, 1, 0, 0]
    c.give_back([3, 1])
    assert c.lens == [2, 2]
    solo_row = KVCache()
    solo_row.update_and_fetch(mx.ones((1, 1, 4, 2)), mx.ones((1, 1, 4, 2)))
    c.join(solo_row)
    assert c.lens == [2, 2, 4] and c.keys.shape[0] == 3
    back = c.leave(1)
    assert c.lens == [2, 4] and back.offset == 2 and c.keys.shape[0] == 2


@pytest.mark.parametrize("k", [0, 1, 3])
def test_greedy_rows_equal_their_solo_runs(pair, k):
    target, draft = pair
    want = [solo(target, None, p, 0, 24) for p in PROMPTS]
    batch = Batch(target, draft)
    rows = [batch.join(p, Decode(k=K(k), max_tokens=24)) for p in PROMPTS]
    out: dict = {}
    drain(batch, k, rows, out)
    assert [out[id(r)] for r in rows] == want
    if k:
        assert sum(r.stats.accepted for r in rows) > 0  # the draft did propose and land


def test_rows_joining_and_leaving_mid_generation_stay_exact(pair):
    """Row budgets differ, so rows leave at different rounds; new rows join between rounds
    while others are halfway; every row still equals its solo run."""
    target, draft = pair
    budgets = [30, 7, 18, 25]
    want = [solo(target, None, p, 0, n) for p, n in zip(PROMPTS, budgets, strict=True)]
    batch, out = Batch(target, draft), {}
    first = batch.join(PROMPTS[0], Decode(k=K(3), max_tokens=budgets[0]))
    second = batch.join(PROMPTS[1], Decode(k=K(3), max_tokens=budgets[1]))
    for _ in range(3):
        for r, events in zip(list(batch.rows), batch.round(3), strict=True):
            out.setdefault(id(r), []).extend(e.token for e in events)
        for r in [r for r in batch.rows if r.done]:
            batch.leave(r)
    third = batch.join(PROMPTS[2], Decode(k=K(3), max_tokens=budgets[2]))
    batch.round(0)  # a plain round between: the draft falls behind and catches up
    fourth = batch.join(PROMPTS[3], Decode(k=K(3), max_tokens=budgets[3]))
    rows = [first, second, third, fourth]
    # (the plain round's tokens: collected from the rows' contexts at the end)
    drain(batch, 2, rows, out)
    got = [r.ctx[len(p) :] for r, p in zip(rows, PROMPTS, strict=True)]
    assert got == want


def test_a_row_that_leaves_hands_back_caches_a_solo_generation_goes_on_from(pair):
    target, draft = pair
    batch = Batch(target, draft)
    a = batch.join(PROMPTS[0], Decode(k=K(3), max_tokens=12))
    batch.join(PROMPTS[2], Decode(k=K(3), max_tokens=40))
    drain(batch, 3, [a], {}, leave=False)
    kv = batch.leave(a)
    assert kv.tokens == a.ctx[:-1] and kv.target[0].offset == len(a.ctx) - 1
    stats = Stats()
    more = solo(target, draft, a.ctx, 3, 10, kv=kv, stats=stats)
    assert stats.cached_tokens == len(a.ctx) - 1  # the prefix came from the batch's caches
    assert a.ctx[len(PROMPTS[0]) :] + more == solo(target, None, PROMPTS[0], 0, 22)


@pytest.mark.parametrize("verify", ["token", "block"])
def test_a_sampled_row_draws_what_its_solo_run_draws(pair, verify):
    """Each row splits its own key as a solo generation does, so with the same k a sampled
    row's tokens are its solo run's, next to greedy and other sampled rows."""
    target, draft = pair
    samplers = [SamplingParams(0.9), SamplingParams(), SamplingParams(1.0, top_k=8),
                SamplingParams(0.7, 0.9)]  # fmt: skip
    want = [
        solo(target, draft, p, 3, 20, sampling=s, seed=11 + i, verify=verify)
        for i, (p, s) in enumerate(zip(PROMPTS, samplers, strict=True))
    ]
    batch, out = Batch(target, draft), {}
    rows = [
        batch.join(p, Decode(s, K(3), 20, seed=11 + i, verify=verify))
        for i, (p, s) in enumerate(zip(PROMPTS, samplers, strict=True))
    ]
    drain(batch, 3, rows, out)
    assert [out[id(r)] for r in rows] == want
    other = Batch(target, draft)
    moved = other.join(PROMPTS[0], Decode(samplers[0], K(3), 20, seed=12, verify=verify))
    drain(other, 3, [moved], out)
    assert out[id(moved)] != want[0]  # the seed matters: the comparison means something


@pytest.mark.parametrize("verify", ["token", "block"])
def test_a_sampled_chain_beside_a_tree_draws_what_its_solo_run_draws(pair, verify):
    """A greedy row's tree makes the batch's round a tree round; a sampled row without leaves
    still accepts its chain by its own rule (not the tree's, which draws other tokens from the
    same keys), so it draws what it draws alone."""
    target, draft = pair
    hot = SamplingParams(0.9)
    want = solo(target, draft, PROMPTS[0], 3, 20, sampling=hot, seed=5, verify=verify)
    greedy = solo(target, draft, PROMPTS[2], 3, 20)
    batch, out = Batch(target, draft, tree=TreeSize(8)), {}
    rows = [batch.join(PROMPTS[0], Decode(hot, K(3), 20, seed=5, verify=verify)),
            batch.join(PROMPTS[2], Decode(k=K(3), max_tokens=20, tree=TreeSize(8)))]  # fmt: skip
    drain(batch, 3, rows, out)
    assert rows[1].stats.tree_rounds > 0  # (the rounds were tree rounds)
    assert [out[id(r)] for r in rows] == [want, greedy]


def test_a_k_past_what_the_rows_can_emit_drafts_only_what_they_can_use(pair):
    """A round asked for 1000 drafts a row (a client's num_draft) drafts and verifies only
    what the rows' budgets let them emit: 7 steps for rows with 8 tokens to go; rows may
    ask for their own k, and the output stays each row's greedy text."""
    target, draft = pair
    batch = Batch(target, draft)
    rows = [batch.join(p, Decode(k=K(3), max_tokens=8)) for p in PROMPTS[:3]]
    calls = []
    real = batch.drafter.model

    class Counting:  # the draft model, counting its forward passes
        def __call__(self, x, cache=None):
            calls.append(x.shape)
            return real(x, cache=cache)

    batch.drafter.model = Counting()
    out: dict = {}
    for r, events in zip(list(batch.rows), batch.round([1000, 2, 0]), strict=True):
        out[id(r)] = [e.token for e in events]
    assert len(calls) == 7, calls  # the catch-up, then 6 one-token steps
    assert [r.stats.drafted for r in rows] == [7, 2, 0]
    batch.drafter.model = real
    drain(batch, 1000, rows, out)
    assert [r.ctx[len(p) :] for r, p in zip(rows, PROMPTS[:3], strict=True)] == [
        solo(target, None, p, 0, 8) for p in PROMPTS[:3]
    ]


def test_a_row_that_made_tokens_elsewhere_keeps_its_whole_budget_and_its_keys(pair):
    """A request that made tokens alone (or before it was parked) joins with them at the
    end of its prompt: they count against its whole budget, and a sampled row draws from
    its seed where it stopped, so it ends exactly as its solo run (keys come from the seed
    and the position, not from when it joined)."""
    target, draft = pair
    hot = SamplingParams(1.0)
    events = list(generate(target, draft, PROMPTS[0], k=3, max_tokens=20, sampling=hot, seed=3))
    want = [e.token for e in events]
    # where the solo run's rounds end (a round's last token is the target's own): a request
    # goes on from a round's end (the batcher lets the engine finish its round first)
    ends = [i + 1 for i, e in enumerate(events) if not e.from_draft]
    assert len(ends) < 20  # drafts were accepted: the rounds' ends are not every token
    for made in [0, *ends[1:4]]:
        first = want[:made]
        batch = Batch(target, draft)
        row = batch.join(PROMPTS[0] + first, Decode(hot, K(3), 20, seed=3), generated=made)
        batch.join(PROMPTS[2], Decode(k=K(3), max_tokens=30))  # a neighbour
        out: dict = {}
        drain(batch, 3, [row], out, leave=False)
        assert first + out[id(row)] == want, made
        assert row.stats.generated == 20 and row.stops.count == 20


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_next"])
def test_one_host_sync_a_round(pair, monkeypatch, family):
    """Full attention, sliding windows and recurrent state alike: the per-row rollback
    (lengths, the recorded recurrence, the draft's kept states) adds no host sync."""
    target, draft = pair if family == "llama" else (build(family, 3, 0), build(family, 3, 1))
    batch = Batch(target, draft)
    for p in PROMPTS:
        batch.join(p, Decode(k=K(3), max_tokens=40))
    batch.round(3)
    count = [0]
    count_host_syncs(monkeypatch, count)
    batch.round(3)
    batch.round(3)
    assert count[0] == 2  # one tolist a round, whatever B is


WINDOW_FAMILIES = [f for f, (_, kind) in FAMILIES.items() if kind == "window"]


@pytest.mark.parametrize("family", WINDOW_FAMILIES)
def test_sliding_window_rows_equal_their_solo_runs(family):
    """Rows of a sliding-window family (a window of 8) at lengths inside and far past the
    window, joining at different rounds, each equal their solo runs; a row that leaves
    hands back a window cache a solo generation goes on from."""
    target, draft = build(family, 3, 0), noisy_copy(family, 3, 0, 0.3)
    prompts = [[1, 5, 9], list(range(3, 24)), [4, 4, 4, 8, 15, 16, 23, 42, 8, 15, 16]]
    want = [solo(target, None, p, 0, 20) for p in prompts]
    batch, out = Batch(target, draft), {}
    rows = [batch.join(p, Decode(k=K(3), max_tokens=20)) for p in prompts[:2]]
    batch.round(3)  # (its tokens are read back from the contexts below)
    rows.append(batch.join(prompts[2], Decode(k=K(3), max_tokens=20)))
    kept: dict = {}
    drain(batch, 2, rows, out, kept=kept)
    assert [r.ctx[len(p) :] for r, p in zip(rows, prompts, strict=True)] == want
    more = solo(target, draft, rows[1].ctx, 3, 6, kv=kept[id(rows[1])])
    assert rows[1].ctx[len(prompts[1]) :] + more == solo(target, None, prompts[1], 0, 26)


def test_the_window_mask_is_what_makes_window_rows_exact(monkeypatch):
    """The same rows with the window left out of the rows' mask diverge from their solo
    runs: the window test can fail."""
    target, draft = build("gemma3_text", 3, 0), build("gemma3_text", 3, 1)
    prompts = [list(range(3, 24)), [1, 5, 9]]
    want = [solo(target, None, p, 0, 12) for p in prompts]
    plain = BatchKVCache.make_mask

    def unwindowed(self, n, return_array=False, window_size=None):
        window, self.window = self.window, None
        try:
            return plain(self, n, True)  # every key up to the query's own position
        finally:
            self.window = window

    monkeypatch.setattr(BatchKVCache, "make_mask", unwindowed)
    batch, out = Batch(target, draft), {}
    rows = [batch.join(p, Decode(k=K(2), max_tokens=12)) for p in prompts]
    drain(batch, 2, rows, out)
    assert [r.ctx[len(p) :] for r, p in zip(rows, prompts, strict=True)] != want


RECURRENT_BATCHED = ["qwen3_5", "qwen3_next", "mamba2", "nemotron_h", "falcon_h1",
                     "granitemoehybrid"]  # fmt: skip


@pytest.mark.parametrize("family", RECURRENT_BATCHED)
def test_recurrent_rows_equal_their_solo_runs(family):
    """Rows of a recurrent family (the target's state recomputed per row over its kept
    steps, the draft's taken from its state after each step), joining at different rounds
    with prompts of different lengths, each equal their solo runs, greedy and sampled; a row
    that leaves hands back a state a solo generation goes on from."""
    target, draft = build(family, 4, 0), noisy_copy(family, 4, 0, 0.3)
    prompts = [[1, 5, 9], list(range(3, 17)), [4, 4, 4, 8, 15, 16, 23, 42, 8, 15, 16]]
    samplers = [SamplingParams(), SamplingParams(0.9), SamplingParams()]
    want = [solo(target, draft, p, 3, 16, sampling=s, seed=5)
            for p, s in zip(prompts, samplers, strict=True)]  # fmt: skip
    batch, out = Batch(target, draft), {}
    rows = [batch.join(p, Decode(s, K(3), 16, seed=5))
            for p, s in zip(prompts[:2], samplers[:2], strict=True)]  # fmt: skip
    for r, events in zip(list(batch.rows), batch.round(3), strict=True):
        out.setdefault(id(r), []).extend(e.token for e in events)
    rows.append(batch.join(prompts[2], Decode(samplers[2], K(3), 16, seed=5)))
    kept: dict = {}
    drain(batch, 3, rows, out, kept=kept)
    assert [out[id(r)] for r in rows] == want
    assert sum(r.stats.accepted for r in rows) > 0 and sum(r.stats.drafted for r in rows) > sum(
        r.stats.accepted for r in rows
    )  # drafts were kept and given back: the per-row rollback ran both ways
    more = solo(target, draft, rows[0].ctx, 3, 6, kv=kept[id(rows[0])])
    assert rows[0].ctx[len(prompts[0]) :] + more == solo(target, None, prompts[0], 0, 22)


@pytest.mark.parametrize("family", ["qwen3_5", "mamba2"])
def test_a_recurrent_draft_row_that_keeps_nothing_hands_back_the_state_it_holds(family):
    """A row whose round keeps no token (its first is an EOS: it ends) cannot give back its
    draft's catch-up in a recurrent layer: the state handed back is the one after all of its
    context, and draft_held says so (one past the target's). Taking the state after the
    last drafting step instead (the index -1) fails."""
    from mlx_lm.models.cache import make_prompt_cache

    target, draft = build(family, 4, 0), noisy_copy(family, 4, 0, 0.3)
    prompt = list(range(3, 17))
    first = solo(target, None, prompt, 0, 1)[0]
    batch = Batch(target, draft)
    row = batch.join(prompt, Decode(k=K(3), max_tokens=16, eos_ids=(first,)))
    batch.join([1, 5, 9], Decode(k=K(3), max_tokens=16))  # a neighbour that drafts on
    batch.round(3)
    assert row.done and row.ctx == prompt
    kv = batch.leave(row)
    assert kv.tokens == prompt[:-1] and kv.draft_held == len(prompt)
    fresh = make_prompt_cache(draft)
    draft(mx.array(prompt)[None], cache=fresh)
    got = [c for c in kv.draft if hasattr(c, "cache")]
    want = [c for c in fresh if hasattr(c, "cache")]
    assert got and len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g.cache, w.cache, strict=True):
            if b is not None:
                np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-4)


def test_a_row_state_rolled_back_as_if_every_row_kept_alike_diverges(monkeypatch):
    """The same rows with every row's state recomputed over the longest kept count (the
    per-row mask dropped) diverge from their solo runs: the recurrent test can fail."""
    from specmlx.core import recurrent

    target, draft = build("qwen3_5", 4, 0), noisy_copy("qwen3_5", 4, 0, 0.3)
    prompts = [[1, 5, 9], list(range(3, 17))]
    want = [solo(target, None, p, 0, 16) for p in prompts]
    real = recurrent.PassRecorder.settle_rows
    monkeypatch.setattr(recurrent.PassRecorder, "settle_rows",
                        lambda self, ms, states: real(self, [max(ms)] * len(ms), states))  # fmt: skip
    batch, out = Batch(target, draft), {}
    rows = [batch.join(p, Decode(k=K(3), max_tokens=16)) for p in prompts]
    drain(batch, 3, rows, out)
    assert [out[id(r)] for r in rows] != want


def test_a_recurrent_model_the_batch_cannot_roll_back_is_refused_by_name():
    model = build("rwkv7", 2, 0)
    why = batchable(model)
    assert why is not None and "rwkv7" in why
    with pytest.raises(IncompatiblePair, match="cannot decode in a batch"):
        Batch(model, None)


def test_batch_k_tries_each_k_then_keeps_the_fastest_and_borrows_a_new_widths_figures():
    chooser = BatchK(ks=(0, 2, 4), explore_every=5)
    rate = {0: 10.0, 2: 25.0, 4: 15.0}  # tokens per second at 4 rows
    tried = []
    for _ in range(3):
        k = chooser(4)
        tried.append(k)
        chooser.observe(4, k, rate[k], 1.0)
    assert sorted(tried) == [0, 2, 4]
    picks = [chooser(4) for _ in range(4)]
    assert picks == [2, 2, 2, 2]
    assert chooser(4) in (0, 2, 4)  # the fifth: an exploring round
    # 8 rows: never run there, so 4 rows' figures decide, without trying every k again
    assert chooser(8) == 2
    chooser.observe(8, 2, 5.0, 1.0)  # at 8 rows drafting collapses: the plain step wins
    chooser.observe(8, 0, 30.0, 1.0)
    assert chooser(8) == 0


def test_the_memory_plan_counts_a_batchs_window_layers_at_the_whole_context():
    """A batch's rows keep every key of their window layers (core.batch_caches), so the plan for
    a row counts them as full attention; a solo row's window layers hold their window."""
    from families import family_config

    from specmlx.models.footprint import kv_bytes

    config = family_config("gemma3_text", 6)  # a window of 8: layers 3 and 6 full
    solo_bytes, row_bytes = kv_bytes(config, 4096, 4), kv_bytes(config, 4096, 4, batched=True)
    per_layer = 2 * 2 * 8 * 4  # K and V, 2 kv heads of 8, float32: per token
    assert row_bytes == 6 * per_layer * 4096
    assert solo_bytes < row_bytes / 2


# ---------------------------------------------------------------- heads over hidden states


@pytest.fixture(scope="module")
def toy_mtp():
    """A Qwen3.5 target trained on a toy language and its trained MTP head (tests/mtp_toy.py):
    a head whose drafts are often kept and often not."""
    from mtp_toy import toy_head, toy_target

    target = toy_target()
    return target, toy_head(target)


def _eagle3_over(target):
    """A random EAGLE-3 head (a narrower draft vocabulary) over a tiny llama target."""
    from mlx.utils import tree_map

    from specmlx.distill.published import head_json
    from specmlx.drafting.heads import eagle3

    config = head_json("eagle3", dict(target.args.__dict__, model_type="llama"), layers=1,
                       width=0, draft_vocab=100, block=2, mask_id=0)  # fmt: skip
    head = eagle3.Eagle3Head(target, eagle3.head_config(config, config | {"hidden_size": 32,
                             "num_hidden_layers": 8, "vocab_size": 128}, "h"))  # fmt: skip
    mx.random.seed(7)
    head.update(tree_map(lambda p: 0.3 * mx.random.normal(p.shape), head.parameters()))
    ids = np.sort(np.random.default_rng(0).choice(128, 100, replace=False))
    head.map_vocabulary(mx.array(ids - np.arange(100)))
    mx.eval(head.parameters())
    return head


def _dflash_over(target):
    """A random DFlash drafter (2 layers, blocks of 8) over a tiny llama target."""
    from mlx.utils import tree_map

    from specmlx.distill.published import head_json
    from specmlx.drafting.heads import dflash

    t = {"hidden_size": 32, "num_hidden_layers": 8, "vocab_size": 128, "intermediate_size": 64,
         "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
    config = head_json("dflash", t, layers=2, width=0, draft_vocab=0, block=8, mask_id=127)
    head = dflash.DFlashHead(target, dflash.head_config(config, t, "d"))
    mx.random.seed(8)
    head.update(tree_map(lambda p: 0.3 * mx.random.normal(p.shape), head.parameters()))
    mx.eval(head.parameters())
    return head


@pytest.mark.parametrize("which", ["mtp", "eagle3", "dflash"])
def test_head_rows_draft_and_keep_what_their_solo_runs_do(toy_mtp, which):
    """A head in a batch (a trained MTP head over a recurrent Qwen3.5, a random EAGLE-3
    head over a llama; a random DFlash drafter, each row's block drafted at its own width
    from its own context): rows joining mid-way, greedy and sampled, and a stretch of
    plain rounds (the waiting pairs pile up past the catch-up and are fed), each row's
    tokens are its solo run's; a row that leaves hands back what a solo run goes on from."""
    from mtp_toy import toy_language

    if which == "mtp":
        target, head = toy_mtp
        prompts = [toy_language(1, 6, 900 + i)[0].tolist() for i in range(3)]
    else:
        target = build("llama", 8, 0, vocab=128)
        head = _eagle3_over(target) if which == "eagle3" else _dflash_over(target)
        prompts = [[1, 5, 9], list(range(3, 17)), [4, 4, 4, 8, 15, 16, 23, 42]]
    samplers = [SamplingParams(), SamplingParams(0.9), SamplingParams()]

    want = [solo(target, head, p, 3, 30, sampling=s, seed=5)
            for p, s in zip(prompts, samplers, strict=True)]  # fmt: skip
    batch, out = Batch(target, head), {}
    rows = [batch.join(prompts[0], Decode(samplers[0], K(3), 30, seed=5))]
    for _ in range(20):  # plain rounds: the head's waiting pairs pile up, then are fed
        batch.round(0)
    rows += [batch.join(p, Decode(s, K(3), 30, seed=5))
             for p, s in zip(prompts[1:], samplers[1:], strict=True)]  # fmt: skip
    kept: dict = {}
    drain(batch, 3, rows, out, kept=kept)
    assert [r.ctx[len(p) :] for r, p in zip(rows, prompts, strict=True)] == want
    # (a random DFlash drafter drafts, but need not be right)
    assert sum(r.stats.drafted if which == "dflash" else r.stats.accepted for r in rows) > 0
    kv = kept[id(rows[2])]
    more = solo(target, head, rows[2].ctx, 3, 6, kv=kv)
    assert rows[2].ctx[len(prompts[2]) :] + more == solo(target, None, prompts[2], 0, 36)


@pytest.mark.parametrize("which", ["llama", "gemma3_text", "qwen3_5", "eagle3", "dflash"])
def test_a_row_joining_beside_one_that_holds_its_prefix_starts_from_a_copy(which):
    """Two requests sent together with one long document: the second joins from a copy of
    the first's caches (Batch.share: the target's, the draft model's or a head's) and
    prefills only its own tail; both rows equal their solo runs. A recurrent target shares
    nothing (its state does not cut back)."""
    if which in ("eagle3", "dflash"):
        target = build("llama", 8, 0, vocab=128)
        draft = _eagle3_over(target) if which == "eagle3" else _dflash_over(target)
    else:
        target, draft = build(which, 4, 0, 2.0), noisy_copy(which, 4, 0, 0.05, 2.0)
    doc = list(range(1, 40))
    prompts = [doc + [5, 6], doc + [9]]
    batch, out, stats = Batch(target, draft), {}, Stats()
    a = batch.join(prompts[0], Decode(k=K(3), max_tokens=20))
    batch.round(3)  # a is decoding when b comes
    b = batch.join(prompts[1], Decode(k=K(3), max_tokens=20), batch.share(prompts[1], KVState()),
                   stats)  # fmt: skip
    kept: dict = {}
    drain(batch, 3, [a, b], out, kept=kept)
    for row, p in zip([a, b], prompts, strict=True):
        assert row.ctx[len(p) :] == solo(target, None, p, 0, 20)
    assert b.stats.drafted > 0
    head = which not in FAMILIES
    if which in ("llama", "eagle3", "dflash"):
        # the draft's cache is what a solo run builds (the tokens cannot tell: a wrong
        # draft state only drafts worse)
        alone = KVState()
        solo(target, draft, prompts[1], 3, 20, kv=alone)
        mine = kept[id(b)]
        n = min(mine.draft_held, alone.draft_held)
        assert n >= len(doc)
        for c, d in zip(mine.draft, alone.draft, strict=True):
            assert mx.allclose(c.keys[..., :n, :], d.keys[..., :n, :], atol=1e-4).item()
    if not head and FAMILIES[which][1] == "recurrent":
        assert stats.cached_tokens == 0
    else:  # a head's state may keep one token less: its last pair reads the next token
        assert len(doc) - head <= stats.cached_tokens <= len(doc), which


def test_batch_k_keeps_what_it_measured_for_the_next_server(pair, specmlx_home):
    """What BatchK measured is saved per machine and pair (atomically, best effort) and a
    new server's batcher starts from it; a damaged file is measured again, not trusted."""
    from types import SimpleNamespace

    from specmlx.decoding.session import Pair
    from specmlx.distributed.ranks import World
    from specmlx.drafting.choosing.choosers import ChooserStore
    from specmlx.serving.batcher import Batcher

    target, draft = pair
    warned: list[str] = []

    def worker(persist=True, draft_id="d1"):
        return SimpleNamespace(
            session=SimpleNamespace(pair=Pair(target, draft, target_id="t1", draft_id=draft_id)),
            tree=TreeSize.of("auto"),
            totals=None,
            count=None,
            choosers=ChooserStore(persist=persist, warn=warned.append),
            world=World(None),
        )

    first = Batcher(worker(), 4)
    first.k.observe(2, 3, 12.0, 1.5)
    first.k.observe(4, 0, 9.0, 1.0)
    first.kept.save()
    assert first.kept.path.is_file() and first.kept.path.is_relative_to(specmlx_home)
    again = Batcher(worker(), 4)
    assert again.k.seen == {(2, 3): [12.0, 1.5, 1], (4, 0): [9.0, 1.0, 1]}
    assert Batcher(worker(persist=False), 4).k.seen == {}  # (ranks other than 0, the bench)
    first.kept.path.write_text('{"version": 1, "seen": {"2,x": [1, 2, 3]}}')
    assert Batcher(worker(), 4).k.seen == {}  # garbage: measured again
    first.kept.save()
    assert Batcher(worker(draft_id="d2"), 4).k.seen == {}  # another pair's are not this one's


def test_a_rank_lost_in_a_batch_tells_every_client_why_and_stops_the_ranks(pair):
    """With ranks, a round or a join that fails (a follower died: MLX's ring raises a
    RuntimeError) may leave the ranks apart: every running request and the joining one end
    with the 503 rank_failed error naming the lost rank, never a bare 500, and the ranks
    stop."""
    import queue
    from types import SimpleNamespace

    from specmlx.decoding.session import Pair, Request
    from specmlx.distributed.ranks import RankFailure, World
    from specmlx.drafting.choosing.choosers import ChooserStore
    from specmlx.serving.api_errors import as_api_error
    from specmlx.serving.batcher import Batcher, _Live

    target, draft = pair
    lost = RuntimeError("[ring] Recv failed with errno=104")
    stopped: list[str] = []

    class Job:
        def __init__(self):
            self.said, self.request = (
                [],
                Request([1, 2, 3], k=K(3), max_tokens=8),
            )
            self.cancelled = SimpleNamespace(is_set=lambda: False)
            self.editor = False

        def emit(self, kind, value):
            self.said.append((kind, value))

    def fail(*_args):
        raise lost

    w = SimpleNamespace(
        session=SimpleNamespace(pair=Pair(target, draft, target_id="t", draft_id="d")), tree=TreeSize.of("auto"),
        choosers=ChooserStore(persist=False, warn=print),
        world=World(None, rank=0, size=2),
        watchdog=None, fatal=stopped.append, send_ops=fail, draft_stop=False, stopping=False,
        totals=SimpleNamespace(failed=0, cancelled=0), draft=None, queue=queue.Queue(),
        label=lambda job: None, failed=lambda job, sources, e: None, count=lambda s, c: None,
    )  # fmt: skip
    batcher = Batcher(w, 4)
    rows = [Job(), Job()]
    for job in rows:  # two rows running (a fake batch: its round is never reached)
        row = SimpleNamespace(drafts=False)
        batcher.live.append(_Live(job, row, None, None))
    batcher.batch = SimpleNamespace(
        leave=lambda row: None,
        target=target,
        draft=draft,
        vocab=None,
        pass_ratio=None,
        tree=TreeSize.of("auto"),
    )
    batcher._round()
    joining = Job()
    batcher._admit(joining)
    for job in [*rows, joining]:
        (kind, error), *_ = job.said
        assert kind == "error" and isinstance(error, RankFailure), job.said
        api = as_api_error(error)
        assert (api.status, api.code) == (
            503,
            "rank_failed",
        ) and "lost the connection" in api.message
    assert not batcher.live and len(stopped) == 2 and stopped[0].startswith("the ranks stopped")
