"""Prompt lookup with memory: the n-gram index against a brute-force search, the on-disk
store (bounded, per tokenizer, safe with concurrent writers, harmless when damaged), and
that no memory can change what the engine outputs."""

from __future__ import annotations

import multiprocessing
import random
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from helpers import TableLM, generate, make_tiny

from specmlx.core.stats import Stats
from specmlx.drafting.choosing.adaptive import AdaptiveK
from specmlx.drafting.choosing.cost_curve import CostCurve
from specmlx.drafting.lookup.memory import (
    Lookup,
    LookupMemory,
    SuffixIndex,
    lookup_propose,
    tokenizer_fingerprint,
)


def brute_force(history: list[int], k: int, max_ngram: int = 4) -> list[int]:
    """The continuation of the most recent earlier occurrence of the longest suffix, by a
    plain scan (the search the index replaces)."""
    h = np.asarray(history)
    for n in range(min(max_ngram, len(h) - 1), 0, -1):
        tail = h[-n:]
        for i in range(len(h) - n - 1, -1, -1):  # starts whose match has a token after it
            if np.array_equal(h[i : i + n], tail):
                return h[i + n : i + n + k].tolist()
    return []


def test_index_finds_what_a_plain_scan_finds():
    rng = random.Random(0)
    for trial in range(300):
        vocab = rng.choice([2, 3, 5, 20])
        history = [rng.randrange(vocab) for _ in range(rng.randrange(0, 60))]
        k = rng.randrange(0, 9)
        assert lookup_propose(history, k) == (brute_force(history, k) if k else []), trial


def test_index_grows_incrementally_like_a_fresh_one():
    rng = random.Random(1)
    history = [rng.randrange(4) for _ in range(200)]
    grown, look = SuffixIndex(), Lookup(history[:10])
    grown.extend(history[:10])
    for i in range(10, 200, 7):
        grown.extend(history[i : i + 7])
        look.extend(history[i : i + 7])
        fresh = SuffixIndex()
        fresh.extend(history[: i + 7])
        tail = history[: i + 7][-4:]
        assert grown.match(tail) == fresh.match(tail)
        assert look.propose(5) == brute_force(history[: i + 7], 5)


def test_memory_proposes_a_remembered_continuation_the_context_lacks():
    memory = LookupMemory()
    memory.add([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    look = Lookup([20, 21, 2, 3, 4], memory)  # the tail 2 3 4 is only in memory
    assert look.propose(3) == [5, 6, 7]
    assert look.propose(20) == [5, 6, 7, 8, 9, 10]  # stops at the end of the remembered output
    # the context's own match wins a tie: it is this very text
    look = Lookup([2, 3, 4, 30, 31, 2, 3, 4], memory)
    assert look.propose(2) == [30, 31]
    # the longer match wins: "3 4" (n = 2) in the context, "2 3 4" (n = 3) in memory
    assert Lookup([7, 3, 4, 40, 2, 3, 4], memory).propose(1) == [5]
    assert Lookup([7, 2, 3, 4, 40, 2, 3, 4], memory).propose(1) == [40]
    assert Lookup([50, 51], memory).propose(4) == []


def test_memory_is_bounded_and_keeps_the_newest(tmp_path):
    memory = LookupMemory(tmp_path, max_tokens=30)
    for i in range(10):
        memory.add([100 + i] * 10)
    assert memory.size <= 30 and memory.docs[-1] == [109] * 10
    again = LookupMemory(tmp_path, max_tokens=30)
    assert again.docs == memory.docs
    assert len(list(tmp_path.glob("*.tok"))) == 3  # the reader deleted what no longer fits


def test_damaged_or_foreign_files_are_skipped(tmp_path):
    good = LookupMemory(tmp_path, vocab_size=64)
    good.add(list(range(20)))
    (tmp_path / "00000000000000000001-1-x.tok").write_bytes(b"not ours at all")
    (tmp_path / "00000000000000000002-1-y.tok").write_bytes(b"specmlx-lookup-1\n\x01\x02")
    foreign = LookupMemory(tmp_path / "other", vocab_size=1000)
    foreign.add([900] * 12)
    for f in (tmp_path / "other").glob("*.tok"):
        f.rename(tmp_path / ("00000000000000000003-1-z.tok"))
    warnings = []
    loaded = LookupMemory(tmp_path, vocab_size=64, warn=warnings.append)
    assert loaded.docs == [list(range(20))]
    assert warnings == [f"skipped 3 damaged or foreign file(s) in the lookup memory {tmp_path}"]
    assert Lookup([3, 4], loaded).speculate(2, 2).tokens == [5, 6]  # the good file still serves


def test_a_read_only_store_warns_once_and_still_remembers(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    store = blocker / "lookup"  # nothing can be created under a file, even by root
    warnings = []
    memory = LookupMemory(store, warn=warnings.append)
    memory.add(list(range(10)))
    memory.add(list(range(10, 20)))
    assert len(warnings) == 1 and "lookup memory" in warnings[0]
    assert Lookup([5, 6, 7], memory).propose(2) == [8, 9]


def _writer(directory: str, base: int) -> None:
    memory = LookupMemory(Path(directory))
    for i in range(40):
        memory.add([base + i] * 9)


def test_concurrent_writers_lose_nothing(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), b)) for b in (1000, 2000)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    docs = LookupMemory(tmp_path).docs
    assert sorted(d[0] for d in docs) == [*range(1000, 1040), *range(2000, 2040)]
    assert all(len(set(d)) == 1 and len(d) == 9 for d in docs)
    assert not list(tmp_path.glob(".*.tmp"))


def test_fingerprint_follows_the_vocabulary():
    class Tok:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return dict(self.vocab)

    a = Tok({"a": 0, "b": 1})
    assert tokenizer_fingerprint(a) == tokenizer_fingerprint(Tok({"b": 1, "a": 0}))
    assert tokenizer_fingerprint(a) != tokenizer_fingerprint(Tok({"a": 1, "b": 0}))


@pytest.fixture(scope="module")
def pair():
    return make_tiny(0), make_tiny(1)


def _run(target, draft, prompt, **kw) -> list[int]:
    return [e.token for e in generate(target, draft, prompt, **kw)]


@pytest.mark.parametrize("with_draft", [False, True])
def test_no_memory_changes_the_output(pair, with_draft):
    """Junk, stale and helpful memories alike: greedy output is the target's, token for
    token; a memory holding the exact continuation makes it faster (fewer target passes)."""
    target, draft = pair
    draft = draft if with_draft else None
    prompt = [3, 9, 27, 17, 51, 25, 11]
    base = _run(target, None, prompt, max_tokens=40)
    rng = random.Random(2)
    junk = LookupMemory()
    for _ in range(20):
        junk.add([rng.randrange(64) for _ in range(30)])
    stale = LookupMemory()
    stale.add(prompt + [(t + 1) % 64 for t in base])  # the right context, wrong continuation
    helpful = LookupMemory()
    helpful.add(prompt[-3:] + base)
    passes = {}
    for name, memory in (("junk", junk), ("stale", stale), ("helpful", helpful), ("none", None)):
        stats = Stats()
        kw = dict(lookup=True, lookup_memory=memory, k=6, max_tokens=40, stats=stats)
        assert _run(target, draft, prompt, **kw) == base, name
        passes[name] = stats.rounds
    if not with_draft:
        assert passes["helpful"] < passes["none"] / 2


def test_the_engine_remembers_each_output(pair):
    target, _ = pair
    memory = LookupMemory()
    out = _run(target, None, [1, 2, 3], lookup=True, lookup_memory=memory, max_tokens=20)
    assert memory.docs == [out]
    # stopped early by the caller: what was emitted is remembered all the same
    gen = generate(target, None, [4, 5, 6], lookup=True, lookup_memory=memory, max_tokens=20)
    first = [next(gen).token for _ in range(10)]
    gen.close()
    assert memory.docs[-1][:10] == first and len(memory.docs) == 2


# the pass-cost curve the probe measured for the real Gemma 3 270M on a CPU without OpenBLAS
NEAR_LINEAR = [
    1.0, 2.026, 2.802, 3.556, 4.119, 4.758, 5.867, 6.248, 7.292, 7.991, 8.69, 9.389, 10.219,
    11.049, 11.88, 12.71,
]  # fmt: skip


class _Successor(TableLM):
    """A table model that always says the next id is this one plus 1 (mod V): a prompt
    holding a run of consecutive ids is one its greedy output copies verbatim."""

    def __init__(self, vocab: int = 64):
        super().__init__(vocab, seed=0)
        table = np.zeros((vocab, vocab, vocab), dtype=np.float32)
        table[:, np.arange(vocab), (np.arange(vocab) + 1) % vocab] = 10.0
        self.table = mx.array(table)


def test_a_first_run_on_a_verbatim_repeat_pays_under_auto():
    """Issue 36 end to end: a fresh adaptive chooser with a near-linear pass-cost curve (the
    one probed for the real Gemma 3 270M on a CPU without OpenBLAS), on a prompt whose
    continuation repeats a passage of it. Its first lookup offer is a 1-gram match that
    misses (9 was followed by 3), so nothing about lookup is known when the copy starts.
    Before the fix auto declined every later offer on priors alone (1.00 tokens per pass);
    now it verifies them, and makes at least what a fixed k = 4 makes."""
    target = _Successor()
    prompt = [9, 3, *range(10, 62), 5, 9]  # the output is 10, 11, ...: the passage again
    base = _run(target, None, prompt, max_tokens=48)
    assert base == list(range(10, 58))
    per_pass = {}
    for name, k in (("auto", AdaptiveK(cost=CostCurve(pass_ratio=NEAR_LINEAR))), ("k4", 4)):
        stats = Stats()
        assert _run(target, None, prompt, lookup=True, k=k, max_tokens=48, stats=stats) == base
        per_pass[name] = stats.tokens_per_pass
    assert per_pass["auto"] >= per_pass["k4"] and per_pass["auto"] > 3, per_pass
