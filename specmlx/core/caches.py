"""Per-layer caches that give tokens back exactly: the one place rollback is decided.

mlx-lm makes three kinds of layer cache, and speculation must undo tokens in each:

- ``KVCache`` (full attention): rollback is an offset move, always exact.
- ``RotatingKVCache`` (sliding-window attention: Gemma 3/4, gpt-oss, Cohere 2, OLMo 3, ...):
  it drops a key as soon as the key leaves the window, so once the ring has wrapped (or a
  multi-token pass has pushed the oldest keys out) moving the offset back leaves queries a
  short or wrong window, and the output silently differs from the target's. specmlx replaces
  each one with ``WindowKVCache``, which keeps ``ROLLBACK_SLACK`` keys beyond the window so a
  rollback of up to that many tokens is exact, while the mask still limits every query to the
  window.
- ``ArraysCache`` (recurrent state: conv + SSM / gated-delta, in Qwen3.5, Qwen3-Next, Mamba 2,
  Nemotron-H, ...): a state cannot be un-advanced. ``snapshot`` keeps the state arrays at a
  round's start (MLX arrays are never changed in place by these layers: the mixers assign new
  arrays, so keeping references costs no copy) and ``rollback`` restores them, after which the
  engine feeds the kept tokens again (``Rollback.replay``).
- ``ChunkedKVCache`` (Llama 4's chunked attention) keeps only a chunk's worth of keys before
  each pass; ``ChunkKVCache`` keeps ``ROLLBACK_SLACK`` more, as the window does.

A family whose own output depends on how tokens are batched into passes (plamo3 in mlx-lm
0.32) has no one target output to keep: its caches stay mlx-lm's, named so that speculation
is refused (``BatchDependentRotatingKVCache``). A cache class with no known rollback
(deepseek_v41's ``LayerCache``) is refused by name.

Whether a rollback can be exact is checked when it happens, never assumed from an empty cache:
a cache that cannot give back n tokens exactly raises ``RollbackError``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    _BaseCache,
    can_trim_prompt_cache,
    make_prompt_cache,
)

from ..errors import IncompatiblePair, RollbackError

__all__ = [
    "ROLLBACK_SLACK",
    "BatchDependentRotatingKVCache",
    "ChunkKVCache",
    "WindowKVCache",
    "cache_kinds",
    "can_rollback",
    "check_kinds",
    "make_caches",
    "mlx_lm_speculates",
    "needs_replay",
    "recurrent_layers",
    "restore",
    "snapshot",
    "trim",
]

# the most tokens one rollback gives back: a verify pass feeds the last token plus up to 31
# suffix lookup proposals (adaptive.SUFFIX_MAX), all 31 given back at worst; per-token
# stopping drafts up to 8 past the chooser's k, and an early close undoes one queued plain
# pass; 32 covers each of them (32 keys per sliding layer: a few KB on a small model)
ROLLBACK_SLACK = 32


class WindowKVCache(_BaseCache):
    """A sliding-window KV cache that can give back up to ``slack`` tokens exactly.

    Keys are kept in temporal order in one buffer holding at least the last window - 1 + slack
    positions (older ones are dropped a step at a time, so the copy is amortized); a pass over
    S tokens returns the last window - 1 + S keys, which are all any of its queries may see,
    and ``make_mask`` limits each query to its own window. It computes what mlx-lm's
    RotatingKVCache computes (the same keys, in time order rather than ring order)."""

    step = 256

    def __init__(self, window: int, slack: int = ROLLBACK_SLACK):
        self.window, self.slack = int(window), int(slack)
        self.keys: mx.array | None = None  # (B, heads, capacity, head_dim)
        self.values: mx.array | None = None
        self.offset = 0  # tokens seen: the absolute position of the next one
        self.start = 0  # the absolute position of keys[..., 0, :]
        self.fetched = (0, 0)  # the buffer rows the last pass got

    @property
    def held(self) -> int:
        """Positions in the buffer: start .. offset - 1."""
        return self.offset - self.start

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        S = keys.shape[2]
        held = self.held
        if self.keys is None or held + S > self.keys.shape[2]:
            # what a later query or a rollback can still ask for; the rest is gone for good
            keep = min(held, self.window - 1 + self.slack)
            size = keep + S + self.step
            B, heads, _, dk = keys.shape
            new_k = mx.zeros((B, heads, size, dk), keys.dtype)
            new_v = mx.zeros((B, heads, size, values.shape[3]), values.dtype)
            if keep:
                new_k[..., :keep, :] = self.keys[..., held - keep : held, :]
                new_v[..., :keep, :] = self.values[..., held - keep : held, :]
            self.keys, self.values = new_k, new_v
            self.start, held = self.offset - keep, keep
        self.keys[..., held : held + S, :] = keys
        self.values[..., held : held + S, :] = values
        self.offset += S
        end = held + S
        self.fetched = (max(0, end - (self.window - 1 + S)), end)
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        """What the last update_and_fetch returned: Gemma 3n's KV-shared layers read their
        owner layer's keys with this, in the same pass and under the same mask."""
        lo, end = self.fetched
        return self.keys[..., lo:end, :], self.values[..., lo:end, :]

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        """The mask for a pass over N tokens, made before its update_and_fetch: the keys that
        pass gets are the min(held, window - 1) before it plus its own N."""
        window = self.window if window_size is None else window_size
        if window > self.window:
            raise RollbackError(
                f"a layer asks for a window of {window} from a cache that keeps {self.window}"
            )
        before = min(self.held, self.window - 1)
        if before + N <= window and not (return_array and N > 1):
            return None if N == 1 else "causal"  # every key returned is in every window
        return create_causal_mask(N, before, window_size=window)

    def can_trim(self, n: int) -> bool:
        """Whether giving back n tokens leaves every key a later query needs."""
        n = min(n, self.offset)
        return self.held - n >= min(self.offset - n, self.window - 1)

    def is_trimmable(self) -> bool:
        return True  # within the slack; trim() refuses beyond it (can_trim says in advance)

    def trim(self, n: int) -> int:
        n = min(n, self.offset)
        if not self.can_trim(n):
            raise RollbackError(
                f"a sliding-window cache cannot give back {n} tokens "
                f"(window {self.window}, slack {self.slack}, holding {self.held})"
            )
        self.offset -= n
        return n

    def size(self) -> int:
        return min(self.offset, self.window)

    @property
    def state(self):
        held = self.held
        if self.keys is None:
            return None, None
        return self.keys[..., :held, :], self.values[..., :held, :]

    @state.setter
    def state(self, v):
        raise NotImplementedError("WindowKVCache is not saved to disk")

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


class ChunkKVCache(ChunkedKVCache):
    """mlx-lm's ChunkedKVCache (Llama 4's chunked attention) keeping ``slack`` keys more than
    a chunk, so that a rollback within them is exact: mlx-lm's keeps only the last chunk's
    worth before each pass, which a draft's one-token steps leave nothing to give back from.
    The model builds the mask from ``start_position`` and its own chunk size, so the extra
    keys are never seen by a query outside their chunk."""

    def __init__(self, chunk_size: int, slack: int = ROLLBACK_SLACK):
        super().__init__(chunk_size)
        self.slack = int(slack)

    def can_trim(self, n: int) -> bool:
        """Whether giving back n tokens keeps what the next query needs: at position
        offset - n, it sees keys from its chunk's start on, which must still be held."""
        keep = self.offset - min(n, self.offset)
        return self.start_position <= keep - keep % self.chunk_size

    def maybe_trim_front(self) -> None:
        if self.keys is None:
            return
        valid = self.offset - self.start_position  # keys held: (B, heads, valid, head_dim)
        drop = valid - (self.chunk_size + self.slack)
        if drop > 0:
            self.start_position += drop
            self.keys = self.keys[..., drop:valid, :]
            self.values = self.values[..., drop:valid, :]


class BatchDependentRotatingKVCache(RotatingKVCache):
    """mlx-lm's RotatingKVCache, unchanged, in a family whose output depends on how the tokens
    are split into passes (``why``): there is no one target output for speculation to keep,
    so plain decoding runs as mlx-lm's does and ``check_kinds`` refuses speculation."""

    why = ""


# mlx-lm modules whose own output depends on how tokens are batched into passes
_BATCH_DEPENDENT = {
    "mlx_lm.models.plamo3": "its sliding layers mask window + 1 keys in a multi-token pass "
    "but see window keys in a one-token step, so its output depends on how tokens are batched",
}


def _batch_dependent(c: RotatingKVCache, why: str) -> BatchDependentRotatingKVCache:
    kept = BatchDependentRotatingKVCache(c.max_size, c.keep)
    kept.why = why
    return kept


def _convert(c, slack: int):
    """One layer's cache as specmlx keeps it; a kind it cannot roll back raises."""
    if isinstance(c, CacheList):
        c.caches = [_convert(x, slack) for x in c.caches]
        return c
    if type(c) is RotatingKVCache:
        if c.keep:
            raise IncompatiblePair(
                f"RotatingKVCache with {c.keep} kept tokens (attention sinks): "
                "speculation cannot roll it back exactly"
            )
        return WindowKVCache(c.max_size, slack)
    if type(c) is ChunkedKVCache:
        return ChunkKVCache(c.chunk_size, slack)
    return c


def make_caches(model: nn.Module, slack: int = ROLLBACK_SLACK) -> list:
    """The model's caches (mlx-lm's make_prompt_cache) with every sliding window and attention
    chunk given ``slack`` tokens of rollback room (a batch-dependent family's kept as
    mlx-lm's, named for check_kinds to refuse). Plain decoding uses them too, so it computes
    exactly what speculation does."""
    made = make_prompt_cache(model)
    why = _BATCH_DEPENDENT.get(type(model).__module__)
    if why is not None:
        return [_batch_dependent(c, why) if type(c) is RotatingKVCache else c for c in made]
    return [_convert(c, slack) for c in made]


def layer_caches(cache: Sequence) -> list:
    """Every leaf layer cache, CacheList entries unpacked."""
    out = []
    for c in cache:
        if c is not None:  # (Gemma 4's KV-shared layers have no cache of their own)
            out += layer_caches(c.caches) if isinstance(c, CacheList) else [c]
    return out


def cache_kinds(cache: Sequence) -> dict[str, int]:
    """Layer cache class name -> how many layers use it (for --json and errors)."""
    kinds: dict[str, int] = {}
    for c in layer_caches(cache):
        kinds[type(c).__name__] = kinds.get(type(c).__name__, 0) + 1
    return kinds


# layer caches whose rollback is known exact: a trim (checked when it happens) or, for
# ArraysCache, a restored snapshot and a replay
_KNOWN = (
    KVCache,
    QuantizedKVCache,
    WindowKVCache,
    RotatingKVCache,
    ChunkKVCache,  # (mlx-lm's own ChunkedKVCache is always replaced: make_caches)
    ArraysCache,
)


def check_kinds(cache: Sequence, what: str = "model") -> None:
    """Refuse, by name, a cache holding a layer kind no exact rollback is known for."""
    for c in layer_caches(cache):
        if isinstance(c, BatchDependentRotatingKVCache):
            raise IncompatiblePair(
                f"the {what}'s {type(c).__name__} layer cache cannot speculate exactly: {c.why}"
            )
        if type(c) not in _KNOWN:
            raise IncompatiblePair(
                f"the {what}'s {type(c).__name__} layer cache cannot be rolled back exactly, "
                "so it cannot speculate"
            )


def recurrent_layers(cache: Sequence) -> list[ArraysCache]:
    """The layers holding recurrent state, in layer order."""
    return [c for c in layer_caches(cache) if isinstance(c, ArraysCache)]


def needs_replay(cache: Sequence) -> bool:
    """Whether rolling back needs the kept tokens fed again (recurrent state)."""
    return any(isinstance(c, ArraysCache) for c in layer_caches(cache))


def _trimmable(c, n: int) -> bool:
    """Asked of the layer's cache, now (check_kinds lets in only kinds whose answer is
    known true): specmlx's own kinds say whether these n tokens can go (``can_trim``);
    mlx-lm's say whether any can (``is_trimmable``: always for its full caches, for its
    rotating cache only until it first drops a key, never for recurrent state)."""
    can_trim = getattr(c, "can_trim", None)
    return can_trim(n) if can_trim is not None else c.is_trimmable()


def can_rollback(cache: Sequence, n: int) -> bool:
    """Whether ``trim(cache, n)`` can give back n tokens exactly, without a replay."""
    return n == 0 or all(_trimmable(c, n) for c in layer_caches(cache))


def trim(cache: Sequence, n: int, recurrent: bool = True) -> None:
    """Give back the last n tokens of every layer exactly, or raise RollbackError (and change
    nothing). Recurrent layers cannot: use snapshot/restore and a replay, or pass
    ``recurrent=False`` to trim only the others (their state is set by other means)."""
    if n <= 0:
        return
    layers = [c for c in layer_caches(cache) if recurrent or not isinstance(c, ArraysCache)]
    for c in layers:
        if not _trimmable(c, n):
            raise RollbackError(
                f"{type(c).__name__} cannot give back {n} tokens exactly "
                f"(layer caches: {_kinds_text(cache)})"
            )
    for c in layers:
        c.trim(n)


@dataclass
class Snapshot:
    """A cache's position and its recurrent layers' state arrays at one moment."""

    offset: int  # tokens the cache held
    arrays: list[list | None]  # per layer: an ArraysCache's arrays, None for others

    @property
    def recurrent(self) -> list[list]:
        """The recurrent layers' arrays, in layer order."""
        return [a for a in self.arrays if a is not None]


def snapshot(cache: Sequence, offset: int) -> Snapshot:
    """Remember the recurrent state of ``cache``, which holds ``offset`` tokens. Costs no
    copy: the arrays are kept by reference (the mixers assign new arrays, never write)."""
    return Snapshot(
        offset, [list(c.cache) if isinstance(c, ArraysCache) else None for c in layer_caches(cache)]
    )


def restore(cache: Sequence, snap: Snapshot, offset: int) -> None:
    """Bring a cache now holding ``offset`` tokens back to ``snap``: attention layers trim
    offset - snap.offset tokens, recurrent layers take the snapshot's arrays back."""
    layers = layer_caches(cache)
    fed = offset - snap.offset
    for c, arrays in zip(layers, snap.arrays, strict=True):
        if arrays is None and not _trimmable(c, fed):
            raise RollbackError(
                f"{type(c).__name__} cannot give back {fed} tokens exactly "
                f"(layer caches: {_kinds_text(cache)})"
            )
    for c, arrays in zip(layers, snap.arrays, strict=True):
        if arrays is None:
            c.trim(fed)
        else:
            c.cache = list(arrays)


def roll_back(
    model: nn.Module,
    cache: Sequence,
    held: int,
    keep: int,
    snaps: Sequence[Snapshot],
    context: Sequence[int],
    settle: Callable[[Snapshot, int], bool] | None = None,
    own_ids: Callable[[list[int]], list[int]] | None = None,
) -> int:
    """Make ``cache`` (holding ``held`` tokens) hold context[:keep]; returns the tokens fed
    again. A trim where that is exact; else (recurrent state) the latest snapshot at or
    before ``keep``: ``settle(snap, keep)`` may set the state from a recorded pass (True:
    done, the attention layers are then trimmed), otherwise the snapshot is restored and
    context[snap.offset:keep] fed again, left lazy for the next round's host sync.

    model: the cache's model (for the replay); snaps: the states kept this round; context:
    the tokens so far; own_ids: maps replayed ids to ids the model embeds (a narrower draft)."""
    if held <= keep:
        return 0
    snap = max((s for s in snaps if s.offset <= keep), key=lambda s: s.offset, default=None)
    if snap is None or can_rollback(cache, held - keep):
        trim(cache, held - keep)  # RollbackError where a trim would not be exact
        return 0
    if settle is not None and settle(snap, keep):
        trim(cache, held - keep, recurrent=False)  # the state was set from the pass
        return 0
    restore(cache, snap, held)
    again = list(context[snap.offset : keep])
    again = own_ids(again) if own_ids is not None else again
    if again:
        model(mx.array(again, dtype=mx.uint32)[None], cache=cache)
    return len(again)


def mlx_lm_speculates(model: nn.Module) -> bool:
    """Whether mlx-lm's own speculative loop takes this model (it checks that every layer
    cache can be trimmed, on fresh caches: recurrent state cannot)."""
    return can_trim_prompt_cache(make_prompt_cache(model))


def _kinds_text(cache: Sequence) -> str:
    return ", ".join(f"{n} {k}" for k, n in cache_kinds(cache).items())
