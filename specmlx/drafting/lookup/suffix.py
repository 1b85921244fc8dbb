"""Suffix lookup (SuffixDecoding, arXiv 2411.04975; Arctic Inference's suffix trees): every
occurrence of the context's tail in a token sequence, and a tree of what followed them,
weighed by how often (and how lately) each continuation followed.

A suffix tree answers "what followed this pattern, and how often" from the node the pattern
reaches. Here the same answer comes from an index of every n-gram's occurrences (n up to
``max_n``): the occurrences of the tail's longest indexed suffix, each match then measured
backwards (up to MAX_MATCH tokens), and the continuations of the most recent OCCURRENCES of
them put in a small trie. Indexing costs max_n list appends a token; a round reads at most
OCCURRENCES continuations. Each trie node's chance to be right is estimated as

    p(node) = p(parent) * W(node) / W(parent),  p(root) = 1,

W the summed weight of the occurrences whose continuation passes through it, an occurrence
weighing DECAY ** (its recency rank): two older ones that agree outweigh the latest. Nodes
are taken best-first (a parent before its children) while p >= MIN_PROB, as SuffixDecoding
grows its speculation tree. Two candidate trees, from every occurrence and from the longest
matches alone, are grown, and the one with more expected tokens (the sum of p) is kept.

Whatever the index proposes, the target's pass decides what is kept: a stale, foreign or
damaged sequence costs speed, never output.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

MAX_NGRAM = 4  # the longest context tail indexed
MAX_MATCH = 32  # the longest match measured (a longer one says no more)
OCCURRENCES = 16  # the most recent occurrences of a match a round reads
DECAY = 0.9  # an occurrence's weight per step of recency rank
MIN_PROB = 0.1  # a node less likely than this is not proposed (SuffixDecoding's default)
SEP = -1  # between documents: never matches, ends a continuation


@dataclass
class Speculation:
    """A proposal tree from suffix lookup: ``tokens[i]`` is node i + 1, ``parents[i]`` its
    parent (0 the root, a parent before its children), ``probs[i]`` its estimated chance to
    be reached and accepted (best first); ``match``: the length of the match every
    continuation in it follows (0: nothing matched)."""

    match: int = 0
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)

    @property
    def score(self) -> float:
        """Expected accepted tokens, if the estimates hold."""
        return sum(self.probs)

    def chain(self) -> list[int]:
        """The nodes (1-based) of the most likely path: from the root, each node's first child
        (best first order makes it the likeliest)."""
        out, at = [], 0
        for i, parent in enumerate(self.parents):
            if parent == at:
                out.append(i + 1)
                at = i + 1
        return out


class SuffixIndex:
    """Where every n-gram (n = 1..max_n) of a growing token sequence occurred with a token
    after it. Only n-grams followed by at least one token are indexed, so a sequence's own
    tail never matches itself: a match always has a continuation. A list ``tokens`` is kept
    by reference (the engine's own context: it appends, then calls ``sync``).

    max_n: the longest n-gram indexed; tokens: the sequence (SEP between documents)."""

    def __init__(self, max_n: int = MAX_NGRAM, tokens: list[int] | None = None):
        self.max_n = max_n
        self.tokens: list[int] = tokens if tokens is not None else []
        self._ends: list[dict[tuple[int, ...], list[int]]] = [{} for _ in range(max_n + 1)]
        self._indexed = 0  # tokens[:_indexed] are indexed
        self.sync()

    def extend(self, new: Sequence[int]) -> None:
        """Append ``new`` and index the n-grams that now have a token after them."""
        self.tokens.extend(int(x) for x in new)
        self.sync()

    def sync(self) -> None:
        """Index what was appended to ``tokens`` since the last call."""
        t, start = self.tokens, self._indexed
        for end in range(max(start, 1), len(t)):  # n-grams t[end-n:end], followed by t[end]
            for n in range(1, min(self.max_n, end) + 1):
                gram = tuple(t[end - n : end])
                if SEP in gram:
                    break  # longer ones contain it too
                self._ends[n].setdefault(gram, []).append(end)
        self._indexed = len(t)

    def match(self, tail: Sequence[int]) -> tuple[int, int]:
        """(n, end): the longest suffix of ``tail`` (n <= max_n) that occurred here with a
        token after it, and where its most recent occurrence ends; (0, -1) for none."""
        n, ends = self._longest(tail)
        return (n, ends[-1]) if n else (0, -1)

    def after(self, end: int, k: int) -> list[int]:
        """Up to k tokens from position ``end``, stopping at the end of a document."""
        out = self.tokens[end : end + k]
        return out[: out.index(SEP)] if SEP in out else out

    def occurrences(self, tail: Sequence[int]) -> list[tuple[int, int]]:
        """(end, match) for the most recent OCCURRENCES occurrences of ``tail``'s longest
        indexed suffix, latest first: where each ends, and how many of tail's last tokens
        (up to MAX_MATCH) precede it there."""
        n, ends = self._longest(tail)
        t, out = self.tokens, []
        for end in reversed(ends[-OCCURRENCES:]):
            m = n
            top = min(MAX_MATCH, len(tail), end)
            while m < top and t[end - m - 1] == tail[-m - 1]:
                m += 1
            out.append((end, m))
        return out

    def speculate(self, tail: Sequence[int], depth: int, budget: int) -> Speculation:
        """The best proposal tree (see the module) after ``tail``: at most ``budget`` nodes,
        none deeper than ``depth``."""
        occ = self.occurrences(tail)
        if not occ or depth <= 0 or budget <= 0:
            return Speculation()
        best = _grow(self.tokens, occ, depth, budget)
        longest = max(m for _, m in occ)
        if any(m < longest for _, m in occ):
            deep = _grow(self.tokens, [o for o in occ if o[1] == longest], depth, budget)
            best = deep if deep.score > best.score else best
        return best

    def _longest(self, tail: Sequence[int]) -> tuple[int, list[int]]:
        for n in range(min(self.max_n, len(tail)), 0, -1):
            ends = self._ends[n].get(tuple(tail[-n:]))
            if ends:
                return n, ends
        return 0, []


def _grow(tokens: list[int], occ: list[tuple[int, int]], depth: int, budget: int) -> Speculation:
    """The speculation tree from the continuations of ``occ`` (latest first)."""
    children: list[dict[int, int]] = [{}]  # per trie node: token -> node
    weight, token = [0.0], [SEP]
    for rank, (end, _) in enumerate(occ):
        w = DECAY**rank
        weight[0] += w
        at = 0
        for t in tokens[end : end + depth]:
            if t == SEP:
                break
            nxt = children[at].get(t)
            if nxt is None:
                nxt = children[at][t] = len(weight)
                children.append({})
                weight.append(0.0)
                token.append(t)
            weight[nxt] += w
            at = nxt
    spec = Speculation(match=min(m for _, m in occ))  # what every continuation follows
    placed = {0: 0}  # trie node -> proposal node
    heap = [(-1.0, 0, 0)]  # (-p, trie node, its parent's trie node)
    while heap and len(spec.tokens) < budget:
        p, node, parent = heapq.heappop(heap)
        if node:
            spec.tokens.append(token[node])
            spec.parents.append(placed[parent])
            spec.probs.append(-p)
            placed[node] = len(spec.tokens)
        for child in children[node].values():
            q = -p * weight[child] / weight[node]
            if q >= MIN_PROB:
                heapq.heappush(heap, (-q, child, node))
    return spec
