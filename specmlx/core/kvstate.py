"""What a generation leaves in the caches, and how much of it the next one can keep.

``KVState`` is both models' caches and the tokens they hold between generations (a prompt
cache hands one to the engine); ``reuse_prefix`` keeps their longest common prefix with a new
prompt. A draft that reads the target's hidden states (an MTP head) rides along: its cache
holds pairs (h_j, t_{j+1}) and ``waiting`` the confirmed states it has not been fed yet, so
what it may keep depends on what the target keeps (``_head_keep``, ``_trim_head``).
``moved`` builds a KVState from runs of cached sequences moved to new positions (shift.py:
llama-server's --cache-reuse).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import mlx.core as mx
import mlx.nn as nn

from .caches import can_rollback, make_caches, trim
from .shift import Piece, Shifter, Unshiftable, reused

__all__ = ["KVState", "common_prefix", "moved", "reads_hidden", "reuse_prefix"]


@dataclass
class KVState:
    """Both models' KV caches and the tokens they hold. Between generations the target cache
    holds ``tokens`` and the draft cache tokens[:draft_held]. Pass one to generate_tokens to
    reuse its longest common prefix with the prompt (a prompt cache), or to inspect it after.
    ``target`` None means "make fresh caches"."""

    target: list | None = None
    draft: list | None = None
    tokens: list[int] = field(default_factory=list)
    draft_held: int = 0
    # a draft that reads the target's hidden states (an MTP head): its cache holds draft_held
    # pairs (h_j, t_{j+1}) and ``waiting`` (m, H) the confirmed hidden states at positions
    # draft_held..draft_held+m-1 it has not been fed yet (row_drafters.HeadRows)
    waiting: mx.array | None = None
    reads_hidden: bool = False
    # where the next prefill stops once on its way to leave a copy of the caches in
    # ``branch`` (0: nowhere): a prompt cache asks for one where a prompt parts from an
    # entry whose caches cannot give back that far (a window, recurrent state), so that
    # the prompts that part there later find it
    branch_at: int = 0
    branch: KVState | None = None
    # the prompt-cache entries this was made from (their ids): a generation that fails
    # on it has the prompt cache drop them (PromptCache.forget), whatever went wrong
    sources: tuple[int, ...] = ()

    def nbytes(self) -> int:
        """Bytes the caches hold now."""
        caches = (self.target or []) + (self.draft or [])
        return sum(getattr(c, "nbytes", 0) for c in caches)

    def copy(self) -> KVState:
        """A copy that a generation may write without changing this one (two requests
        starting from one prompt-cache entry). Free until written: a copied mx.array shares
        its buffer, and MLX writes a shared buffer by copying it, never in place."""
        return copy.deepcopy(replace(self, branch=None))

    def drop(self) -> None:
        """Forget the caches: the next generation starts from fresh ones (a branch, a copy
        of its own, stays)."""
        self.target, self.draft, self.tokens, self.draft_held = None, None, [], 0
        self.waiting, self.reads_hidden = None, False


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def reads_hidden(draft) -> bool:
    """Whether the draft is a head over the target's hidden states (not a model)."""
    return bool(getattr(draft, "reads_hidden", None))


def reuse_prefix(
    kv: KVState, context: list[int], target: nn.Module, draft: nn.Module | None
) -> int:
    """Keep the longest common prefix of what ``kv`` holds and ``context`` (the prompt minus
    its last token, which the first round feeds); returns its length. Caches that cannot be
    trimmed are kept only when they hold a prefix of the context, else replaced."""
    held = kv.tokens
    m = common_prefix(held, context)
    keep = _head_keep(kv, m, reads_hidden(draft)) if kv.reads_hidden else m
    if keep < len(held):
        if can_rollback(kv.target, len(held) - keep):
            trim(kv.target, len(held) - keep)
        else:  # recurrent state, or a window that dropped what the shorter prefix needs
            kv.target, keep = make_caches(target), 0
    m = min(m, keep)
    kv.tokens = held[:m]
    if kv.reads_hidden and kv.draft is not None:
        _trim_head(kv, m, keep, reads_hidden(draft))
    elif kv.draft is not None:
        keep = min(kv.draft_held, m)
        if keep < kv.draft_held and can_rollback(kv.draft, kv.draft_held - keep):
            trim(kv.draft, kv.draft_held - keep)
        elif keep < kv.draft_held:
            kv.draft, keep = (make_caches(draft) if draft is not None else None), 0
        kv.draft_held = keep
    return m


def _head_keep(kv: KVState, m: int, using: bool) -> int:
    """How many tokens the target cache keeps when a head's state rides along in ``kv``
    and the new context shares m tokens with what the target holds. The head holds pairs
    j < fed and waits on hidden states for positions fed..avail-1. A generation that uses
    the head needs its pending rows to reach where the target resumes, so the target keeps
    min(m, avail) when that leaves the head's pairs inside the shared prefix, else both go
    back to m - 1 (the head's last pair reads token t_fed: it must be shared) and the target
    recomputes from there. One that does not use the head keeps m."""
    if not using:
        return m
    fed = kv.draft_held
    avail = fed + (0 if kv.waiting is None else kv.waiting.shape[0])
    if fed + 1 <= min(m, avail):
        return min(m, avail)
    return max(0, min(fed, m - 1))


def _trim_head(kv: KVState, m: int, keep: int, using: bool) -> None:
    """Bring a head's state to what is still right once the target keeps ``keep`` tokens
    and the new context shares m with them: a pair j reads token t_{j+1}, so pairs stay
    only where that token is shared; pending rows reach no further than the target resumes.
    A generation using the head needs it exactly at the target's length or with rows up to
    it (``_head_keep`` chose ``keep`` so)."""
    fed = kv.draft_held
    if using:
        p = min(fed, keep)
    else:
        p = fed if m > fed else max(0, m - 1)
    if p < fed:
        trim(kv.draft, fed - p)
        kv.draft_held, kv.waiting = p, None
    elif kv.waiting is not None:
        n = min(keep, m) - fed
        kv.waiting = kv.waiting[:n] if n > 0 else None


def moved(
    sources: Sequence[KVState],
    runs: Sequence[tuple[int, Piece]],
    context: Sequence[int],
    target: Shifter,
    draft: Shifter | None,
) -> KVState:
    """A new KVState holding context[:reused] (the new prompt's first tokens), made from
    runs of cached sequences (an index into ``sources``, a piece of that one:
    shift.chunks), in the new prompt's order; the sources are never changed. The target's
    caches are moved by ``target``, the tokens of a gap between two runs prefilled in place.
    The draft model's are moved by ``draft`` over the runs it holds up to the first gap, or,
    where it cannot move, cut back to the first source's common prefix (or made afresh):
    the engine prefills the rest, the draft's part being the cheap one. Raises Unshiftable
    where the target's caches cannot move so, or a head rides along: a head is fed the
    target's hidden state at every position, which only a prefill of the target makes."""
    if any(kv.reads_hidden for kv in sources):
        raise Unshiftable(
            "a head drafter is fed the target's hidden state at every position, which only "
            "a prefill of the target makes"
        )
    held = max(len(kv.tokens) for kv in sources)
    caches, done, pending = None, 0, []
    for i, (s, d, n) in runs:
        if d > done + sum(p[2] for _, p in pending):  # a gap: move what is pending, fill it
            caches, done = _moved_on(target, caches, done, pending, held)
            caches = caches if caches is not None else make_caches(target.model)
            target.fill(caches, context[done:d])
            done, pending = d, []
        pending.append((sources[i].target, (s, d, n)))
    caches, done = _moved_on(target, caches, done, pending, held)
    out = KVState(target=caches, tokens=list(context[:done]))
    if any(kv.draft is not None for kv in sources):
        out.draft, out.draft_held = _draft_moved(sources, runs, draft)
    return out


def _moved_on(target: Shifter, caches, done: int, pending, held: int):
    """(caches holding what ``caches`` held, ``done`` tokens, then the pending runs; how
    many tokens that is)."""
    if not pending:
        return caches, done
    base = [(caches, (0, 0, done))] if caches is not None and done else []
    return target.move(base + pending, held), done + sum(p[2] for _, p in pending)


def _draft_moved(sources: Sequence[KVState], runs: Sequence[tuple[int, Piece]], draft):
    """(draft caches, tokens they hold) for ``moved``: the runs within what each source's
    draft holds (a prefix of its target's tokens), moved, up to the first that is not;
    else the first source's share of the common prefix."""
    within, reach = [], 0
    for i, (s, d, n) in runs:
        take = min(n, sources[i].draft_held - s) if sources[i].draft is not None else 0
        if take <= 0 or d != reach:  # (a gap: the engine prefills the draft from there)
            break
        reach += take
        within.append((sources[i].draft, (s, d, take)))
        if take < n:
            break
    if draft is not None and within:
        try:
            held = max(kv.draft_held for kv in sources)
            return draft.move(within, held), reused([p for _, p in within])
        except Unshiftable:
            pass
    if not runs or runs[0][1][0] != 0:  # no common prefix (its first run moved)
        return None, 0  # the engine makes fresh ones
    i, (_, _, n) = runs[0]
    first = sources[i]
    keep = min(n, first.draft_held)
    caches = copy.deepcopy(first.draft)
    if caches is not None and can_rollback(caches, first.draft_held - keep):
        trim(caches, first.draft_held - keep)
        return caches, keep
    return None, 0
