"""Suffix lookup (drafting/lookup/suffix.py): the proposal tree from hand-built sequences (frequency
against recency, the longest matches, the bounds), its shape against a brute-force reading of
the occurrences, the choice between context and memory, and that trees of it are exact."""

from __future__ import annotations

import random

import pytest
from helpers import generate, make_tiny

from specmlx.core.stats import Stats
from specmlx.drafting.lookup.memory import Lookup, LookupMemory
from specmlx.drafting.lookup.suffix import DECAY, MIN_PROB, SEP, SuffixIndex


def paths(spec) -> list[list[int]]:
    """Each node's tokens from the root's child down to it."""
    out: list[list[int]] = []
    for i, parent in enumerate(spec.parents):
        out.append((out[parent - 1] if parent else []) + [spec.tokens[i]])
    return out


def test_two_older_occurrences_that_agree_outweigh_the_latest():
    index = SuffixIndex(tokens=[1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 4, 9])
    spec = index.speculate([5, 1, 2], depth=2, budget=8)
    assert spec.match == 2
    first = [spec.tokens[j - 1] for j in spec.chain()]
    assert first == [3, 9]  # twice (weights 0.9 + 0.81) against once (1.0)
    w3, w4 = DECAY + DECAY**2, 1.0
    assert spec.probs[0] == pytest.approx(w3 / (w3 + w4))
    assert [4] in paths(spec) and [4, 9] in paths(spec)  # the other continuation, a branch
    assert spec.parents == [0, 1, 0, 3]  # best first: 3, 9 | 4, 9 (9 after 3 is as likely as 3)


def test_on_a_tie_the_latest_occurrence_leads():
    index = SuffixIndex(tokens=[1, 2, 3, 1, 2, 4])
    spec = index.speculate([1, 2], depth=1, budget=8)
    # [1, 2] is followed by 3 (older) and by 4 (latest): 4 weighs 1, 3 weighs DECAY
    assert spec.tokens == [4, 3]


def test_the_longest_matches_alone_win_when_they_agree_and_the_rest_do_not():
    # [7, 1, 2] was followed by 5 twice; [1, 2] by many other things
    seq = [7, 1, 2, 5, 0, 7, 1, 2, 5, 0]
    for t in (10, 11, 12, 13, 14, 15):
        seq += [1, 2, t, 0]
    spec = SuffixIndex(tokens=seq).speculate([7, 1, 2], depth=1, budget=4)
    assert spec.match == 3 and spec.tokens == [5] and spec.probs == [1.0]


def test_bounds_separators_and_the_least_probability():
    seq = [1, 2, 3, 4, 5, SEP, 1, 2, 3, SEP]
    index = SuffixIndex(tokens=seq)
    spec = index.speculate([1, 2], depth=10, budget=10)
    assert spec.tokens == [3, 4, 5]  # stops at each document's end
    assert spec.probs[0] == 1.0 and spec.probs[1] == pytest.approx(DECAY / (1 + DECAY))
    assert len(index.speculate([1, 2], depth=2, budget=10).tokens) == 2
    assert len(index.speculate([1, 2], depth=10, budget=1).tokens) == 1
    assert index.speculate([8], depth=4, budget=4).tokens == []  # no match
    # ten continuations, each once: every one under MIN_PROB but the latest few
    many = SuffixIndex(tokens=[x for t in range(10) for x in (1, t + 20)])
    spec = many.speculate([1], depth=1, budget=20)
    assert all(p >= MIN_PROB for p in spec.probs) and len(spec.tokens) < 10


def test_a_tree_is_the_occurrences_continuations_by_brute_force():
    rng = random.Random(0)
    for trial in range(200):
        vocab = rng.choice([2, 3, 5])
        seq = [rng.randrange(vocab) for _ in range(rng.randrange(2, 80))]
        index, tail = SuffixIndex(tokens=list(seq)), seq[-rng.randrange(1, 6) :]
        spec = index.speculate(tail, depth=5, budget=12)
        if not spec.tokens:
            continue
        assert all(0 <= p < i + 1 for i, p in enumerate(spec.parents)), trial
        found = {tuple(seq[e : e + d]) for e in range(len(seq)) for d in range(1, 6)
                 if e >= spec.match and seq[e - spec.match : e] == tail[-spec.match :]}  # fmt: skip
        for path, p, parent in zip(paths(spec), spec.probs, spec.parents, strict=True):
            assert tuple(path) in found, (trial, path)
            assert p <= (spec.probs[parent - 1] if parent else 1.0) + 1e-12
        # each node's children are distinct tokens
        kids = {(parent, t) for parent, t in zip(spec.parents, spec.tokens, strict=True)}
        assert len(kids) == len(spec.tokens)


def test_lookup_takes_the_better_of_context_and_memory():
    memory = LookupMemory()
    memory.add([9, 1, 2, 3, 4, 5, 6, 7, 8])
    look = Lookup([1, 2, 0, 1, 2], memory)  # the context saw [1, 2] followed by 0, once
    spec = look.speculate(depth=4, budget=4)
    assert spec.tokens[:1] in ([0], [3])
    memory.add([0, 1, 2, 3, 4, 5, 6, 7, 8])  # now twice in memory: memory scores more
    spec = Lookup([1, 2, 0, 1, 2], memory).speculate(depth=4, budget=4)
    assert spec.tokens == [3, 4, 5, 6]


@pytest.mark.parametrize("tree", ["off", "auto", 5])
def test_suffix_lookup_with_a_memory_is_exact(tree):
    """Greedy: lookup with its trees (and a memory of an earlier output) is the target's own
    output; with trees on, trees were verified and kept drafts."""
    target = make_tiny(5, vocab=48, layers=2, hidden=32)
    prompt = [3, 9, 4, 7, 3, 9, 4, 7, 3, 9]
    plain = [e.token for e in generate(target, None, prompt, k=0, max_tokens=40)]
    memory = LookupMemory()
    memory.add(prompt[2:] + plain[:20])
    memory.add([3, 9, 5, 5, 5, 5, 5, 5, 5])
    stats = Stats()
    spec = generate(target, None, prompt, k=4, max_tokens=40, lookup=True, tree=tree,
                    stats=stats, lookup_memory=memory)  # fmt: skip
    assert [e.token for e in spec] == plain
    assert stats.accepted > 0
    if tree == 5:
        assert stats.tree_rounds > 0
