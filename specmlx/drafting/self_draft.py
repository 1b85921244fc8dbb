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

Not yet: the exit does not share the target's caches for its layers (LayerSkip's exit
cache); it keeps its own, so a draft step costs E/L of a target step and its KV is extra.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from ..errors import BadInput, IncompatiblePair

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
    ``skip`` left out; neither: auto (choose_exit)."""

    exit: int | None = None
    skip: tuple[int, ...] = ()

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
    """A left-out layer: its input back. It answers what a family's forward reads of a
    layer to pick a mask (is_sliding, is_linear, self_attn.sliding_window...) as the layer
    does: the layer's attributes and parts, by reference (not children: no weights)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        for key, value in [*vars(layer).items(), *layer.items()]:
            if not key.startswith("_"):
                self.__dict__[key] = value

    def __call__(self, x, *args, **kwargs):
        return x


class _Mirror:
    """A left-out layer's cache entry: mask questions answered by a run layer's cache."""

    def __init__(self, source):
        self._source = source

    def __getattr__(self, name):
        return getattr(self._source, name)


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
        kinds = [_kind(c) for c in fresh]
        run_kinds = {kinds[i]: i for i in reversed(self.run)}
        # each left-out layer's mirror: the run layer whose cache is of its kind (else the
        # first run layer: no run layer reads a mask of that kind)
        self._mirror = {i: run_kinds.get(kinds[i], self.run[0])
                        for i in range(self.depth) if i not in set(self.run)}  # fmt: skip
        self._skips = {i: _Skip(layers[i]) for i in self._mirror}
        try:  # a family whose layers return more than the hidden states: refused by name
            self(mx.array([[0]], dtype=mx.uint32))  # (a graph built, never evaluated)
        except (ValueError, TypeError, AttributeError, IndexError) as e:
            raise IncompatiblePair(
                f"{_family(target)} cannot leave layers out for self-drafting ({e})"
            ) from None

    @property
    def layers(self) -> list:
        return self.run_layers

    def make_cache(self) -> list:
        """The caches of the layers it runs, as the target makes them."""
        full = _fresh(self._target, layer_list(self._target))
        return [full[i] for i in self.run]

    def __call__(self, inputs: mx.array, cache: Sequence | None = None, **kwargs) -> mx.array:
        layers = layer_list(self._target)
        if cache is None:
            cache = self.make_cache()
        full: list = [None] * self.depth
        for c, i in zip(cache, self.run, strict=True):
            full[i] = c
        for i, j in self._mirror.items():
            full[i] = _Mirror(full[j])
        own = {i: layers[i] for i in self._skips}
        try:
            for i, skip in self._skips.items():
                layers[i] = skip
            return self._target(inputs, cache=full, **kwargs)
        finally:
            for i, layer in own.items():
                layers[i] = layer


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
    """Auto: the exit, among EXIT_FRACTIONS of the depth, whose greedy guesses agree most
    with the target's own over the prompt, weighed by what a draft step costs (E/L of a
    target step): the exit with the most expected tokens per unit of time at k = 4.

    target: the target model; prompt: token ids (its tail, at most 256, is read)."""
    depth = len(layer_list(target))
    tokens = mx.array(list(prompt)[-256:], dtype=mx.uint32)[None]  # (1, T)
    want = mx.argmax(target(tokens), axis=-1)  # (1, T)
    best, score = None, 0.0
    for f in EXIT_FRACTIONS:
        e = max(1, min(depth - 1, round(depth * f)))
        guess = mx.argmax(SelfDraft(target, SelfSpec(exit=e))(tokens), axis=-1)
        a = min((guess == want).astype(mx.float32).mean().item(), 0.99)
        k = 4
        tokens_per_round = (1 - a ** (k + 1)) / (1 - a)
        value = tokens_per_round / (1 + k * e / depth)  # against 1 token per target step
        if value > score:
            best, score = SelfSpec(exit=e), value
    return best if best is not None else SelfSpec(exit=max(1, depth // 4))
