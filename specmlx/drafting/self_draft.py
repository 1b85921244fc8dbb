"""Self-drafting: the target drafts for itself with some of its layers left out.

- ``self:exit=E`` (early exit, LayerSkip): the draft is the target's first E layers, then its
  final norm and LM head. LayerSkip checkpoints are trained so that the shared head reads an
  early layer well; any other model works too, less well.
- ``self:skip=LIST`` (Draft & Verify, SWIFT): the target with those layers skipped.
- ``self`` (auto): an exit chosen from the prompt (``choose_exit``).

The draft is a model like any other draft model (it drafts through row_drafters.ModelRows,
for a lone request or a batch's rows, and rolls back as its caches' kinds do): no second
copy of the weights, its own KV cache for the layers it runs. Each call runs the target's
own forward (its embedding, its masks, its layers' own classes) with the left-out layers of
that one instance given an identity for the length of the call, then their own back: no
class is patched, and the family's code decides masks and positions as it always does. A
left-out layer's cache entry is a stand-in that answers mask questions as a run layer of the
same kind does (every run layer holds the same positions), so a family that builds its
masks from a given layer's cache builds the same ones.

An exit shares the target's caches for its layers in a lone generation (SharedExit,
LayerSkip's exit cache) where those layers keep full attention; in a batch, and below E
layers with windows or recurrent state, it keeps caches of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from ..core.sampling import sample
from ..errors import BadInput, IncompatiblePair
from .drafters import Proposal

SELF = "self"
# auto: the exits it weighs, as fractions of the depth
EXIT_FRACTIONS = (0.25, 0.5, 0.75)
# auto: the passage its agreement is measured on (code and prose, as the users send)
PROBE_TEXT = """def fibonacci(n):
    \"\"\"Return the n-th Fibonacci number.\"\"\"
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def read_config(path):
    with open(path) as f:
        return json.load(f)


The quick brown fox jumps over the lazy dog. A language model predicts the next token from
the ones before it; a smaller model, or the first layers of the same one, can guess several
tokens ahead, and the large model checks all of the guesses in one pass.
"""


@dataclass(frozen=True)
class SelfSpec:
    """What ``--draft self...`` asks for: an exit after ``exit`` layers, or the target with
    ``skip`` left out; neither: auto (choose_exit). ``agreement``: the exit's greedy
    agreement with the target where auto measured it (None: not measured); the k chooser
    starts from it (AdaptiveK.expect)."""

    exit: int | None = None
    skip: tuple[int, ...] = ()
    agreement: float | None = field(default=None, compare=False)

    @property
    def auto(self) -> bool:
        return self.exit is None and not self.skip

    def run(self, depth: int) -> list[int]:
        """The layers the draft runs, of a target ``depth`` layers deep."""
        if self.exit is not None:
            return list(range(self.exit))
        return [i for i in range(depth) if i not in self.skip]

    def name(self) -> str:
        if self.exit is not None:
            return f"{SELF}:exit={self.exit}"
        if self.skip:
            return f"{SELF}:skip={','.join(map(str, self.skip))}"
        return SELF


def is_self(name: str | None) -> bool:
    """Whether a --draft names self-drafting."""
    return name is not None and (name == SELF or name.startswith(SELF + ":"))


def parse_self(name: str, depth: int) -> SelfSpec:
    """``self``, ``self:exit=E`` or ``self:skip=3,5-7`` for a target ``depth`` layers deep;
    BadInput (one line) for an exit at or past the depth or below 1, a skip list naming
    layers the model lacks, or one that skips every layer.

    name: the --draft value; depth: the target's layers."""
    if name == SELF:
        return SelfSpec()
    what, _, value = name[len(SELF) + 1 :].partition("=")
    if what == "exit":
        try:
            e = int(value)
        except ValueError:
            raise BadInput(
                f"--draft {name}: the exit must be a layer count, got {value!r}"
            ) from None
        if not 1 <= e < depth:
            raise BadInput(
                f"--draft {name}: the exit must be 1 to {depth - 1} (the target has {depth} layers)"
            )
        return SelfSpec(exit=e)
    if what == "skip":
        skip = sorted(set(_layers(name, value)))
        bad = [i for i in skip if not 0 <= i < depth]
        if bad:
            raise BadInput(f"--draft {name}: the target has layers 0 to {depth - 1}, not {bad[0]}")
        if len(skip) >= depth:
            raise BadInput(f"--draft {name}: it skips every layer")
        return SelfSpec(skip=tuple(skip))
    raise BadInput(f"--draft {name}: give self, self:exit=E or self:skip=LIST (e.g. 3,5-7)")


def _layers(name: str, value: str) -> list[int]:
    out = []
    for part in value.split(","):
        lo, dash, hi = part.strip().partition("-")
        try:
            out += list(range(int(lo), int(hi) + 1)) if dash else [int(lo)]
        except ValueError:
            raise BadInput(f"--draft {name}: {part!r} is not a layer or a range (3, 5-7)") from None
    if not out:
        raise BadInput(f"--draft {name}: name at least one layer")
    return out


def layer_list(target: nn.Module) -> list:
    """The target's list of decoder layers, the one its forward walks."""
    for owner in (
        getattr(target, "model", None),
        getattr(getattr(target, "language_model", None), "model", None),
        target,
    ):
        layers = getattr(owner, "layers", None) if owner is not None else None
        if isinstance(layers, list) and layers:
            return layers
    raise BadInput(
        f"{type(target).__module__} keeps its layers where self-drafting cannot find them"
    )


class _Skip(nn.Module):
    """A left-out layer: its input back (kept in ``seen`` when given). It answers what a
    family's forward reads of a layer to pick a mask (is_sliding, is_linear,
    self_attn.sliding_window...) as the layer does: the layer's attributes and parts, by
    reference (not children: no weights)."""

    def __init__(self, layer: nn.Module, seen: list | None = None):
        super().__init__()
        for key, value in [*vars(layer).items(), *layer.items()]:
            if not key.startswith("_"):
                self.__dict__[key] = value
        self.__dict__["_seen"] = seen

    def __call__(self, x, *args, **kwargs):
        if self._seen is not None:
            self._seen.append(x)
        return x


class _Inject(nn.Module):
    """A run layer fed ``h`` instead of what reaches it (the hidden states the layers below
    it computed in an earlier pass), with the layer's own attributes."""

    def __init__(self, layer: nn.Module, h: mx.array):
        super().__init__()
        for key, value in [*vars(layer).items(), *layer.items()]:
            if not key.startswith("_"):
                self.__dict__[key] = value
        self.__dict__["_layer"], self.__dict__["_h"] = layer, h

    def __call__(self, x, *args, **kwargs):
        return self._layer(self._h, *args, **kwargs)


class _Mirror:
    """A left-out layer's cache entry: mask questions answered by a run layer's cache."""

    def __init__(self, source):
        self._source = source

    def __getattr__(self, name):
        return getattr(self._source, name)


class Partial:
    """The target's own forward over some of its layers (``run``), the others given an
    identity for the call and a cache entry that mirrors a run layer of the same kind.

    target: the target model; run: the layers to run (sorted); kinds: each layer's cache
    kind (type, window), for the mirrors."""

    def __init__(self, target: nn.Module, run: Sequence[int], kinds: Sequence[tuple]):
        self.target, self.run = target, list(run)
        by_kind = {kinds[i]: i for i in reversed(self.run)}
        # each left-out layer's mirror: the run layer whose cache is of its kind, else an
        # empty cache of its kind (no run layer reads a mask of that kind: any will do)
        layers = layer_list(target)
        fresh = _fresh(target, layers)
        self.mirror = {i: by_kind.get(kinds[i], fresh[i])
                       for i in range(len(kinds)) if i not in set(self.run)}  # fmt: skip
        # the identities, made once (a draft step calls this every token): the first one
        # past the run layers keeps what reaches it in ``seen`` when a call records
        self.seen: list = []
        after = next((i for i in sorted(self.mirror) if i > self.run[-1]), None)
        self.skips = {i: _Skip(layers[i], self.seen if i == after else None)
                      for i in self.mirror}  # fmt: skip

    def __call__(
        self, x: mx.array, cache: list, inject: mx.array | None = None, record: bool = False
    ) -> tuple[mx.array, mx.array | None]:
        """The logits over x (B, L) and, with ``record``, the hidden states that reach the
        first left-out layer past the run ones (B, L, H): an exit's layer-E states.

        cache: one entry per layer (those of left-out layers are not read); inject: hidden
        states (B, L, H) fed to the first run layer instead of the embedded tokens."""
        layers = layer_list(self.target)
        full = list(cache)
        for i, j in self.mirror.items():
            full[i] = _Mirror(cache[j] if isinstance(j, int) else j)
        self.seen.clear()
        swaps = dict(self.skips)
        if inject is not None:
            swaps[self.run[0]] = _Inject(layers[self.run[0]], inject)
        own = {i: layers[i] for i in swaps}
        try:
            for i, layer in swaps.items():
                layers[i] = layer
            logits = self.target(x, cache=full)
        finally:
            for i, layer in own.items():
                layers[i] = layer
        return logits, (self.seen[0] if record and self.seen else None)


class SelfDraft(nn.Module):
    """The target with some layers left out, as a draft model (see the module).

    target: the target model; spec: which layers (an exit or a skip list, not auto)."""

    def __init__(self, target: nn.Module, spec: SelfSpec):
        super().__init__()
        layers = layer_list(target)
        self.__dict__["_target"] = target  # (not a child: the target's own forward runs)
        self.spec, self.depth = spec, len(layers)
        self.run = spec.run(self.depth)
        self.args = getattr(target, "args", None)
        # the layers it runs, by reference (the target's weights, no copy): children, so
        # what reads a model's modules (the recurrent mixers' layout) finds them
        self.run_layers = [layers[i] for i in self.run]
        fresh = _fresh(target, layers)
        if len(fresh) != len(layers):
            raise IncompatiblePair(
                f"self-drafting needs a cache per layer; {_family(target)} shares or leaves "
                f"out some ({len(fresh)} caches for {len(layers)} layers)"
            )
        self.kinds = [_kind(c) for c in fresh]
        self.__dict__["_partial"] = Partial(target, self.run, self.kinds)
        try:  # a family whose layers return more than the hidden states: refused by name
            self(mx.array([[0]], dtype=mx.uint32))  # (a graph built, never evaluated)
        except (ValueError, TypeError, AttributeError, IndexError) as e:
            raise IncompatiblePair(
                f"{_family(target)} cannot leave layers out for self-drafting ({e})"
            ) from None

    @property
    def layers(self) -> list:
        return self.run_layers

    @property
    def agreement(self) -> float | None:
        """Its greedy agreement with the target as auto measured it (None: not measured):
        what the k chooser starts from (choosers.for_drafter)."""
        return self.spec.agreement

    def make_cache(self) -> list:
        """The caches of the layers it runs, as the target makes them."""
        full = _fresh(self._target, layer_list(self._target))
        return [full[i] for i in self.run]

    def __call__(self, inputs: mx.array, cache: Sequence | None = None, **kwargs) -> mx.array:
        if cache is None:
            cache = self.make_cache()
        full: list = [None] * self.depth
        for c, i in zip(cache, self.run, strict=True):
            full[i] = c
        return self._partial(inputs, full)[0]


class SharedExit:
    """The early exit sharing the target's caches for its first E layers (LayerSkip's exit
    cache), for a lone generation: a drafter (drafters.Drafter) and the model the target's
    cursor runs (``verifies``).

    Drafting a token runs the first E layers over the target's own caches and reads the
    exit (the final norm and head over layer E's input); those states wait. The verify pass
    over [last, d1..dk] then runs the first E layers over d_k alone (the drafts before it
    are in those caches already) and the layers from E up over all k + 1, fed the waiting
    states: every layer ends holding the same k + 1 tokens, and the cursor's rollback gives
    back what the round did not keep, in every layer at once. Any other pass (the prompt, a
    plain round, a replay) is the target's own.

    draft: the SelfDraft (an exit); caches: the target's caches (the cursor's); process:
    the sampling processor (None: greedy); vocab: the ids it may propose."""

    needs_k = True

    def __init__(self, draft: SelfDraft, caches: list, process, vocab: int):
        self.target, self.caches = draft._target, caches
        self.process, self.vocab = process, vocab
        e = draft.spec.exit
        self.lower = Partial(self.target, range(e), draft.kinds)
        self.upper = Partial(self.target, range(e, draft.depth), draft.kinds)
        self.waiting: list[mx.array] = []  # layer-E states (1, 1, H) of the tokens drafted

    def verifies(self, x: mx.array, cache: list | None = None, **kwargs) -> mx.array:
        """What the cursor calls for the target: the split verify pass after a proposal,
        the target's own pass otherwise."""
        if not self.waiting:
            return self.target(x, cache=cache, **kwargs)
        k = len(self.waiting)
        if x.shape[1] != k + 1:
            raise RuntimeError(f"a verify pass of {x.shape[1]} tokens after {k} drafts")
        _, h = self.lower(x[:, k:], cache, record=True)  # d_k through the first E layers
        states = mx.concatenate([*self.waiting, h], axis=1)  # (1, k + 1, H)
        self.waiting = []
        return self.upper(x, cache, inject=states)[0]

    def propose(self, ctx, k, room, key):
        if k <= 0:
            return Proposal()
        keys = mx.random.split(key, k) if self.process is not None else None
        x, tokens, qs = mx.array(ctx[-1:], dtype=mx.uint32)[None], [], []
        for j in range(k):
            logits, h = self.lower(x, self.caches, record=True)
            self.waiting.append(h)
            logits = logits[:, -1, : self.vocab]  # (1, vocab)
            if self.process is None:
                t = mx.argmax(logits, axis=-1).astype(mx.uint32)
            else:
                q = self.process(logits)
                t = sample(q, keys[j])
                qs.append(q[0])
            tokens.append(t[0])
            x = t[:, None]
            mx.async_eval(t)
        return Proposal(mx.stack(tokens), mx.stack(qs) if qs else None, "model")

    def settle(self, ctx, right) -> None:
        self.waiting = []  # (the cursor gave back what the round did not keep)

    def close(self) -> None:
        self.waiting = []


# the layer caches an exit may share (as mlx-lm makes them): full attention, and sliding
# windows, which a lone generation keeps as core.caches.WindowKVCache: it gives back up to
# ROLLBACK_SLACK of its newest keys however many passes wrote them, so the draft's one-token
# steps and the verify pass's last token go back together like one pass's. A recurrent
# state cannot: its rollback replays the verify pass it recorded, and the draft's steps
# would be left in it.
_SHAREABLE = ("KVCache", "RotatingKVCache")


def shares_caches(draft) -> bool:
    """Whether ``draft`` is an exit that drafts over the target's own caches for a lone
    generation (SharedExit): its first E layers keep full attention or sliding windows
    (_SHAREABLE; a recurrent state below E keeps caches of its own).

    draft: the draft model (anything: only a SelfDraft's exit shares)."""
    if not isinstance(draft, SelfDraft) or draft.spec.exit is None:
        return False
    return all(kind[0] in _SHAREABLE for kind in draft.kinds[: draft.spec.exit])


def _fresh(target: nn.Module, layers: list) -> list:
    """A fresh cache per layer, as mlx-lm makes the target's."""
    if hasattr(target, "make_cache"):
        return target.make_cache()
    return [KVCache() for _ in layers]


def _family(target: nn.Module) -> str:
    return type(target).__module__.rsplit(".", 1)[-1]


def _kind(cache) -> tuple:
    return type(cache).__name__, getattr(cache, "max_size", None)


def self_draft(target: nn.Module, spec: SelfSpec) -> SelfDraft:
    """The draft for ``spec`` (an exit or a skip list) over ``target``.

    target: the target model; spec: parse_self's (auto resolved by choose_exit first)."""
    if spec.auto:
        raise ValueError("choose the exit first (choose_exit)")
    return SelfDraft(target, spec)


def choose_exit(target: nn.Module, prompt: Sequence[int]) -> SelfSpec:
    """Auto: the exit, among EXIT_FRACTIONS of the depth, with the most expected tokens per
    unit of time: its greedy agreement a with the target's own guesses over ``prompt``, a
    draft step costing E/L of a target step, and the best k (1 to 8) for them: k drafts keep
    (1 - a^(k+1)) / (1 - a) tokens a round at 1 + k·E/L target steps. (Whether any exit pays
    at all is -k auto's to find, round by round.)

    target: the target model; prompt: token ids (its tail, at most 256, is read). The spec
    carries its exit's measured agreement."""
    depth = len(layer_list(target))
    tokens = mx.array(list(prompt)[-256:], dtype=mx.uint32)[None]  # (1, T)
    want = mx.argmax(target(tokens), axis=-1)  # (1, T)
    best, score = None, -1.0
    for f in EXIT_FRACTIONS:
        e = max(1, min(depth - 1, round(depth * f)))
        guess = mx.argmax(SelfDraft(target, SelfSpec(exit=e))(tokens), axis=-1)
        a = min((guess == want).astype(mx.float32).mean().item(), 0.99)
        value = max((1 - a ** (k + 1)) / (1 - a) / (1 + k * e / depth) for k in range(1, 9))
        if value > score:
            best, score = SelfSpec(exit=e, agreement=a), value
    return best
