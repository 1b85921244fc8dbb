"""KV caches of recent sequences, kept across requests within a memory budget (LRU).

A request takes the entry whose tokens share the longest prefix with its prompt; the engine
trims both caches to that prefix and prefills only the rest (engine.KVState), and the entry
comes back holding the new sequence. An entry that shares less than half of its own prompt is
left for its own sequence (another file in the editor: a shared licence header is no reason
to throw it away) and the request starts from fresh caches; the least recently used entries
go when the budget is exceeded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..decoding.engine import KVState


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass
class Entry:
    kv: KVState
    prompt_len: int  # the prompt part of kv.tokens (the rest was generated)


class PromptCache:
    """LRU of KVState entries, at most ``budget_bytes`` of KV caches (0: keep none).
    Not thread-safe: the server's one generation thread owns it."""

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.entries: list[Entry] = []  # least recently used first

    @property
    def nbytes(self) -> int:
        return sum(e.kv.nbytes() for e in self.entries)

    def take(self, prompt: Sequence[int]) -> KVState:
        """The caches to serve ``prompt`` from (out of the pool until ``put`` back), or a
        fresh KVState. The prompt's last token is always fed anew, so it never counts."""
        context = prompt[:-1]
        best, best_len = None, 0
        for entry in self.entries:
            m = common_prefix(entry.kv.tokens, context)
            if m > best_len:
                best, best_len = entry, m
        if best is None or 2 * best_len < min(best.prompt_len, len(best.kv.tokens)):
            return KVState()
        self.entries.remove(best)
        return best.kv

    def put(self, kv: KVState, prompt_len: int) -> None:
        """Keep ``kv`` (which served a prompt of ``prompt_len`` tokens) as the most recently
        used entry, then evict the least recently used down to the budget."""
        if self.budget <= 0 or kv.target is None or not kv.tokens:
            return
        self.entries.append(Entry(kv, prompt_len))
        while self.entries and self.nbytes > self.budget:
            self.entries.pop(0)

    def clear(self) -> None:
        self.entries.clear()
