"""A full-attention layer cache for a batch of sequences at different lengths, each rolled
back by its own amount: the cache a batched round verifies B proposals in.

Row i holds keys[i, :, :lens[i]] (right-padded: what lies past lens[i] is stale and masked).
A pass writes each row's L new keys at its own length (one scatter), a query sees the keys of
its own row up to its own position (an array mask), and RoPE reads each row's position from
``offset``. Giving back n tokens of row i is lens[i] -= n: O(1) and per row, where mlx-lm's
BatchKVCache (left-padded, one write index for all rows) can only trim every row alike.

The lengths live on the host (a list): the round reads its accepted counts back anyway, so
keeping them there costs no sync, and the capacity check needs no device value.

A sliding-window layer (``window``: a solo WindowKVCache's, caches.py) batches the same way:
its rows keep every key at its position and the mask limits each query to its window (a
query at position t sees keys t - window + 1 .. t), so it computes what the solo cache
computes, at the price of keys older than the window staying in memory while the row is in
a batch (the memory plan counts such layers at the whole context for a batch's rows). A row
that leaves gets a WindowKVCache back holding what a solo one keeps.

A recurrent layer (an ArraysCache: conv and SSM / gated-delta state) batches as
``BatchArraysCache``, row i of each state array being sequence i's. Its per-row rollback is
not a length: the batch records its verify pass and recomputes each row's recurrence over
that row's kept steps (recurrent.PassRecorder.settle_rows), and keeps the draft's state after
each of its steps to take each row's from; so only the mixers whose layout that recorder
knows batch (Qwen3.5, Qwen3-Next, Mamba 2, Nemotron-H, Falcon-H1, Granite 4).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache

from ..errors import RollbackError
from .caches import ROLLBACK_SLACK, WindowKVCache, layer_caches, make_caches, recurrent_layers
from .recurrent import PassRecorder

STEP = 256  # capacity grows in steps of this many positions, as mlx-lm's caches do


class BatchKVCache:
    """One layer's keys and values for B rows (see the module docstring)."""

    def __init__(self, lens: Sequence[int] = (), keys=None, values=None, window: int | None = None):
        self.lens = [int(n) for n in lens]
        self.keys, self.values = keys, values  # (B, heads, capacity, head_dim) or None
        self.window = window  # a sliding-window layer's window (None: full attention)
        self.fetched = (None, None)  # what the last pass read (keys_and_values)

    @property
    def lens(self) -> list[int]:
        """Each row's length (host ints); set it as a whole list."""
        return self._lens

    @lens.setter
    def lens(self, value: list[int]) -> None:
        # the device copy is made once per change, not at every read (RoPE reads it for
        # queries and keys, the write and the mask too)
        self._lens, self._at = value, None

    def _positions(self) -> mx.array:
        if self._at is None:
            self._at = mx.array(self._lens, dtype=mx.int32)
        return self._at

    # -- what mlx-lm's attention reads
    @property
    def offset(self) -> mx.array | int:
        """Each row's position (B,): RoPE's offset for the tokens fed next; one int when
        every row is at one length (as KVCache's: RoPE then takes a solo pass's path)."""
        return self.lens[0] if self.aligned() else self._positions()

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write keys, values (B, heads, L, dim) at each row's length; the keys a pass reads:
        every row's up to the longest, (B, heads, max(lens) + L, dim)."""
        B, H, L, D = keys.shape
        top = max(self.lens) + L
        if self.keys is None or top > self.keys.shape[2]:
            self._grow(top, keys, values)
        if self.aligned():  # every row at one length (one row, always): a plain slice
            at = self.lens[0]
            self.keys[..., at : at + L, :] = keys
            self.values[..., at : at + L, :] = values
        else:
            pos = self._positions()[:, None] + mx.arange(L)  # (B, L)
            rows = mx.arange(B)[:, None]
            self.keys[rows, :, pos] = keys.transpose(0, 2, 1, 3)  # (B, L, heads, dim) a slot
            self.values[rows, :, pos] = values.transpose(0, 2, 1, 3)
        self.lens = [n + L for n in self.lens]
        self.fetched = (self.keys[..., :top, :], self.values[..., :top, :])
        return self.fetched

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        """What the last update_and_fetch returned (Gemma 3n's KV-shared layers read it)."""
        return self.fetched

    def aligned(self) -> bool:
        """Whether every row holds as many tokens (then a pass is a solo pass's shape)."""
        return all(n == self.lens[0] for n in self.lens)

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        """(B, 1, N, max(lens) + N) booleans: query t of row i sees keys j <= lens[i] + t, and
        with a window w only those > lens[i] + t - w; with every row at one length, what
        mlx-lm's caches give a solo pass (None for one token, else "causal", while every key
        is in every window), so a batch of one computes exactly what a solo pass does."""
        window = window_size or self.window
        if window is not None and self.window is not None and window > self.window:
            raise RollbackError(
                f"a layer asks for a window of {window}; its cache keeps {self.window}"
            )
        if self.aligned() and not return_array:
            if window is None or self.lens[0] + N <= window:
                return None if N == 1 else "causal"
            return create_causal_mask(N, self.lens[0], window_size=window)
        start = self._positions()[:, None, None, None]  # (B, 1, 1, 1)
        keys = mx.arange(max(self.lens) + N)[None, None, None]  # (1, 1, 1, S)
        queries = start + mx.arange(N)[None, None, :, None]  # (B, 1, N, 1): their positions
        seen = keys <= queries
        return seen if window is None else seen & (keys > queries - window)

    def _grow(self, top: int, keys: mx.array, values: mx.array) -> None:
        B, H, _, D = keys.shape
        cap = _round_up(top)
        new_k = mx.zeros((B, H, cap, D), keys.dtype)
        new_v = mx.zeros((B, H, cap, values.shape[3]), values.dtype)
        if self.keys is not None:
            held = self.keys.shape[2]
            new_k[..., :held, :] = self.keys
            new_v[..., :held, :] = self.values
        self.keys, self.values = new_k, new_v

    # -- rollback and membership
    def give_back(self, counts: Sequence[int]) -> None:
        """Drop the last counts[i] tokens of row i."""
        self.lens = [n - int(c) for n, c in zip(self.lens, counts, strict=True)]

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Every row gives back n tokens (mlx-lm's trim, for callers that treat all alike)."""
        self.lens = [x - min(n, x) for x in self.lens]
        return n

    @property
    def state(self):
        return self.keys, self.values

    def rows(self) -> int:
        return len(self.lens)

    def join(self, cache: KVCache | WindowKVCache) -> None:
        """Add a sequence (an mlx-lm KVCache of one row, or a WindowKVCache, prefilled alone)
        as the last row: its keys at their positions (a window's older ones, dropped, as
        zeros its mask never reads)."""
        n = cache.offset
        if isinstance(cache, WindowKVCache):
            self.window = cache.window
            k, v = cache.state  # positions cache.start .. n - 1
            if k is not None and cache.start:
                k, v = (mx.pad(x, [(0, 0), (0, 0), (cache.start, 0), (0, 0)]) for x in (k, v))
        else:
            k, v = (None, None) if cache.keys is None else (cache.keys, cache.values)
        if k is None or n == 0:
            if self.keys is not None:  # an empty row
                self.keys = mx.concatenate([self.keys, mx.zeros_like(self.keys[:1])])
                self.values = mx.concatenate([self.values, mx.zeros_like(self.values[:1])])
            self.lens = [*self.lens, 0]
            return
        k, v = k[..., :n, :], v[..., :n, :]  # (1, heads, n, dim)
        cap = _round_up(n)
        if self.keys is None:  # (rows so far were empty)
            B = len(self.lens)
            self.keys = mx.zeros((B, k.shape[1], cap, k.shape[3]), k.dtype)
            self.values = mx.zeros((B, v.shape[1], cap, v.shape[3]), v.dtype)
        cap = max(cap, self.keys.shape[2])
        self.keys, self.values = _widen(self.keys, cap), _widen(self.values, cap)
        self.keys = mx.concatenate([self.keys, _widen(k, cap)])
        self.values = mx.concatenate([self.values, _widen(v, cap)])
        self.lens = [*self.lens, n]

    def row(self, i: int) -> KVCache | WindowKVCache:
        """Row i's keys and values as a one-row cache of the solo kind, the batch keeping
        them: a KVCache, or a WindowKVCache holding what a solo one keeps. Its own arrays:
        what is written to one never shows in the other."""
        n = self.lens[i]
        out = KVCache() if self.window is None else WindowKVCache(self.window)
        if self.keys is not None and n > 0:
            first = 0 if self.window is None else max(0, n - (self.window - 1 + ROLLBACK_SLACK))
            out.keys = mx.contiguous(self.keys[i : i + 1, :, first:n])
            out.values = mx.contiguous(self.values[i : i + 1, :, first:n])
            out.offset = n
            if self.window is not None:
                out.start = first
        return out

    def leave(self, i: int) -> KVCache | WindowKVCache:
        """Take row i out; its caches as ``row`` gives them (for a prompt cache)."""
        out = self.row(i)
        keep = [j for j in range(len(self.lens)) if j != i]
        self.lens = [self.lens[j] for j in keep]
        if self.keys is not None:
            idx = mx.array(keep, dtype=mx.int32)
            self.keys, self.values = self.keys[idx], self.values[idx]
        return out


def _round_up(n: int) -> int:
    return (n + STEP - 1) // STEP * STEP


def _widen(x: mx.array, cap: int) -> mx.array:
    """x (B, heads, S, dim) padded with zeros to S = cap."""
    extra = cap - x.shape[2]
    return mx.pad(x, [(0, 0), (0, 0), (0, extra), (0, 0)]) if extra > 0 else x


class BatchArraysCache(ArraysCache):
    """A recurrent layer's state for a batch's rows (see the module docstring): mlx-lm's
    ArraysCache holding B rows, with its own row count (a state no row has made yet is None
    for all of them; a row joining beside others that have one brings zeros, which is what
    the mixers start from). ``lengths`` (mlx-lm's: each row's real tokens in a right-padded
    pass) masks a draft's catch-up pads."""

    def __init__(self, size: int):
        super().__init__(size)
        self.n = 0

    def join(self, solo: ArraysCache) -> None:
        """Add a sequence's one-row state as the last row."""
        for e, theirs in enumerate(solo.cache):
            mine = self.cache[e]
            if mine is None and theirs is None:
                continue
            if mine is None:
                mine = mx.zeros((self.n, *theirs.shape[1:]), theirs.dtype)
            if theirs is None:
                theirs = mx.zeros((1, *mine.shape[1:]), mine.dtype)
            self.cache[e] = mx.concatenate([mine, theirs])
        self.n += 1

    def leave(self, i: int) -> ArraysCache:
        """Take row i out; its state as a one-row ArraysCache (for a prompt cache)."""
        out = ArraysCache(len(self.cache))
        out.cache = [None if c is None else mx.contiguous(c[i : i + 1]) for c in self.cache]
        keep = mx.array([j for j in range(self.n) if j != i], dtype=mx.int32)
        self.n -= 1
        self.cache = [None if c is None or not self.n else c[keep] for c in self.cache]
        return out


def batchable(model) -> str | None:
    """Why ``model`` cannot decode in a batch (None: it can): every layer's cache must be
    full attention, a sliding window (caches.WindowKVCache) or recurrent state whose mixers
    the batch can roll back per row (recurrent.PassRecorder knows their layout). A chunked
    or quantized cache, or another recurrent mixer, is not batched."""
    caches = make_caches(model)
    kinds = {type(c).__name__ for c in layer_caches(caches)}
    other = sorted(kinds - {"KVCache", "WindowKVCache", "ArraysCache"})
    if other:
        return f"its layers keep {', '.join(other)}, which a batch does not roll back per row"
    if "ArraysCache" in kinds and not PassRecorder(model, recurrent_layers(caches)).supported:
        return (
            f"its recurrent layers ({type(model).__module__.rsplit('.', 1)[-1]}) are not ones "
            "a batch rolls back per row"
        )
    return None


def _rows_like(solo):
    """An empty batch cache of the kind that holds rows of ``solo`` (one layer's cache)."""
    if isinstance(solo, CacheList):
        return CacheList(*[_rows_like(c) for c in solo.caches])
    if isinstance(solo, ArraysCache):
        return BatchArraysCache(len(solo.cache))
    return BatchKVCache()


def _join(rows, solo) -> None:
    if isinstance(rows, CacheList):
        for r, s in zip(rows.caches, solo.caches, strict=True):
            _join(r, s)
    else:
        rows.join(solo)


def _leave(rows, i: int):
    if isinstance(rows, CacheList):
        return CacheList(*[_leave(c, i) for c in rows.caches])
    return rows.leave(i)


def rows_of(caches: list | None, solo: list) -> list:
    """``caches`` (None: a batch of none yet, one batch cache per layer) with a sequence's
    one-row caches added as the last row, layer by layer."""
    caches = caches if caches is not None else [_rows_like(s) for s in solo]
    for c, s in zip(caches, solo, strict=True):
        _join(c, s)
    return caches


def solo_of(caches: list, i: int) -> list:
    """Row i taken out of every layer, as one-row caches of the solo kinds."""
    return [_leave(c, i) for c in caches]


def row_of(caches: list, i: int) -> list | None:
    """Row i of every layer as one-row caches of the solo kinds, the batch keeping it (a
    copy); None when a layer keeps recurrent state, which cannot be cut back to a prefix."""
    if any(not isinstance(c, BatchKVCache) for c in layer_caches(caches)):
        return None
    return [_row(c, i) for c in caches]


def _row(rows, i: int):
    if isinstance(rows, CacheList):
        return CacheList(*[_row(c, i) for c in rows.caches])
    return rows.row(i)


def attention_rows(caches: list) -> list[BatchKVCache]:
    """The layers whose rows are lengths (attention), CacheList entries unpacked."""
    return [c for c in layer_caches(caches) if isinstance(c, BatchKVCache)]
