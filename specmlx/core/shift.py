"""Cached chunks moved to new positions: llama-server's ``--cache-reuse``, on mlx-lm's caches.

An editor's next prompt holds runs of tokens the cache already holds at other positions: the
window around the cursor slid, the ring of other files dropped its first chunk. ``chunks``
finds them as llama-server does (after the common prefix, runs of at least N tokens that
come in the same order, the cache's tokens between them deleted; here a run may also start
a few prompt tokens after the last one ended), and ``Shifter.move`` builds the caches
holding the new prompt's start from them (from one cached sequence or several) without a
prefill, but for the few tokens between runs (``Shifter.fill``).

Moving a key is one more rotation. Attention layers keep keys already rotated by RoPE at
their positions, and rotations compose: a key at p rotated by d is the key at p + d. So each
run's keys are rotated by (new - old) with the layer's own rope module; values carry no
position. What a layer's keys need is found once per model by a probe (``Shifter``): four
tokens run at two offsets through caches that see only that pass, whose keys must differ by
exactly that rotation (or not at all: a layer without RoPE), with equal values. A model that
fails it is refused by name: recurrent state (a sum over the whole sequence, which no
rotation moves), keys with a learned absolute position, MLA's latent caches, a rope module
whose rotation does not compose.

The rotation is exact; the context is not. A moved token's keys and values past the first
layer were computed attending to what came before it in the *old* sequence, deleted tokens
included, so a moved cache is not what a fresh prefill of the new prompt makes, and text
generated from it can differ. llama-server makes the same trade; specmlx's server does it
only when asked (``specmlx serve --cache-reuse N``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache
from mlx_lm.models.rope_utils import DynamicNTKScalingRoPE, SuScaledRoPE, YarnRoPE

from .caches import WindowKVCache, layer_caches, make_caches

__all__ = ["Piece", "Shifter", "Unshiftable", "chunks", "reused"]

# (where a run starts in the cached tokens, where it goes in the new prompt, its length)
Piece = tuple[int, int, int]
Rotate = Callable[[mx.array, int], mx.array]  # (keys (B, H, L, D), by how many positions)

# the probe: these ids run at each offset; the keys' difference is one rotation by 11 - 3
_PROBE_IDS = (1, 2, 3, 4)
_PROBE_AT = (11, 3)


class Unshiftable(Exception):
    """These caches cannot be moved exactly; the message says which layer and why."""


def chunks(
    held: Sequence[int],
    context: Sequence[int],
    start: int,
    least: int,
    at: int | None = None,
    gap: int = 0,
) -> list[Piece]:
    """The runs of ``held`` (cached tokens) that ``context`` (the new prompt less its last
    token) takes, as llama-server's --cache-reuse scans for them: the common prefix
    (``start`` tokens, moved nowhere), then from there each run of at least ``least`` tokens
    the cache holds further on, in order, the cached tokens before it skipped. llama-server
    stops at the first new-prompt token no run starts with (an insertion ends it); with
    ``gap`` a run may start up to that many prompt tokens later, the tokens between left to
    be prefilled in place (a few lines typed, or a token that a cut tokenized otherwise: a
    window's first line without the newline before it). With ``at``: the runs that continue
    context from ``at`` on, found anywhere in ``held`` (another cached sequence than the one
    the start came from), with no common prefix. The pieces reach context[:reused]."""
    pieces = [(0, 0, start)] if start and at is None else []
    h, c = _Tokens(held), _Tokens(context)
    at_h, at_c = (start, start) if at is None else (0, at)
    while least > 0 and at_h < len(h.ids):
        found = None
        for d in range(at_c, min(at_c + gap, len(c.ids) - least) + 1):
            found = _run(h, c, at_h, d, least)
            if found is not None:
                break
        if found is None:
            break
        s, d, n = found
        pieces.append(found)
        at_h, at_c = s + n, d + n
    return pieces


class _Tokens:
    """A token sequence as an array and as bytes (4 a token), for C-speed search: an
    editor's prompt cache scans thousands of tokens of every entry at each request."""

    def __init__(self, ids: Sequence[int]):
        self.ids = np.asarray(ids, dtype="<i4")
        self.bytes = self.ids.tobytes()


def _run(h: _Tokens, c: _Tokens, at_h: int, d: int, least: int) -> Piece | None:
    """The first run of at least ``least`` tokens in h from at_h on that context c has
    from d on, as (where in h, d, its length), or None."""
    if len(c.ids) - d < least:
        return None
    needle = c.bytes[4 * d : 4 * (d + least)]
    at = h.bytes.find(needle, 4 * at_h)
    while at != -1 and at % 4:  # a match across token boundaries: look on
        at = h.bytes.find(needle, at + 1)
    if at == -1:
        return None
    s = at // 4
    span = min(len(h.ids) - s, len(c.ids) - d)
    same = h.ids[s : s + span] == c.ids[d : d + span]
    # Python ints: a piece's numbers become cache offsets (numpy's int64 is refused by
    # mx.array, so a moved cache would break the next tree pass)
    return s, d, int(span if same.all() else np.argmin(same))


def reused(pieces: Sequence[Piece]) -> int:
    """How far into the prompt the pieces reach: context[:reused] (the gaps between them,
    if any, prefilled in place)."""
    return pieces[-1][1] + pieces[-1][2] if pieces else 0


class _Probe(KVCache):
    """A layer cache that holds only the pass it is given, at a set position: the pass sees
    no earlier keys, so two probes at different offsets make the same keys but for RoPE."""

    def __init__(self, offset: int):
        super().__init__()
        self.offset = offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys, self.values = keys, values
        self.offset += keys.shape[2]
        return keys, values

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        return self.keys, self.values

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        if return_array or (window_size is not None and N > window_size):
            return create_causal_mask(N, 0, window_size=window_size)
        return "causal" if N > 1 else None


def _attention(layer: nn.Module) -> nn.Module | None:
    for name in ("self_attn", "attention", "attn", "self_attention", "mixer"):
        found = getattr(layer, name, None)
        if isinstance(found, nn.Module):
            return found
    return None


def _rotation(rope) -> Rotate | None:
    """Rotating keys by d positions with a layer's rope module, each key alone (a length-1
    sequence, so every one turns by d and not d + its index). YaRN and LongRoPE scale their
    input before rotating (mscale): cached keys carry it once already, so only their
    rotation is applied."""
    if rope is None or not callable(rope):
        return None
    if isinstance(rope, (YarnRoPE, SuScaledRoPE)):
        dims = rope.dims if isinstance(rope, YarnRoPE) else rope.dim
        traditional = getattr(rope, "traditional", False)
        freqs = rope._freqs

        def turn(k: mx.array, d: int) -> mx.array:
            one = mx.fast.rope(
                k[..., None, :], dims, traditional=traditional, base=None, scale=1.0,
                offset=d, freqs=freqs,
            )  # fmt: skip
            return one[..., 0, :]

        return turn
    return lambda k, d: rope(k[..., None, :], offset=d)[..., 0, :]


def _apart(a: mx.array, b: mx.array) -> float:
    """How far a is from b, relative to b's largest entry."""
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return mx.max(mx.abs(a - b)).item() / (mx.max(mx.abs(b)).item() + 1e-6)


class Shifter:
    """How one model's cached keys move: per layer a rotation (the layer's rope), None (no
    position in its keys, or no cache), found by the probe when made. ``refused`` says why
    its caches cannot be moved at all (then ``move`` raises)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.name = type(model).__module__.rsplit(".", 1)[-1]
        self.turns: list[Rotate | None] = []
        self.limit: int | None = None  # the longest cache the rotations hold for
        self.refused: str | None = None
        try:
            self.turns = self._probe(model)
        except Unshiftable as e:
            self.refused = str(e)
        except Exception as e:  # a family the probe cannot drive: refused with what it said
            self.refused = f"its layers could not be probed ({type(e).__name__}: {e})"

    def _probe(self, model: nn.Module) -> list[Rotate | None]:
        made = make_caches(model)
        layers = list(getattr(model, "layers", None) or [])
        if len(layers) != len(made):
            raise Unshiftable(
                f"{self.name}: its {len(made)} caches do not map one to one onto its "
                f"{len(layers)} layers"
            )
        for i, c in enumerate(made):
            kinds = c.caches if isinstance(c, CacheList) else [c]
            for x in kinds:
                if isinstance(x, ArraysCache):
                    raise Unshiftable(
                        f"{self.name}: layer {i} holds recurrent state ({type(x).__name__}), "
                        "a sum over the whole sequence that no rotation moves"
                    )
                if x is not None and type(x) not in (KVCache, WindowKVCache):
                    raise Unshiftable(
                        f"{self.name}: layer {i}'s {type(x).__name__} cannot be moved"
                    )
        runs = []
        for at in _PROBE_AT:
            probes = [None if c is None else _Probe(at) for c in made]
            model(mx.array([_PROBE_IDS], dtype=mx.uint32), cache=probes)
            mx.eval([(p.keys, p.values) for p in probes if p is not None and p.keys is not None])
            runs.append(probes)
        d = _PROBE_AT[1] - _PROBE_AT[0]
        turns: list[Rotate | None] = []
        for i, (a, b) in enumerate(zip(*runs, strict=True)):
            if a is None or a.keys is None:  # no cache, or one this layer never wrote
                turns.append(None)
                continue
            # the same keys but for rounding (layers before differ in it only), as float32
            # or as a half type computes them
            tol = 1e-4 if a.keys.dtype == mx.float32 else 3e-2
            if _apart(a.values, b.values) > tol:
                raise Unshiftable(
                    f"{self.name}: layer {i} caches values that depend on the position "
                    "(a latent or absolute-position layout)"
                )
            rope = getattr(_attention(layers[i]), "rope", None)
            turn = _rotation(rope)
            plain = _apart(a.keys, b.keys)
            turned = _apart(turn(a.keys, d), b.keys) if turn is not None else plain
            if turn is not None and turned <= tol and turned < plain:
                if isinstance(rope, DynamicNTKScalingRoPE):  # another base past this length
                    cap = rope.max_position_embeddings
                    self.limit = cap if self.limit is None else min(self.limit, cap)
                turns.append(turn)
            elif plain <= tol:
                turns.append(None)  # its keys carry no position (no RoPE in this layer)
            else:
                what = type(rope).__name__ if rope is not None else "no rope module found"
                raise Unshiftable(
                    f"{self.name}: layer {i}'s keys depend on the position, and rotating "
                    f"them with its rope ({what}) does not give the keys made there"
                )
        return turns

    def move(self, runs: Sequence[tuple[Sequence, Piece]], held: int) -> list:
        """New layer caches holding the new prompt's first tokens, made from runs (a source's
        layer caches, a piece of it: chunks' pieces, in the new prompt's order, from one
        cached sequence or several); their caches are never changed. Each run's keys are
        rotated by (new - old) positions, its values copied. A window layer keeps the last
        of them it needs. ``held``: the longest source's length. Raises Unshiftable where a
        window no longer holds them, or where the model cannot move its caches at all."""
        if self.refused:
            raise Unshiftable(self.refused)
        if self.limit is not None and held > self.limit:
            raise Unshiftable(
                f"{self.name}: DynamicNTKScalingRoPE rotates by another base past "
                f"{self.limit} tokens"
            )
        runs = [(caches, _checked(piece)) for caches, piece in runs if piece[2]]
        if not runs:
            raise Unshiftable("no tokens to move")
        total = 0
        for _, (_, d, n) in runs:
            if d != total:
                raise ValueError("runs must follow one another: fill the gaps first")
            total += n
        out = []
        for layer, turn in enumerate(self.turns):
            here = [(caches[layer], piece) for caches, piece in runs]
            first = runs[0][0][layer]
            kind = type(first)
            if any(type(c) is not kind for c, _ in here):
                raise Unshiftable(f"{self.name}: layer {layer}'s caches are of mixed kinds")
            if first is None:
                out.append(None)
            elif kind is WindowKVCache:
                out.append(_window(here, total, turn))
            elif kind is KVCache:
                out.append(_full(here, total, turn))
            else:
                raise Unshiftable(f"{self.name}: a {kind.__name__} cannot be moved")
        return out

    def fill(self, cache: list, tokens: Sequence[int]) -> None:
        """Run ``tokens`` through the model at the end of ``cache`` (a gap between moved
        runs, prefilled in place), evaluated."""
        self.model(mx.array([list(tokens)], dtype=mx.uint32), cache=cache)
        mx.eval([c.state for c in layer_caches(cache)])


def _checked(piece: Piece) -> Piece:
    """``piece`` as it may enter a cache: three Python ints (an offset that is a numpy
    integer is carried into every later pass, and mx.array refuses it there)."""
    if any(type(x) is not int for x in piece):
        raise TypeError(f"a piece's offsets must be Python ints, got {piece!r}")
    return piece


def _take(keys, values, lo: int, n: int, by: int, turn: Rotate | None):
    """n positions of keys/values from buffer row lo, the keys turned ``by`` positions."""
    k = keys[..., lo : lo + n, :]
    if by and turn is not None:
        k = turn(k, by).astype(keys.dtype)
    return k, values[..., lo : lo + n, :]


def _full(runs: Sequence[tuple[KVCache, Piece]], total: int, turn: Rotate | None) -> KVCache:
    out = KVCache()
    if total == 0:
        return out
    if any(c.keys is None or s + n > c.offset for c, (s, _, n) in runs):
        raise Unshiftable("a cache holds fewer tokens than its run")
    parts = [_take(c.keys, c.values, s, n, d - s, turn) for c, (s, d, n) in runs]
    out.keys = mx.concatenate([k for k, _ in parts], axis=2)
    out.values = mx.concatenate([v for _, v in parts], axis=2)
    out.offset = total
    return out


def _window(runs, total: int, turn: Rotate | None) -> WindowKVCache:
    """The window's share of the moved tokens: the last window - 1 (+ slack, where held)
    positions of the new prompt, taken from where each run's window still holds them."""
    window, slack = runs[0][0].window, runs[0][0].slack
    out = WindowKVCache(window, slack)
    need = min(total, window - 1)  # what the next query at ``total`` may see
    want = min(total, window - 1 + slack)
    parts, got = [], 0
    for c, (s, d, n) in reversed(runs):
        # the run's new positions within [total - want, total), latest first
        lo = max(d, total - want)
        if lo >= d + n:
            break
        old_lo, old_hi = s + (lo - d), s + n
        first = max(old_lo, c.start)  # what this window still holds of them
        if first >= old_hi or old_hi > c.offset:
            break
        parts.append(_take(c.keys, c.values, first - c.start, old_hi - first, d - s, turn))
        got += old_hi - first
        if first > old_lo:
            break  # the window dropped what comes before: the held run ends here
    if got < need:
        raise Unshiftable(
            f"a sliding window of {window} no longer holds the {need} keys the moved "
            f"prompt's next token sees"
        )
    if got:
        parts.reverse()
        out.keys = mx.concatenate([k for k, _ in parts], axis=2)
        out.values = mx.concatenate([v for _, v in parts], axis=2)
    out.offset, out.start = total, total - got
    return out
