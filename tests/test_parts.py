"""Parts the bigger tests go through without pinning down: the prompt cache's choice and
eviction, the FIM layout of each family, the worker's stop, and the lockstep check's verdicts."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import pytest
from helpers import tiny_tokenizer

from specmlx.decoding.engine import KVState
from specmlx.decoding.fim import FAMILIES, encode_infill, fim_template
from specmlx.decoding.session import Request
from specmlx.distributed import ranks as distributed
from specmlx.distributed.ranks import Cancelled, Lockstep, LockstepError, World
from specmlx.serving.prompt_cache import PromptCache
from specmlx.serving.worker import ShuttingDown, Worker

# ------------------------------------------------------------------ the prompt cache


def _kv(tokens: list[int], nbytes: int = 100, trims: bool = True) -> KVState:
    """A KVState holding ``tokens`` whose caches weigh ``nbytes`` and can give tokens back
    (trims=False: like a window or recurrent state, they cannot)."""
    cache = SimpleNamespace(nbytes=nbytes, can_trim=lambda n: trims)
    return KVState(target=[cache], tokens=list(tokens))


def test_the_longest_common_prefix_is_copied_and_its_entry_stays_most_recent():
    cache = PromptCache(10_000)
    a, b = _kv([1, 2, 3, 4, 5]), _kv([1, 2, 9, 9, 9])
    cache.put(a)
    cache.put(b)
    got = cache.take([1, 2, 3, 4, 7, 8])  # shares 4 with a, 2 with b
    assert got.tokens == a.tokens and got is not a and got.target[0] is not a.target[0]
    assert [e.tokens for e in cache.entries] == [
        b.tokens,
        a.tokens,
    ]  # a stays, the most recently used now
    again = cache.take([1, 2, 3, 4, 6, 6])  # a request beside the first shares it too
    assert again.tokens == a.tokens and again is not got


def test_the_prompts_last_token_never_counts():
    cache = PromptCache(10_000)
    entry = _kv([1, 2, 3])
    cache.put(entry)
    # the last token is fed anew by the engine: [1, 2, 3] shares only [1, 2] of its context
    assert cache.take([1, 2, 3]).tokens == [1, 2, 3]
    assert cache.take([5, 1, 2, 3]).target is None  # no common prefix: fresh caches


def test_a_shared_header_is_served_and_its_entry_kept_for_its_own_sequence():
    cache = PromptCache(10_000)
    other_file = _kv([7, 7, 1, 2, 3, 4, 5, 6, 7, 8], 100)  # a shared header, then its own text
    cache.put(other_file)
    got = cache.take([7, 7, 9, 9, 9, 9])  # shares 2 of 10: a copy (trimmed by the engine)
    assert got.tokens == other_file.tokens and cache.entries[0] is other_file


def test_an_entry_that_comes_back_longer_replaces_the_one_it_extends():
    cache = PromptCache(10_000)
    turn1, elsewhere = _kv([1, 2, 3]), _kv([1, 2, 8])
    cache.put(turn1)
    cache.put(elsewhere)
    cache.put(_kv([1, 2, 3, 4, 5]))  # turn 2 holds all of turn 1: turn 1 goes
    assert [e.tokens for e in cache.entries] == [[1, 2, 8], [1, 2, 3, 4, 5]]
    cache.put(_kv([1, 2, 3, 4, 5]))  # the same tokens again: the newer stays
    assert [e.tokens for e in cache.entries] == [[1, 2, 8], [1, 2, 3, 4, 5]]


def test_where_caches_cannot_give_back_the_prefill_leaves_a_branch_to_keep():
    """Recurrent or window caches: an entry the prompt parts from inside is not taken (its
    caches cannot be cut back); the prefill is asked to leave a copy where they part, and
    that copy is kept beside the request's own entry, which does not replace it."""
    cache = PromptCache(10_000)
    first = _kv([1, 2, 3, 4, 5, 6], trims=False)  # a system prompt [1, 2, 3], then a chat
    cache.put(first)
    got = cache.take([1, 2, 3, 9, 9])
    assert got.target is None and got.branch_at == 3  # fresh caches; a copy wanted at 3
    got.target, got.tokens = [SimpleNamespace(nbytes=100, can_trim=lambda n: False)], [1, 2, 3, 9]
    got.branch = _kv([1, 2, 3], trims=False)  # (what engine._fill leaves)
    cache.put(got)
    assert [e.tokens for e in cache.entries] == [[1, 2, 3, 4, 5, 6], [1, 2, 3], [1, 2, 3, 9]]
    assert got.branch is None
    again = cache.take([1, 2, 3, 7, 7])  # the next chat with that system prompt
    assert again.tokens == [1, 2, 3] and again.branch_at == 0
    exact = cache.take([1, 2, 3, 4, 5, 6, 7, 8])  # an entry the prompt extends is taken
    assert exact.tokens == [1, 2, 3, 4, 5, 6] and exact.branch_at == 0


def test_the_least_recently_used_go_past_the_budget():
    cache = PromptCache(250)
    first, second, third = _kv([1, 1]), _kv([2, 2]), _kv([3, 3])
    for kv in (first, second, third):
        cache.put(kv)
    assert [e.tokens for e in cache.entries] == [[2, 2], [3, 3]] and cache.nbytes == 200
    cache.put(_kv([4, 4], 300))  # bigger than the whole budget: nothing stays
    assert cache.entries == []
    none = PromptCache(0)
    none.put(_kv([1, 2]))
    assert none.entries == []


# ------------------------------------------------------------------ FIM layouts


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_each_familys_infill_layout(family):
    """Each family's markers found from its tokenizer's tokens, in the order it was trained
    on: [extra records] PRE prefix SUF suffix MID, with its end-of-infill ids as stops."""
    specials = [family.prefix, family.suffix, family.middle, *family.stops]
    specials += [t for t in (family.repo, family.file_sep) if t]
    base = tiny_tokenizer()
    base.add_special_tokens({"additional_special_tokens": list(dict.fromkeys(specials))})
    vocab = base.get_vocab()
    t = fim_template(base)
    assert t is not None and t.family == family.name
    assert (t.prefix, t.suffix, t.middle) == tuple(vocab[x] for x in specials[:3])
    assert t.stops == tuple(vocab[s] for s in family.stops)
    ids = encode_infill(base, t, "def f(x):\n    ", "\n    return y\n")
    pre, suf, mid = ids.index(t.prefix), ids.index(t.suffix), ids.index(t.middle)
    assert pre < suf < mid == len(ids) - 1  # the model writes the middle next
    assert base.decode(ids[pre + 1 : suf]) == "def f(x):\n    "
    assert base.decode(ids[suf + 1 : mid]) == "\n    return y\n"
    extra = encode_infill(base, t, "a", "b", extra=[("util.py", "X = 1\n")])
    assert extra.index(t.prefix) > 0 and "X = 1" in base.decode(extra[: extra.index(t.prefix)])
    if t.repo is not None:  # repo-level records where the family has the tokens
        assert t.file_sep in extra[: extra.index(t.prefix)]


# ------------------------------------------------------------------ the worker's stop


def test_stop_answers_the_queued_and_refuses_new_requests():
    target = SimpleNamespace(model=None, tokenizer=None, vocab_size=0, identity="t")
    worker = Worker(target, None, 0, max_queue=4, persist=False, lookup_memory=False)
    said = []
    for _ in range(2):
        worker.submit(Request(prompt_ids=[1], max_tokens=1), lambda k, v: said.append((k, v)))
    worker.stop(timeout=1)  # (the thread never started: nothing runs)
    assert [k for k, _ in said] == ["error", "error"]
    assert all(isinstance(v, ShuttingDown) for _, v in said)
    with pytest.raises(ShuttingDown):
        worker.submit(Request(prompt_ids=[1], max_tokens=1), lambda *_: None)


# ------------------------------------------------------------------ lockstep verdicts


def _gathered(rows):
    """An all_gather whose ranks contributed ``rows`` ([hash, tokens, stop] each)."""
    return lambda mine, group=None: mx.array(rows, dtype=mx.int64)


def test_lockstep_raises_when_the_ranks_tokens_differ(monkeypatch):
    world = World(None, 0, 2, "ring")
    step = Lockstep(world, every=1)
    monkeypatch.setattr(distributed.mx.distributed, "all_gather", _gathered([[5, 3, 0], [5, 3, 0]]))
    step([1, 2, 3])  # the same hash and count on both: nothing happens
    monkeypatch.setattr(distributed.mx.distributed, "all_gather", _gathered([[5, 3, 0], [6, 3, 0]]))
    with pytest.raises(LockstepError, match="different tokens"):
        step([4])
    stop = Lockstep(world, stoppable=True)
    monkeypatch.setattr(distributed.mx.distributed, "all_gather", _gathered([[0, 0, 1], [0, 0, 0]]))
    with pytest.raises(Cancelled):
        stop([])  # rank 0 said stop: every rank stops at this round
