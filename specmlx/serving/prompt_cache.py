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

With ``reuse`` N > 0 (llama-server's --cache-reuse N), a prompt also takes the runs of at
least N tokens an entry holds further on, moved to where the prompt has them
(core/shift.py): an editor's window that slid, a ring of other files that lost its first
chunk. The runs come from the entry giving the most tokens, scanned as llama-server scans
its one sequence, and where an insertion ends that scan (a ring's new chunk), from other
entries that go on from there (the warm-up that laid out the new ring, the suggestion
before it that holds the window). Where llama-server stops at the first token no run starts
with, a run may start up to N/4 tokens later here, those tokens prefilled in place: lines
typed between two runs, or a window's first token tokenized without the newline before it.
The moved caches are a new KVState: entries stay as they were. Moved keys are rotated exactly, but past the first layer they still carry
the context they were computed in, so text generated from them can differ from a fresh
prefill's: off unless asked. Not for recurrent state or head drafters (``refused`` says
why); a window that no longer holds what the moved prompt needs falls back to the prefix.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn

from ..core.caches import can_rollback, layer_caches
from ..core.kvstate import KVState, common_prefix, moved, reads_hidden
from ..core.shift import Shifter, Unshiftable, chunks, reused


class PromptCache:
    """LRU of KVState entries, at most ``budget_bytes`` of KV caches (0: keep none).
    Not thread-safe: the server's one generation thread owns it.

    reuse: the shortest run of cached tokens moved to another position (0: none, only the
    common prefix is kept), runs up to reuse // 4 tokens apart; target, draft: the models whose caches are moved (needed with
    reuse; each is probed once here: shift.Shifter)."""

    def __init__(
        self,
        budget_bytes: int,
        reuse: int = 0,
        target: nn.Module | None = None,
        draft: nn.Module | None = None,
    ):
        self.budget = budget_bytes
        self.entries: list[KVState] = []  # least recently used first
        self.reuse = reuse
        self.refused: str | None = None  # why runs are not moved with reuse > 0
        self.moved_tokens = 0  # tokens taken from moved runs (not the common prefixes)
        self._target = self._draft = None
        if reuse > 0 and target is not None:
            self._target = Shifter(target)
            self.refused = self._target.refused
            if draft is not None and reads_hidden(draft):
                self.refused = self.refused or (
                    "a head drafter is fed the target's hidden state at every position, "
                    "which only a prefill of the target makes"
                )
            elif draft is not None:
                self._draft = Shifter(draft)  # one that cannot move prefills its part

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
        if self._target is not None and self.refused is None:
            out = self._moved(context, best_len)
            if out is not None:
                if parts > len(out.tokens):  # (as below)
                    out.branch_at = parts
                return out
        out = KVState()
        if best >= 0:
            self.entries.append(self.entries.pop(best))  # by place: KVStates compare by value
            out = self.entries[-1].copy()
            out.sources = (id(self.entries[-1]),)
        if parts > best_len:  # an entry it parts from cannot give back that far: the
            out.branch_at = parts  # prefill leaves a copy there for the next (put, keep_branch)
        return out

    def _moved(self, context: Sequence[int], floor: int) -> KVState | None:
        """A moved copy of the runs that give ``context`` the most tokens, if that is more
        than ``floor`` (what the common prefix alone gives); None otherwise, or where the
        caches cannot move so (a window that dropped them). First the entry whose prefix
        and runs, as llama-server scans one sequence, give the most; then, where an
        insertion ended that scan, runs of the other entries that go on from there (a
        warm-up holds a ring's new chunk, the entry before it the window after it). Runs
        may be up to reuse // 4 tokens apart: those are prefilled in place."""
        live = [i for i, kv in enumerate(self.entries) if kv.target is not None]
        if any(self.entries[i].reads_hidden for i in live):
            return None
        runs, end, gap = [], 0, self.reuse // 4
        for i in reversed(live):  # the most recent first among equals
            kv = self.entries[i]
            start = common_prefix(kv.tokens, context)
            found = chunks(kv.tokens, context, start, self.reuse, gap=gap)
            if reused(found) > end:
                runs, end = [(i, p) for p in found], reused(found)
        going = True
        while going and end < len(context):
            going = False
            for i in reversed(live):
                more = chunks(self.entries[i].tokens, context, 0, self.reuse, at=end, gap=gap)
                if more:
                    runs += [(i, p) for p in more]
                    end, going = reused(more), True
                    break
        if not runs or end <= floor:
            return None
        try:
            out = moved(self.entries, runs, context, self._target, self._draft)
        except Unshiftable:
            return None
        used = {i for i, _ in runs}  # now the most recently used, in their order
        out.sources = tuple(id(self.entries[i]) for i in sorted(used))
        self.entries = [e for i, e in enumerate(self.entries) if i not in used] + [
            e for i, e in enumerate(self.entries) if i in used
        ]
        made = layer_caches((out.target or []) + (out.draft or []))
        mx.eval([(c.keys, c.values) for c in made if c.keys is not None])  # copied now
        self.moved_tokens += sum(n for _, (s, d, n) in runs if s != d)
        return out

    def put(self, kv: KVState) -> None:
        """Keep ``kv`` (what a generation left) as the most recently used entry, with the
        copy its prefill left where it parted from an entry (``keep_branch``): entries it
        can stand in for go (its tokens extend theirs and its caches give back that far),
        then the least recently used down to the budget."""
        self.keep_branch(kv)
        kv.sources = ()  # (an entry now: it was made from those, it is not them)
        if self.budget <= 0 or kv.target is None or not kv.tokens:
            return
        self.entries = [e for e in self.entries if not _stands_in(kv, e)]
        self.entries.append(kv)
        while self.entries and self.nbytes > self.budget:
            self.entries.pop(0)

    def forget(self, sources: tuple[int, ...]) -> int:
        """Drop the entries a failed generation's caches were made from (``KVState.sources``):
        whatever broke it may be in them, and the next request for that prompt then starts
        from a fresh prefill instead of failing again. Returns how many went."""
        before = len(self.entries)
        self.entries = [e for e in self.entries if id(e) not in sources]
        return before - len(self.entries)

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
