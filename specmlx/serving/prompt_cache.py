"""KV caches of recent sequences, kept across requests within a memory budget (LRU).

A request gets a copy of the entry whose tokens share the longest prefix with its prompt; the
engine trims the copy to that prefix and prefills only the rest (engine.KVState), and what it
leaves comes back as a new entry. The entry itself stays, so requests that run at once share
it (chat clients with one system prompt, an editor's suggestion and its follow-up): a copy
costs nothing until it is written, when MLX copies the buffer it writes (the entry's arrays
are never written through). An entry that a newer one extends (its tokens a prefix of the
newer's) goes when the newer comes back; the least recently used go past the budget.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..core.kvstate import KVState, common_prefix


class PromptCache:
    """LRU of KVState entries, at most ``budget_bytes`` of KV caches (0: keep none).
    Not thread-safe: the server's one generation thread owns it."""

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.entries: list[KVState] = []  # least recently used first

    @property
    def nbytes(self) -> int:
        return sum(kv.nbytes() for kv in self.entries)

    def take(self, prompt: Sequence[int]) -> KVState:
        """The caches to serve ``prompt`` from: a copy of the entry sharing the longest
        prefix with it (the entry stays, now the most recently used), or a fresh KVState.
        The prompt's last token is always fed anew, so it never counts."""
        context = prompt[:-1]
        best, best_len = -1, 0
        for i, kv in enumerate(self.entries):
            m = common_prefix(kv.tokens, context)
            if m > best_len:
                best, best_len = i, m
        if best < 0:
            return KVState()
        self.entries.append(self.entries.pop(best))  # by place: KVStates compare by value
        return self.entries[-1].copy()

    def put(self, kv: KVState) -> None:
        """Keep ``kv`` (what a generation left) as the most recently used entry: entries it
        extends go, then the least recently used down to the budget."""
        if self.budget <= 0 or kv.target is None or not kv.tokens:
            return
        self.entries = [e for e in self.entries if not _extends(kv.tokens, e.tokens)]
        self.entries.append(kv)
        while self.entries and self.nbytes > self.budget:
            self.entries.pop(0)

    def clear(self) -> None:
        self.entries.clear()


def _extends(tokens: list[int], prefix: list[int]) -> bool:
    """Whether ``tokens`` starts with all of ``prefix``."""
    return len(prefix) <= len(tokens) and tokens[: len(prefix)] == prefix
