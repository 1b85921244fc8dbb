"""KV caches of recent sequences, kept across requests within a memory budget (LRU).

A request gets a copy of the entry whose tokens share the longest prefix with its prompt; the
engine trims the copy to that prefix and prefills only the rest (engine.KVState), and what it
leaves comes back as a new entry. The entry itself stays, so requests that run at once share
it (chat clients with one system prompt, an editor's suggestion and its follow-up): a copy
costs nothing until it is written, when MLX copies the buffer it writes (the entry's arrays
are never written through). An entry that a newer one extends (its tokens a prefix of the
newer's) goes when the newer comes back; the least recently used go past the budget.

Window and recurrent caches cannot give back to any prefix: an entry is taken only where
its caches can be cut back to what it shares with the prompt, and where the prompt parts
from an entry further on, its prefill stops there once and leaves a copy (KVState.branch),
kept as an entry of its own: the next prompt that parts there (another chat with the same
system prompt on a hybrid model) starts from it. A newer entry that cannot give back to an
older one's end does not replace it.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..core.caches import can_rollback
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
        best, best_len, parts = -1, 0, 0
        for i, kv in enumerate(self.entries):
            m = common_prefix(kv.tokens, context)
            parts = max(parts, m)
            if m > best_len and can_rollback(kv.target, len(kv.tokens) - m):
                best, best_len = i, m
        out = KVState()
        if best >= 0:
            self.entries.append(self.entries.pop(best))  # by place: KVStates compare by value
            out = self.entries[-1].copy()
        if parts > best_len:  # an entry it parts from cannot give back that far: the
            out.branch_at = parts  # prefill leaves a copy there for the next (put, keep_branch)
        return out

    def put(self, kv: KVState) -> None:
        """Keep ``kv`` (what a generation left) as the most recently used entry, with the
        copy its prefill left where it parted from an entry (``keep_branch``): entries it
        can stand in for go (its tokens extend theirs and its caches give back that far),
        then the least recently used down to the budget."""
        self.keep_branch(kv)
        if self.budget <= 0 or kv.target is None or not kv.tokens:
            return
        self.entries = [e for e in self.entries if not _stands_in(kv, e)]
        self.entries.append(kv)
        while self.entries and self.nbytes > self.budget:
            self.entries.pop(0)

    def keep_branch(self, kv: KVState) -> None:
        """Keep the copy of the caches that ``kv``'s prefill left where its prompt parted
        from an entry (KVState.branch), if any, and clear it from ``kv``."""
        branch, kv.branch = kv.branch, None
        if branch is not None:
            self.put(branch)

    def clear(self) -> None:
        self.entries.clear()


def _stands_in(new: KVState, old: KVState) -> bool:
    """Whether ``new`` serves every prompt ``old`` serves: its tokens start with all of
    old's and its caches can give back to there (a window or recurrent state cannot)."""
    n = len(old.tokens)
    return (
        n <= len(new.tokens)
        and new.tokens[:n] == old.tokens
        and can_rollback(new.target, len(new.tokens) - n)
    )
