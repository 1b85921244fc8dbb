"""A full-attention layer cache for a batch of sequences at different lengths, each rolled
back by its own amount: the cache a batched round verifies B proposals in.

Row i holds keys[i, :, :lens[i]] (right-padded: what lies past lens[i] is stale and masked).
A pass writes each row's L new keys at its own length (one scatter), a query sees the keys of
its own row up to its own position (an array mask), and RoPE reads each row's position from
``offset``. Giving back n tokens of row i is lens[i] -= n: O(1) and per row, where mlx-lm's
BatchKVCache (left-padded, one write index for all rows) can only trim every row alike.

The lengths live on the host (a list): the round reads its accepted counts back anyway, so
keeping them there costs no sync, and the capacity check needs no device value.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from .caches import layer_caches, make_caches

STEP = 256  # capacity grows in steps of this many positions, as mlx-lm's caches do


class RowsKVCache:
    """One layer's keys and values for B rows (see the module docstring)."""

    def __init__(self, lens: Sequence[int] = (), keys=None, values=None):
        self.lens = [int(n) for n in lens]
        self.keys, self.values = keys, values  # (B, heads, capacity, head_dim) or None

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
        return self.keys[..., :top, :], self.values[..., :top, :]

    def aligned(self) -> bool:
        """Whether every row holds as many tokens (then a pass is a solo pass's shape)."""
        return all(n == self.lens[0] for n in self.lens)

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        """(B, 1, N, max(lens) + N) booleans: query t of row i sees keys j <= lens[i] + t;
        with every row at one length, what mlx-lm's KVCache gives (None for one token, else
        "causal"), so a batch of one computes exactly what a solo pass does."""
        if self.aligned() and not return_array:
            return None if N == 1 else "causal"
        start = self._positions()[:, None, None, None]  # (B, 1, 1, 1)
        keys = mx.arange(max(self.lens) + N)[None, None, None]  # (1, 1, 1, S)
        queries = mx.arange(N)[None, None, :, None]  # (1, 1, N, 1)
        return keys <= start + queries

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

    def join(self, cache: KVCache) -> None:
        """Add a sequence (an mlx-lm KVCache of one row, prefilled alone) as the last row."""
        if cache.keys is None or cache.offset == 0:
            if self.keys is not None:  # an empty row
                self.keys = mx.concatenate([self.keys, mx.zeros_like(self.keys[:1])])
                self.values = mx.concatenate([self.values, mx.zeros_like(self.values[:1])])
            self.lens = [*self.lens, 0]
            return
        n = cache.offset
        k, v = cache.keys[..., :n, :], cache.values[..., :n, :]  # (1, heads, n, dim)
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

    def leave(self, i: int) -> KVCache:
        """Take row i out; its keys and values as a one-row KVCache (for a prompt cache)."""
        n = self.lens[i]
        self.lens = self.lens[:i] + self.lens[i + 1 :]
        out = KVCache()
        if self.keys is not None and n > 0:
            out.keys = mx.contiguous(self.keys[i : i + 1, :, :n])
            out.values = mx.contiguous(self.values[i : i + 1, :, :n])
            out.offset = n
        keep = [j for j in range(len(self.lens) + 1) if j != i]
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


def batchable(model) -> str | None:
    """Why ``model`` cannot decode in a batch (None: it can): every layer's cache must be a
    full attention cache. A sliding window, recurrent state or a quantized cache is not
    batched: its rows would need their own ring, state or scales rolled back one by one."""
    kinds = {type(c).__name__ for c in layer_caches(make_caches(model))}
    other = sorted(kinds - {"KVCache"})
    return f"its layers keep {', '.join(other)}, not only full attention" if other else None


def rows_of(caches: list[RowsKVCache] | None, solo: list, width: int | None = None) -> list:
    """``caches`` (None: a batch of none yet, one RowsKVCache per layer) with a sequence's
    one-row KVCaches added as the last row, layer by layer."""
    caches = caches if caches is not None else [RowsKVCache() for _ in solo]
    for c, s in zip(caches, solo, strict=True):
        c.join(s)
    return caches


def solo_of(caches: list[RowsKVCache], i: int) -> list[KVCache]:
    """Row i taken out of every layer, as one-row KVCaches."""
    return [c.leave(i) for c in caches]
