"""What a generation is asked for (``Decode``, validated once, where it is made) and what it
borrows from its caller (``Parts``): the two arguments of engine.generate_tokens besides the
models and the prompt."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..core.acceptance import DEFAULT_VERIFY, sampled_rule
from ..core.kvstate import KVState
from ..core.sampling import SamplingParams
from ..core.stats import KChooser, Stats
from ..drafting.choosing.choosers import K
from ..drafting.choosing.tree_size import OFF, TreeSize
from ..drafting.lookup.kinds import LookupKind
from ..drafting.lookup.memory import LookupMemory
from ..errors import BadInput, parsed


@dataclass(frozen=True)
class Decode:
    """One generation's settings, as the engine reads them.

    sampling: temperature, top-p, top-k, min-p (default greedy); the same processing makes
        the target's p and the draft's q, which is what keeps sampling exact.
    k: the drafts per round (a choosers.K: a fixed count or auto).
    max_tokens: the most tokens to generate (> 0).
    seed: seeds the sampling (None: random).
    eos_ids: ids that end generation and are not emitted.
    stop_ids: token sequences that end generation; they are emitted (stream.py strips text).
    lookup: propose from earlier occurrences in the context first (prompt lookup), and how
        (a kinds.LookupKind: suffix lookup's tree of every occurrence's continuation, by
        frequency and recency, its likeliest path where trees are off; n-gram lookup, the
        most recent occurrence of the longest match; or lookahead decoding, Jacobi guesses
        in the same pass); None: no lookup.
    verify: how a sampled round checks the drafts: "block" (the default: the drafted block
        jointly, Sun et al. 2024: the same distribution, never fewer tokens kept in
        expectation) or "token" (token by token, Leviathan et al.). Greedy is the same under
        both.
    draft_stop: per-token stopping, with an adaptive chooser and a draft model: a round gives
        k > 0 drafts in small chunks (adaptive.DRAFT_CHUNKS: 1, 1, then 2 at a time, a host
        sync each, up to the chooser's k_max) while its cost model says the next draft pays,
        and verifies the best prefix.
    tree: token trees (a tree_size.TreeSize: off, auto, a cap of N nodes, or expand:N): the draft model's chain gets side leaves, suffix lookup proposes its tree of
        continuations, verified in the same pass; N caps the drafted tokens a pass verifies,
        auto sizes each round by the cost model. Auto falls back to chains where the
        target's caches or the drafter cannot take a tree.
    """

    sampling: SamplingParams = field(default_factory=SamplingParams)
    k: K = K(4)
    max_tokens: int = 256
    seed: int | None = None
    eos_ids: tuple[int, ...] = ()
    stop_ids: tuple[tuple[int, ...], ...] = ()
    lookup: LookupKind | None = None
    verify: str = DEFAULT_VERIFY
    draft_stop: bool = False
    tree: TreeSize = OFF

    def __post_init__(self) -> None:
        if not isinstance(self.sampling, SamplingParams):
            raise BadInput(f"sampling must be a SamplingParams, got {type(self.sampling).__name__}")
        if self.max_tokens <= 0:
            raise BadInput(f"max tokens must be > 0, got {self.max_tokens}")
        sampled_rule(self.verify)  # BadInput for an unknown rule
        parsed(self.k, K, "k"), parsed(self.tree, TreeSize, "tree")
        if self.lookup is not None:
            parsed(self.lookup, LookupKind, "lookup")
        # (frozen: the tuples are set once, here)
        object.__setattr__(self, "eos_ids", tuple(int(t) for t in self.eos_ids))
        stops = tuple(tuple(int(t) for t in s) for s in self.stop_ids)
        object.__setattr__(self, "stop_ids", stops)


@dataclass
class Parts:
    """What a generation borrows from its caller (all optional).

    kv: caches to reuse (their longest common prefix with the prompt is kept, the rest of the
        prompt is prefilled) and that hold the context afterwards; fresh ones if None.
    stats: updated live (a fresh one if None).
    chooser: picks k each round (a stats.KChooser, such as one kept across generations by
        choosers.ChooserStore); None: a fresh one for Decode.k (choosers.make_chooser), set
        for the drafter (choosers.for_drafter).
    lookup_memory: with lookup, also propose from these earlier outputs; this generation's
        output is added to it at the end (lookup.LookupMemory; None: the context only).
    lockstep: called with each round's new tokens before they are yielded; it may raise to
        stop (distributed.Lockstep compares the ranks' tokens this way, now or, carried by
        the ranks' shared k, at the next round's start).
    vocab_size: how many ids the draft may propose (default: the smaller logit width).
    prefill_step: prompt tokens per prefill chunk (bounds prefill memory).
    """

    kv: KVState | None = None
    stats: Stats | None = None
    chooser: KChooser | None = None
    lookup_memory: LookupMemory | None = None
    lockstep: Callable[[list[int]], None] | None = None
    vocab_size: int | None = None
    prefill_step: int = 512


def token_ids(ids: Sequence[int]) -> list[int]:
    """A prompt's ids as ints; BadInput when there are none."""
    prompt = [int(t) for t in ids]
    if not prompt:
        raise BadInput("the prompt is empty")
    return prompt
