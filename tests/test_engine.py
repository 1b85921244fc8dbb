"""Engine mechanics on tiny random models: losslessness, rollback, stops, syncs."""

import itertools
import json
import random
import time
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import count_host_syncs, generate, make_tiny
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import make_prompt_cache

from specmlx.core.cursor import Cursor
from specmlx.core.sampling import SamplingParams
from specmlx.core.stats import RoundReport, Stats
from specmlx.decoding.driver import TIME_DRAFT_EVERY, DraftClock, Driver
from specmlx.decoding.engine import Decode, KVState, generate_tokens, prefill
from specmlx.decoding.round import Row
from specmlx.decoding.stops import Stops
from specmlx.decoding.verifiers import LoneTarget
from specmlx.drafting.choosing.adaptive import DRAFT_CHUNKS, Acceptance, AdaptiveK, _chunk
from specmlx.drafting.choosing.choosers import AUTO, K
from specmlx.drafting.choosing.cost_curve import CostCurve
from specmlx.errors import BadInput

PROMPTS = [[1, 5, 9, 3, 7], [2], [4, 4, 4, 8, 15, 16, 23, 42, 8, 15, 16]]


def tokens(*args, **kwargs):
    return [e.token for e in generate(*args, **kwargs)]


class Scripted(nn.Module):
    """A draft that is the target except on scripted steps, where its argmax is wrong.
    ``script`` cycles over draft calls: True means 'agree with the target'."""

    def __init__(self, base, script):
        super().__init__()
        self.base, self.script = base, itertools.cycle(script)
        self.cache = None  # the caches of the last call: the draft's live ones

    @property
    def layers(self):
        return self.base.layers

    def __call__(self, x, cache=None):
        self.cache = cache if cache is not None else self.cache  # (not a width probe's)
        logits = self.base(x, cache=cache)
        if next(self.script):
            return logits
        wrong = (mx.argmax(logits[:, -1:], axis=-1) + 1) % logits.shape[-1]  # (B, 1)
        bump = (mx.arange(logits.shape[-1]) == wrong[..., None]) * 1e4
        return mx.concatenate([logits[:, :-1], logits[:, -1:] + bump], axis=1)


@pytest.fixture(scope="module")
def pair():
    return make_tiny(0), make_tiny(1)


@pytest.mark.parametrize("k", range(1, 9))
def test_greedy_equals_target_only(pair, k):
    target, _ = pair
    for seed, prompt in itertools.product((1, 2), PROMPTS):
        draft = make_tiny(seed)
        base = tokens(target, None, prompt, max_tokens=24)
        assert tokens(target, draft, prompt, k=k, max_tokens=24) == base


@pytest.mark.parametrize("k", [1, 3, 8])
def test_draft_equal_to_target_accepts_everything(pair, k):
    target, _ = pair
    stats = Stats()
    out = tokens(target, target, PROMPTS[0], k=k, max_tokens=27, stats=stats)
    assert out == tokens(target, None, PROMPTS[0], max_tokens=27)
    assert stats.acceptance_rate == 1.0
    assert stats.rounds == -(-27 // (k + 1))  # every pass yields k + 1 tokens


def test_adversarial_draft_rejects_everything(pair):
    target, _ = pair
    stats = Stats()
    out = tokens(target, Scripted(target, [False]), PROMPTS[0], k=4, max_tokens=20, stats=stats)
    assert out == tokens(target, None, PROMPTS[0], max_tokens=20)
    assert stats.accepted == 0 and stats.rounds == 20 and stats.accept_hist == [20]


@pytest.mark.parametrize("draft_vocab", [60, 64, 80])
def test_vocab_size_mismatch_is_lossless(pair, draft_vocab):
    # like Code Llama 7B (32016 ids) drafting for 34B (32000): only shared ids are proposed
    target, _ = pair
    draft = make_tiny(3, vocab=draft_vocab)
    for temp in (0.0, 1.0):
        out = tokens(
            target,
            draft,
            PROMPTS[0],
            k=3,
            max_tokens=30,
            sampling=SamplingParams(temp),
            seed=5,
        )
        assert all(t < 64 for t in out)
        if temp == 0.0:
            assert out == tokens(target, None, PROMPTS[0], max_tokens=30)


def test_lookup_and_hybrid_are_lossless(pair):
    target, draft = pair
    for prompt in PROMPTS:
        base = tokens(target, None, prompt, max_tokens=30)
        assert tokens(target, None, prompt, lookup=True, k=4, max_tokens=30) == base
        assert tokens(target, draft, prompt, lookup=True, k=4, max_tokens=30) == base


def test_lookup_proposes_from_repeated_text(pair):
    target, _ = pair
    base = tokens(target, None, PROMPTS[0], max_tokens=40)
    prompt = PROMPTS[0] + base  # the continuation is in the prompt: lookup should find it
    stats = Stats()
    out = tokens(target, None, prompt, lookup=True, k=4, max_tokens=20, stats=stats)
    assert out == tokens(target, None, prompt, max_tokens=20)
    assert stats.accepted > 0 and stats.rounds < 20


def test_seeded_sampling_is_reproducible(pair):
    target, draft = pair
    kw = dict(k=3, max_tokens=25, sampling=SamplingParams(0.9, 0.9), seed=11)
    a = tokens(target, draft, PROMPTS[0], **kw)
    assert a == tokens(target, draft, PROMPTS[0], **kw)
    assert a != tokens(target, draft, PROMPTS[0], **{**kw, "seed": 12})
    plain = dict(max_tokens=25, sampling=SamplingParams(0.9), seed=11)
    assert tokens(target, None, PROMPTS[0], **plain) == tokens(target, None, PROMPTS[0], **plain)


def test_block_verification_keeps_caches_exact_and_is_reproducible(pair):
    """Block verification only changes how many drafts a round keeps: the caches still hold
    exactly the context afterwards, and a seed reproduces the output."""
    target, draft = pair
    kw = dict(sampling=SamplingParams(1.0, top_p=0.9), max_tokens=30, seed=5, verify="block")
    for k in (1, 3, 6):
        kv, stats = KVState(), Stats()
        out = tokens(target, draft, PROMPTS[0], k=k, kv=kv, stats=stats, **kw)
        assert len(out) == 30 and kv.tokens == (PROMPTS[0] + out)[:-1]
        _check_caches(target, draft, kv.target, kv.draft, PROMPTS[0] + out, False)
        assert stats.accepted <= stats.drafted and sum(stats.accept_hist) == stats.rounds
        assert out == tokens(target, draft, PROMPTS[0], k=k, **kw)
    lookup = tokens(target, draft, PROMPTS[2], k=3, lookup=True, **kw)
    assert lookup == tokens(target, draft, PROMPTS[2], k=3, lookup=True, **kw)
    # greedy decoding is the same under both rules: the target's own tokens
    greedy = tokens(target, draft, PROMPTS[0], k=4, max_tokens=30, verify="block")
    assert greedy == tokens(target, None, PROMPTS[0], max_tokens=30)


def _keys(cache):
    """The valid part of each layer's key cache (stale entries past the offset are ignored)."""
    return [np.array(c.state[0][..., : c.offset, :]) for c in cache]


def _check_prefix(model, cache, ctx):
    fresh = make_prompt_cache(model)
    if ctx:
        model(mx.array(ctx)[None], cache=fresh)
    assert cache[0].offset == len(ctx)
    for got, want in zip(_keys(cache), _keys(fresh), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4)


def _check_caches(target, draft, tcache, dcache, ctx, drafted, queued=False):
    """Between rounds the target cache equals a fresh prefill of ctx[:-1] (all of ctx when a
    plain round queued the next pass). The draft cache
    equals a fresh prefill of a prefix of ctx: ctx[:-1], or ctx[:-2] after a fully accepted
    round (the last draft was never fed); it lags further only while no draft ran (k = 0),
    catching up when it drafts next."""
    _check_prefix(target, tcache, ctx if queued else ctx[:-1])
    d_off = dcache[0].offset
    assert d_off <= len(ctx) - 1
    if drafted:
        assert d_off >= len(ctx) - 2
    _check_prefix(draft, dcache, ctx[:d_off])


@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,  # the same 25 cases every run: a failure reproduces
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    script=st.lists(st.booleans(), min_size=1, max_size=12),
    ks=st.lists(st.integers(0, 6), min_size=1, max_size=8),
    max_tokens=st.integers(1, 25),
    eos=st.sets(st.integers(0, 63), max_size=3),
)
def test_caches_hold_exactly_the_accepted_context(pair, script, ks, max_tokens, eos):
    target, base_draft = pair
    draft = Scripted(base_draft, script)
    prompt = PROMPTS[0]
    kv = KVState(make_prompt_cache(target), make_prompt_cache(draft))
    tcache = kv.target
    out: list[int] = []
    schedule = itertools.cycle(ks)
    upcoming = [next(schedule)]
    queued = [False]

    def choose(last):  # called between rounds: check the state, then pick k
        ctx = prompt + out
        drafted = last is not None and last.k > 0
        # (the draft drafts on its own copy of the caches, a batch's row of one: the live ones)
        _check_caches(target, base_draft, tcache, draft.cache, ctx, drafted, queued[0])
        k = upcoming.pop()
        upcoming.append(next(schedule))
        # a plain round that promised a plain next one queues its pass, budget permitting
        queued[0] = k == 0 and upcoming[0] == 0 and len(out) + 1 < max_tokens
        return k

    choose.plain_next = lambda: upcoming[0] == 0  # the schedule keeps its word
    stats = Stats()
    for e in generate(
        target,
        draft,
        prompt,
        k=choose,
        max_tokens=max_tokens,
        eos_ids=eos,
        kv=kv,
        stats=stats,
    ):
        out.append(e.token)
    _check_caches(target, base_draft, tcache, kv.draft, prompt + out, False)
    assert kv.tokens == (prompt + out)[:-1] and kv.draft[0].offset == kv.draft_held
    assert out == tokens(target, None, prompt, max_tokens=max_tokens, eos_ids=eos)
    assert stats.accepted <= stats.drafted and sum(stats.accept_hist) == stats.rounds


def test_stops_truncate_exactly(pair):
    target, draft = pair
    base = tokens(target, None, PROMPTS[0], max_tokens=30)
    eos = base[7]
    cut = base.index(eos)
    for k in (0, 2, 5):
        stats = Stats()
        out = tokens(target, draft, PROMPTS[0], k=k, max_tokens=30, eos_ids=[eos], stats=stats)
        assert out == base[:cut] and stats.finish_reason == "stop"
        stop = base[10:12]
        out = tokens(target, draft, PROMPTS[0], k=k, max_tokens=30, stop_ids=[stop])
        assert out[-2:] == stop and out == base[: len(out)]
        stats = Stats()
        assert tokens(target, draft, PROMPTS[0], k=k, max_tokens=7, stats=stats) == base[:7]
        assert stats.finish_reason == "length" and stats.generated == 7


def test_plain_rounds_queue_the_next_pass(pair):
    """k = 0 overlaps like target-only decoding: each target pass is built before the token
    of the pass before it is read back, and none is wasted; a stop undoes the queued one."""
    target, draft = pair
    log = []

    class Logged(nn.Module):
        def __init__(self):
            super().__init__()
            self.base = target

        @property
        def layers(self):
            return self.base.layers

        def __call__(self, x, cache=None):
            log.append("pass")
            return self.base(x, cache=cache)

    tolist = mx.array.tolist

    def logged_tolist(a):
        log.append("read")
        return tolist(a)

    base = tokens(target, None, PROMPTS[0], max_tokens=12)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mx.array, "tolist", logged_tolist)
        # (vocab_size given: no shape probe through the target to muddle the log)
        out = tokens(Logged(), draft, PROMPTS[0], k=0, max_tokens=12, vocab_size=64)
    assert out == base
    decode = log[log.index("pass") + 1 :]  # after the prefill pass
    assert decode[:3] == ["pass", "pass", "read"], log  # round 1 queued round 2's pass
    assert decode.count("pass") == 12 and decode.count("read") == 12, log
    for k in (0, 3):
        eos = base[6]
        kv = KVState(make_prompt_cache(target))
        out = tokens(target, draft, PROMPTS[0], k=k, eos_ids=[eos], kv=kv)
        assert out == base[: base.index(eos)]
        tcache = kv.target
        assert tcache[0].offset == len(PROMPTS[0]) + len(out) - 1


def test_a_chooser_that_breaks_its_word_stays_lossless(pair):
    """plain_next is only a hint for speed: a chooser that promises plain rounds and then
    drafts gets the same tokens as one that promises nothing (greedy: the target's; sampled:
    the same draws from the same keys), and a consistent cache at the end."""
    target, draft = pair

    def chooser(promise):
        schedule = itertools.cycle([0, 3, 0, 0, 2, 5])

        def choose(_last):
            return next(schedule)

        choose.plain_next = lambda: promise
        return choose

    for temp in (0.0, 1.0):
        kv = KVState()
        kw = dict(max_tokens=40, sampling=SamplingParams(temp), seed=3)
        out = tokens(target, draft, PROMPTS[2], k=chooser(True), kv=kv, **kw)
        tcache = kv.target
        assert tcache[0].offset == len(PROMPTS[2]) + len(out) - 1
        assert out == tokens(target, draft, PROMPTS[2], k=chooser(False), **kw)
        if temp == 0.0:
            assert out == tokens(target, None, PROMPTS[2], **kw)


def test_target_only_cache_consistent_after_stop(pair):
    target, _ = pair
    kv = KVState()
    out = tokens(target, None, PROMPTS[0], max_tokens=9, kv=kv)
    assert kv.target[0].offset == len(PROMPTS[0]) + len(out) - 1 == len(kv.tokens)


class Watched(AdaptiveK):
    """An AdaptiveK that logs (host syncs since the last round, the last RoundReport) into
    ``seen`` at each round, from the counter count_host_syncs keeps."""

    def __init__(self, count: list[int], seen: list, **kw):
        super().__init__(**kw)
        self.count, self.seen = count, seen

    def __call__(self, last):
        self.seen.append((self.count[0], last))
        self.count[0] = 0
        return super().__call__(last)


def test_host_syncs_per_round(pair, monkeypatch):
    """Instrument every way the host waits for MLX (eval, item, tolist, conversions) and count
    them per round. async_eval only queues work without waiting, so it is not counted."""
    target, draft = pair
    counts = []
    count = [0]

    count_host_syncs(monkeypatch, count)

    def choose(last):
        counts.append((count[0], last is not None and last.draft_seconds is not None))
        count[0] = 0
        return 4

    for temp, verify in ((0.0, "token"), (1.0, "token"), (1.0, "block")):
        counts.clear()
        gen = generate(
            target,
            draft,
            PROMPTS[0],
            k=choose,
            max_tokens=60,
            sampling=SamplingParams(temp),
            seed=0,
            verify=verify,
        )
        list(gen)
        per_round = counts[1:]  # the first window includes prefill
        assert len(per_round) >= 10, per_round
        # one sync a round; a second on the rounds whose drafting was timed apart: the first
        # drafting round and then one in TIME_DRAFT_EVERY
        assert all(n == (2 if timed else 1) for n, timed in per_round), per_round
        timed = [t for _, t in counts]
        assert timed[1] and 1 <= sum(timed) <= 1 + len(timed) // TIME_DRAFT_EVERY


def test_a_probe_after_plain_rounds_is_timed(pair):
    """A drafting round after plain ones (adaptive k probing once it has stopped) times its
    draft: at one in TIME_DRAFT_EVERY, a chooser that drafts rarely would not see the draft's
    time again for a whole generation."""
    target, draft = pair
    script = itertools.cycle([0, 0, 1, 0, 0, 0, 2, 3, 3])
    seen = []

    def choose(last):
        seen.append(last)
        return next(script)

    list(generate(target, draft, PROMPTS[0], k=choose, max_tokens=60))
    pairs = list(itertools.pairwise(r for r in seen if r is not None))
    probes = [r for prev, r in pairs if prev.k == 0 and r.k > 0]
    assert len(probes) >= 4 and all(r.draft_seconds is not None for r in probes)
    after = [r for prev, r in pairs if prev.k > 0 and r.k > 0]
    assert after and all(r.draft_seconds is None for r in after)  # the rest: one in 8


def test_the_draft_clock_times_the_first_drafting_round_and_one_in_eight():
    """DraftClock (the engine's lone row and a batching server's lone row keep one each):
    the first drafting round, the first after a plain one, then one in TIME_DRAFT_EVERY; a
    plain round, or one with a pass already queued, is not timed."""
    clock, drafted, plain = DraftClock(), RoundReport(3, 2, 0.01), RoundReport(0, 0, 0.01)
    got = [clock.timed(3, None if i == 0 else drafted) for i in range(2 * TIME_DRAFT_EVERY + 1)]
    assert got == ([True] + [False] * (TIME_DRAFT_EVERY - 1)) * 2 + [True]
    assert not clock.timed(0, drafted) and not clock.timed(3, plain, queued=True)
    assert clock.timed(3, plain)  # the first drafting round after a plain one
    assert not clock.timed(3, drafted)


def test_a_lone_target_verifies_one_row(pair):
    """A lone generation is a Driver of one row over its Cursor (verifiers.LoneTarget): its
    caches are one sequence's, so a second row is refused by name, not decoded wrongly."""
    target, _ = pair
    kv = KVState()
    prefill(target, None, PROMPTS[0], kv=kv)
    rows = [Row(list(PROMPTS[0]), K(0), Stops((), (), 8), 0, None, None) for _ in range(2)]
    driver = Driver(LoneTarget(Cursor(target, kv.target, len(kv.tokens))), None, rows)
    with pytest.raises(ValueError, match="a lone target verifies one row, not 2"):
        driver.round(0)


class _Slow(nn.Module):
    """A model that takes at least ``pause`` seconds a call (the host waits in it)."""

    def __init__(self, model, pause: float):
        super().__init__()
        self.model, self.pause = model, pause

    @property
    def layers(self):
        return self.model.layers

    def __call__(self, x, cache=None):
        time.sleep(self.pause)
        return self.model(x, cache=cache)


def test_the_time_split_puts_each_models_time_on_its_side(pair):
    """The draft is timed apart on one round in TIME_DRAFT_EVERY: a draft that takes 20 ms a
    step shows as at least 20 ms per drafted token, and a target that takes 150 ms a pass does
    not leak into the draft's share."""
    target, draft = pair
    slow_draft = Stats()
    gen = generate(target, _Slow(draft, 0.02), PROMPTS[0], k=3, max_tokens=40,
                          stats=slow_draft)  # fmt: skip
    list(gen)
    assert 1 <= slow_draft.timed_rounds <= 1 + slow_draft.rounds // TIME_DRAFT_EVERY
    assert slow_draft.draft_s >= 0.02 * slow_draft.drafted
    slow_target = Stats()
    # 150 ms a pass: far above three tiny draft steps (~5 ms each on a quiet 2-core machine,
    # several times that under load: 60 ms was seen to fail there)
    gen = generate(_Slow(target, 0.15), draft, PROMPTS[0], k=3, max_tokens=40,
                          stats=slow_target)  # fmt: skip
    list(gen)
    assert slow_target.target_s >= 0.15 * slow_target.rounds
    assert slow_target.draft_s < slow_target.target_s / 2


@pytest.mark.parametrize(
    "make",
    [
        lambda: Decode(max_tokens=0),
        lambda: Decode(sampling=0.5),
        lambda: Decode(verify="blocks"),
        lambda: K.of(-1),  # (k is parsed at its edge: Decode takes a K)
        lambda: K.of("many"),
    ],
)
def test_bad_settings_are_refused_where_they_are_made(make):
    with pytest.raises(BadInput):
        make()


def test_an_empty_prompt_and_per_token_stopping_without_a_plan_are_refused(pair):
    target, draft = pair
    with pytest.raises(BadInput, match="empty"):
        list(generate_tokens(target, draft, []))
    with pytest.raises(BadInput, match="per-token stopping"):  # a fixed k cannot plan
        list(generate_tokens(target, draft, [1, 2], Decode(k=K(3), draft_stop=True)))
    with pytest.raises(BadInput, match="per-token stopping"):  # nor can no draft model
        list(generate_tokens(target, None, [1, 2], Decode(k=AUTO, draft_stop=True)))


class Spy(nn.Module):
    """A model wrapper that records every id it is fed."""

    def __init__(self, base):
        super().__init__()
        self.base, self.fed = base, []

    @property
    def layers(self):
        return self.base.layers

    @property
    def args(self):
        return self.base.args

    def __call__(self, x, cache=None):
        self.fed.append(np.array(x).max())
        return self.base(x, cache=cache)


def test_a_narrow_draft_is_never_fed_ids_it_cannot_embed(pair):
    """Qwen2.5-Coder 32B has 152064 logit rows, its 0.5B draft 151936: a target that emits a
    padding id must not make MLX read past the draft's embedding table (which returns garbage
    silently). The engine feeds a safe id instead; the output stays the target's."""
    _, _ = pair
    target = make_tiny(5, vocab=64)
    # make ids 56..63 likely: the target emits ids the 56-row draft has no embedding for
    target.lm_head.weight = mx.concatenate(
        [target.lm_head.weight[:56], target.lm_head.weight[56:] * 8 + 1.0]
    )
    draft = Spy(make_tiny(6, vocab=56))
    for temp in (0.0, 1.0):
        kw = dict(max_tokens=30, sampling=SamplingParams(temp), seed=2)
        out = tokens(target, draft, PROMPTS[0], k=3, **kw)
        assert any(t >= 56 for t in out), out  # the case under test happened
        assert max(draft.fed) < 56
        if temp == 0.0:
            assert out == tokens(target, None, PROMPTS[0], **kw)


def test_stop_sequences_span_rounds_with_bounded_memory(pair):
    """Stop checking keeps only the last few tokens (it once rebuilt the whole output per
    token), and still finds a stop sequence that straddles two rounds."""
    stops = Stops([], [[7, 8, 9]], 100_000)
    for i in range(20_000):
        kept, reason = stops.cut([i % 5])
        assert reason is None and len(stops.recent) <= 3
    assert stops.cut([7, 8]) == ([7, 8], None)
    assert stops.cut([9, 1]) == ([9], "stop") and stops.count == 20_003
    # a request that goes on elsewhere (alone, then a row) brings what it made: a stop
    # sequence that began before the move still ends it, and the budget is the whole one
    moved = Stops([], [[7, 8, 9]], 10, made=[1, 7, 8])
    assert moved.count == 3 and moved.room == 6 and moved.cut([9, 2]) == ([9], "stop")
    assert Stops([], [], 5, made=[1, 2, 3, 4]).cut([5, 6]) == ([5], "length")
    target, draft = pair
    base = tokens(target, None, PROMPTS[0], max_tokens=40)
    for k in (1, 3, 6):
        for start in range(3, 30, 4):  # wherever the stop falls relative to the rounds
            stop = base[start : start + 3]
            first = next(i for i in range(len(base)) if base[i : i + 3] == stop)
            out = tokens(target, draft, PROMPTS[0], k=k, max_tokens=40, stop_ids=[stop])
            assert out == base[: first + 3]


@pytest.mark.parametrize("mode", ["plain", "draft", "lookup"])
def test_kv_state_reuses_the_common_prefix_exactly(pair, mode):
    """A KVState carried from one generation to the next (a prompt cache) keeps the longest
    common prefix and prefills only the rest: the same tokens as a cold start, greedy and
    sampled, with the reused tokens reported."""
    target, draft = pair
    use = {"plain": (None, False), "draft": (draft, False), "lookup": (None, True)}[mode]
    k = 0 if mode == "plain" else 3
    first = PROMPTS[2]
    kv = KVState()
    for temp in (0.0, 0.9):
        kw = dict(k=k, lookup=use[1], max_tokens=12, sampling=SamplingParams(temp), seed=4)
        out1 = tokens(target, use[0], first, kv=kv, **kw)
        assert kv.tokens == (first + out1)[:-1]
        # the editor case: the prompt grows by what was generated and a little more
        second = first + out1[:5] + [3, 9]
        stats = Stats()
        out2 = tokens(target, use[0], second, kv=kv, stats=stats, **kw)
        assert out2 == tokens(target, use[0], second, **kw)
        assert stats.cached_tokens == len(first) + 5
        # a prompt that shares less, and one that shares nothing
        for prompt, shared in ((first[:4] + [1, 2], 4), ([33, 34], 0)):
            stats = Stats()
            assert tokens(target, use[0], prompt, kv=kv, stats=stats, **kw) == tokens(
                target, use[0], prompt, **kw
            )
            assert stats.cached_tokens == shared
        _check_prefix(target, kv.target, kv.tokens)
        if use[0] is not None:
            _check_prefix(draft, kv.draft, kv.tokens[: kv.draft_held])


@pytest.mark.parametrize("k", [0, 3])
def test_closing_the_generator_early_leaves_the_kv_state_consistent(pair, k):
    """A caller that stops reading (a client that hangs up, a stop string) closes the
    generator between tokens: the caches then hold exactly what KVState says."""
    target, draft = pair
    base = tokens(target, None, PROMPTS[0], max_tokens=30)
    for stop_after in (1, 4, 9):
        kv = KVState()
        gen = generate(target, draft, PROMPTS[0], k=k, max_tokens=30, kv=kv)
        got = [next(gen).token for _ in range(stop_after)]
        gen.close()
        assert got == base[:stop_after]
        # the round's tokens past the last one read are kept too: they are the target's
        assert kv.tokens == (PROMPTS[0] + base)[: len(kv.tokens)]
        assert len(kv.tokens) >= len(PROMPTS[0]) + stop_after - 1
        _check_prefix(target, kv.target, kv.tokens)
        _check_prefix(draft, kv.draft, kv.tokens[: kv.draft_held])
        # and the next generation from it is right
        out = tokens(target, draft, PROMPTS[0] + base[:3], k=k, max_tokens=10, kv=kv)
        assert out == base[3:13]


def test_hybrid_by_value_is_lossless_and_keeps_one_sync_a_round(pair, monkeypatch):
    """Auto k with lookup and a draft: each round picks lookup or the draft model by value;
    lookup rounds say so (RoundReport.lookup), cost no extra host sync, and the output is
    the target's."""
    target, draft = pair
    base = tokens(target, None, PROMPTS[0], max_tokens=40)
    prompt = PROMPTS[0] + base[:30] + PROMPTS[0]  # lookup can copy the first run's output
    want = tokens(target, None, prompt, max_tokens=40)
    count, seen = [0], []

    count_host_syncs(monkeypatch, count)
    ratio = [1.0] + [1.1 + 0.05 * k for k in range(1, 9)]
    chooser = Watched(count, seen, cost=CostCurve(pass_ratio=ratio))
    for _ in range(3):  # the chooser learns across generations, as a store keeps it
        seen.clear()
        out = tokens(target, draft, prompt, lookup=True, k=chooser, max_tokens=40)
        assert out == want
    rounds = seen[2:]  # after prefill and the first round
    lookups = [n for n, last in rounds if last.lookup]
    assert lookups and all(n == 1 for n in lookups), rounds
    assert all(n <= 2 for n, _ in rounds)  # a second one only on a timed draft-model round


def test_per_token_stopping_is_lossless_and_syncs_per_extension_not_per_token(pair, monkeypatch):
    """draft_stop: the round drafts in chunks of DRAFT_CHUNKS (1, 1, then 2; a sync each)
    while the plan says it pays, and verifies the best prefix. Greedy output is the
    target's; the syncs grow with chunks, fewer than the drafted tokens. The draft is the
    target itself here, so drafting on pays and extensions happen."""

    def chunks(m: int) -> int:  # the chunks that draft m tokens
        n = drafted = 0
        while drafted < m:
            drafted, n = drafted + _chunk(drafted), n + 1
        return n

    target, _ = pair
    draft = make_tiny(0)
    want = tokens(target, None, PROMPTS[1], max_tokens=50)
    count, seen = [0], []

    count_host_syncs(monkeypatch, count)
    ratio = [1.0] + [1.02 + 0.01 * k for k in range(1, 9)]
    chooser = Watched(count, seen, cost=CostCurve(pass_ratio=ratio, t_draft=1e-4))
    for _ in range(3):
        seen.clear()
        out = tokens(target, draft, PROMPTS[1], k=chooser, max_tokens=50, draft_stop=True)
        assert out == want
    rounds = [(n, last) for n, last in seen[2:] if last.k]
    assert rounds and all(len(last.confidences) == last.k for _, last in rounds)
    assert all(0.0 < c <= 1.0 for _, last in rounds for c in last.confidences)
    # a round: its own sync and one per chunk; it may have drafted up to a chunk past k, and
    # says how many it made (their time is drafting, not the target's)
    made = [last.k if last.made is None else last.made for _, last in rounds]
    assert all(r.k <= m < r.k + DRAFT_CHUNKS[-1] for (_, r), m in zip(rounds, made, strict=True))
    assert all(n == 1 + chunks(m) for (n, _), m in zip(rounds, made, strict=True)), rounds
    long = [(n, last) for n, last in rounds if last.k >= 4]
    assert long and all(n < 1 + last.k for n, last in long), long  # not a sync per draft
    assert max(last.k for _, last in rounds) > 4  # it drafted past its first chunk
    assert sum(n for n, _ in rounds) < sum(last.k for _, last in rounds) + len(rounds)
    # a draft that disagrees; sampled too (its distribution: tests/test_distribution.py)
    for temp in (0.0, 1.0):
        kw = dict(k=AdaptiveK(), max_tokens=30, sampling=SamplingParams(temp), seed=3)
        a = tokens(target, pair[1], PROMPTS[0], draft_stop=True, **kw)
        assert len(a) == 30 and all(0 <= t < 64 for t in a)
        if temp == 0:
            assert a == tokens(target, None, PROMPTS[0], max_tokens=30)


@dataclass
class MidChunkStop(AdaptiveK):
    """A plan that drafts 1, 1, 2 and then keeps 3 of the 4: a chunk ends past the stop.
    Logs the reports it is given in ``seen``."""

    seen: list = field(default_factory=list)

    def __call__(self, last):
        self.seen += [last] if last is not None else []
        return super().__call__(last)

    def draft_plan(self, confidences, drafted=0):
        m = len(confidences)
        return (3, 0) if m >= 4 else (m, _chunk(m))


def test_a_round_reports_the_drafts_it_made_but_did_not_verify(pair):
    """Drafts past where the plan stops cost drafting time: the round says how many it made
    (RoundReport.made), and the statistics count them apart from the verified ones."""
    target, _ = pair
    timed = CostCurve(t_draft=1e-4, level=1.0, t_plain=2.0)
    chooser, stats = MidChunkStop(accept=Acceptance(prior=0.9), cost=timed), Stats()
    kw = dict(k=chooser, max_tokens=40, draft_stop=True, stats=stats)
    out = tokens(target, make_tiny(0), PROMPTS[1], **kw)
    assert out == tokens(target, None, PROMPTS[1], max_tokens=40)
    reports = [*chooser.seen, stats.last]  # the last round's report reaches no chooser
    full = [r for r in reports if r.made is not None]
    assert full and all((r.k, r.made, len(r.confidences)) == (3, 4, 3) for r in full)
    assert stats.unverified == len(full) and stats.drafted == sum(r.k for r in reports)


def test_draft_plan_stops_at_doubtful_drafts_and_extends_confident_ones():
    ratio = [1.0] + [1.1 + 0.05 * k for k in range(1, 9)]
    chooser = AdaptiveK(cost=CostCurve(pass_ratio=ratio, t_draft=0.1))
    chooser.update(0, 0, 1.0)
    chooser.update(0, 0, 1.0)
    for _ in range(40):  # confident drafts are accepted, doubtful ones are not
        chooser(RoundReport(4, 2, 1.6, 0.4, confidences=(0.95, 0.9, 0.2, 0.1)))
    assert chooser.accept.confident(0.95) > 0.8 and chooser.accept.confident(0.25) < 0.2
    # stop after the doubtful one: it was drafted on the strength of those before it, so it
    # is verified; what comes after it is not (its own confidence never decides its fate)
    assert chooser.draft_plan([0.95, 0.9, 0.2, 0.1]) == (3, 0)
    assert chooser.draft_plan([0.95, 0.2, 0.9, 0.9]) == (2, 0)
    keep, more = chooser.draft_plan([0.95, 0.92])
    assert (keep, more) == (2, DRAFT_CHUNKS[-1])  # all confident: draft on
    assert chooser.draft_plan([0.1])[0] == 1  # a round verifies at least one draft
    # a round starts with one draft, then one more, then pairs
    assert [chooser.draft_plan([0.95] * m)[1] for m in range(4)] == [1, 1, 2, 2]
    # what was learned per confidence survives a save, and bins saved in another shape reset
    resumed = AdaptiveK.resume(json.loads(json.dumps(chooser.state())))
    assert resumed.draft_plan([0.95, 0.9, 0.2, 0.1]) == (3, 0)
    odd = AdaptiveK.resume({**chooser.state(), "_conf": [[1.0, 2.0]]})
    assert odd.accept.confident(0.95) == pytest.approx(odd.accept.later_rate)


def test_the_plan_counts_the_rounds_first_drafts_as_sunk():
    """The chooser's k drafts were made before any confidence was read: verifying one costs
    only its share of the target pass. The plan once charged each as if still to draft and,
    with a dear draft, verified half of what it had drafted."""
    ratio = [1.0] + [1.1 + 0.05 * k for k in range(1, 16)]
    chooser = AdaptiveK(cost=CostCurve(pass_ratio=ratio, t_draft=0.1))
    chooser.update(0, 0, 1.0)
    chooser.update(0, 0, 1.0)
    for _ in range(40):
        # confident drafts pass, doubtful ones fail
        chooser.accept.observe((0.95, 0.9, 0.2, 0.1), 2)
    assert chooser.draft_plan([0.95, 0.92], drafted=2) == (2, DRAFT_CHUNKS[-1])
    # a dear draft: drafting on rarely pays, verifying what is drafted does
    chooser.cost.t_draft = 0.4
    assert chooser.draft_plan([0.95] * 4) == (2, 0)  # as if none were drafted yet
    assert chooser.draft_plan([0.95] * 4, drafted=4) == (4, 0)
    assert chooser.draft_plan([0.95, 0.92], drafted=2) == (2, 0)
    # a doubtful draft is still verified once drafted; what comes after it is not
    assert chooser.draft_plan([0.95, 0.2, 0.95, 0.95], drafted=4) == (2, 0)


def test_the_plan_looks_past_the_next_draft():
    """A pass-cost curve steep at first and flat later: one more draft does not pay for itself,
    four more do. Stopping by the next draft's worth alone quit at one draft."""
    steep_then_flat = [1.0, 1.1] + [1.8] * 15
    chooser = AdaptiveK(
        accept=Acceptance(later=[36.0, 40.0]),
        cost=CostCurve(pass_ratio=steep_then_flat, t_draft=0.05),
    )
    chooser.update(0, 0, 1.0)
    chooser.update(0, 0, 1.0)
    for _ in range(40):
        chooser.accept.observe((0.95, 0.95, 0.95, 0.95), 4)  # confident drafts pass
    assert chooser.draft_plan([0.95], drafted=1) == (1, 1)  # on: j = 5 beats j = 1
    steep = [1.0, 1.1] + [1.1 + 0.7 * k for k in range(1, 16)]  # every draft dear to verify
    chooser.cost.pass_ratio = steep
    assert chooser.draft_plan([0.95], drafted=1) == (1, 0)


def test_sampled_plan_is_a_stopping_rule():
    """Whether draft j is verified may depend on the drafts before it, never on draft j or
    later ones (that would bias sampling): changing confidences from position j on leaves
    the decision about draft j as it was, for any number committed up front. (A rule that
    weighed each draft's own confidence broke this 113 times in these 300 cases.)"""
    ratio = [1.0] + [1.1 + 0.05 * k for k in range(1, 16)]
    chooser = AdaptiveK(cost=CostCurve(pass_ratio=ratio, t_draft=0.2))
    chooser.update(0, 0, 1.0)
    chooser.update(0, 0, 1.0)
    for _ in range(40):
        chooser.accept.observe((0.95, 0.9, 0.2, 0.1), 2)
    rng = random.Random(0)
    for _ in range(300):
        m, drafted = rng.randint(1, 8), rng.randint(0, 8)
        c = [rng.random() for _ in range(m)]
        keep = chooser.draft_plan(c, drafted=min(drafted, m))[0]
        for j in range(1, m):  # the decision about draft j + 1 sees drafts 1..j only
            other = c[:j] + [rng.random() for _ in range(m - j)]
            again = chooser.draft_plan(other, drafted=min(drafted, m))[0]
            assert (keep > j) == (again > j), (c, other, drafted, j)


def test_prefill_alone_leaves_the_caches_a_generation_would_reuse(pair):
    """engine.prefill (an editor's warm-up): the next generation over the same prompt finds
    all of it but the last token cached, and emits what a fresh one does."""
    target, draft = pair
    prompt = PROMPTS[2] * 3
    kv, warm = KVState(), Stats()
    prefill(target, draft, prompt, kv=kv, stats=warm)
    assert kv.tokens == prompt[:-1] and kv.draft_held == len(prompt) - 1
    assert warm.prompt_tokens == len(prompt) and warm.generated == 0
    stats = Stats()
    out = tokens(target, draft, prompt, k=3, max_tokens=20, kv=kv, stats=stats)
    assert stats.cached_tokens == len(prompt) - 1
    assert out == tokens(target, draft, prompt, k=3, max_tokens=20)
    with pytest.raises(BadInput, match="empty"):
        prefill(target, None, [], kv=KVState())
