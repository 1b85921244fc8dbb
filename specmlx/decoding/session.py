"""One place builds a generation: a loaded pair and one request's settings -> a running
generation. Here, and nowhere else: which drafter runs, the k chooser (adaptive state from
the store, the target's pass-cost curve probed across ranks, the ranks' shared k), the EOS ids,
the lookup memory, the lockstep check and the text stream. The CLI, the server's worker and
the bench call it; none of them assembles a generation itself.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import mlx.nn as nn

from ..core.acceptance import DEFAULT_VERIFY
from ..core.sampling import SamplingParams
from ..core.stats import KChooser, Stats, TokenEvent
from ..distributed.ranks import Lockstep, SharedK, World, shared_probe
from ..drafting.choosing.adaptive import AdaptiveK
from ..drafting.choosing.choosers import AUTO, ChooserStore, K, for_drafter, make_chooser
from ..drafting.choosing.tree_size import AUTO as TREE_AUTO
from ..drafting.choosing.tree_size import OFF as TREE_OFF
from ..drafting.choosing.tree_size import TreeSize
from ..drafting.lookup.kinds import SUFFIX, LookupKind
from ..drafting.lookup.memory import LookupMemory
from ..errors import BadInput, parsed
from .decode import Decode, Parts
from .engine import KVState, generate_tokens, prefill
from .stream import editor_limits, stream_text


@dataclass(frozen=True)
class Pair:
    """What generations run on.

    target, draft: mlx-lm models (draft None: none loaded); tokenizer: the target's (None:
    no EOS ids and no text, as the bench's token runs want); target_id, draft_id: their full
    identities (the adaptive state's key); shared: ids the draft may propose (None: the
    smaller logit width)."""

    target: nn.Module
    draft: nn.Module | None = None
    tokenizer: object | None = None
    target_id: str = ""
    draft_id: str = ""
    shared: int | None = None

    @classmethod
    def of(cls, target, draft, shared: int | None) -> Pair:
        """From loading.Loaded models (draft None: none) and their shared id count."""
        return cls(
            target.model,
            draft.model if draft is not None else None,
            target.tokenizer,
            target.identity,
            draft.identity if draft is not None else "",
            shared if draft is not None else None,
        )


@dataclass(frozen=True)
class DrafterChoice:
    """What drafts a request's tokens: the pair's draft (``model``: a draft model or a head;
    a pair without one drafts nothing) and prompt lookup (``lookup``: how; None: none), the
    lookup first or by value with auto k; neither: the target alone. Parsed once, where it
    is named (``of``: the HTTP body's and a server's "draft")."""

    model: bool = True
    lookup: LookupKind | None = None

    @classmethod
    def of(cls, text: str, lookup: LookupKind = SUFFIX) -> DrafterChoice:
        """Parse "model", "lookup", "model+lookup" or "none" (the API's names; ``lookup``:
        how lookup proposes where it is named); BadInput for anything else."""
        if text not in NAMES:
            raise BadInput(f"drafter must be one of {', '.join(NAMES)}, got {text!r}")
        model, look = NAMES[text]
        return cls(model, lookup if look else None)

    def without_model(self) -> DrafterChoice:
        """This choice with the pair's draft dropped (a pair with none)."""
        return replace(self, model=False)

    def __str__(self) -> str:
        return {v: n for n, v in NAMES.items()}[self.model, self.lookup is not None]


# the API's names for what drafts: (the pair's draft, prompt lookup)
NAMES = {"model": (True, False), "lookup": (False, True), "model+lookup": (True, True),
         "none": (False, False)}  # fmt: skip
MODEL = DrafterChoice()


@dataclass
class Request:
    """One generation's settings, at the text level: what the CLI, the server and the bench
    ask a session for, and what rank 0 hands the other ranks (distributed/wire.py packs every
    field).

    prompt_ids: the prompt's tokens; sampling: temperature and filters; k: drafts per round
    (a choosers.K); max_tokens: the budget; seed:
    None for random; stop: stop strings (text only); drafter: what drafts (a DrafterChoice:
    the pair's draft, prompt lookup and how);
    extra_eos: ids that end generation besides the tokenizer's (e.g. end of infill); verify:
    "block" or "token"; draft_stop: per-token stopping (auto k with a draft model); tree:
    token trees (a tree_size.TreeSize);
    time_limit_s, min_indent: an editor's limits on the text (stream.editor_limits:
    llama.cpp's t_max_predict_ms and n_indent; None: none); warm_up: put the prompt into the
    caches and generate nothing (llama.vim's n_predict 0: ``Generation.prefill``);
    cache_prompt: start from what a server's prompt cache holds (llama-server's
    ``cache_prompt``; False: a fresh prefill, the caches it leaves still kept)."""

    prompt_ids: list[int] = field(default_factory=list)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    k: K = AUTO
    max_tokens: int = 256
    seed: int | None = None
    stop: Sequence[str] = ()
    drafter: DrafterChoice = MODEL
    extra_eos: tuple[int, ...] = ()
    verify: str = DEFAULT_VERIFY
    draft_stop: bool = False
    tree: TreeSize = TREE_AUTO
    time_limit_s: float | None = None
    min_indent: int | None = None
    warm_up: bool = False
    cache_prompt: bool = True

    def __post_init__(self) -> None:
        parsed(self.k, K, "k"), parsed(self.tree, TreeSize, "tree")  # (parsed at the edge;
        parsed(self.drafter, DrafterChoice, "drafter")  # the rest is checked where the
        # engine's Decode is made)

    @property
    def uses_draft(self) -> bool:
        """The pair's draft drafts (when the pair has one)."""
        return self.drafter.model

    @property
    def uses_lookup(self) -> bool:
        """Prompt lookup drafts (first, beside a draft)."""
        return self.drafter.lookup is not None

    def without_draft(self) -> Request:
        """This request with the pair's draft dropped from its drafter (a pair with none)."""
        return replace(self, drafter=self.drafter.without_model()) if self.uses_draft else self


class Session:
    """A pair and what outlives one generation.

    pair: the models; choosers: the adaptive-k store ("auto" requests resume from it and are
    saved back on rank 0; None: a fresh chooser per generation); memory: the lookup memory
    lookup requests search and extend (never with ranks: each rank's store could differ,
    and every rank must propose the same tokens); world: the ranks the target is split over
    (every rank builds the same generations, in the same order)."""

    def __init__(
        self,
        pair: Pair,
        *,
        choosers: ChooserStore | None = None,
        memory: LookupMemory | None = None,
        world: World | None = None,
    ):
        self.pair, self.choosers, self.memory = pair, choosers, memory
        self.world = world or World(None)

    def decode(self, req: Request) -> Decode:
        """What the engine (or a batch's row) is asked for under ``req``: its settings, k
        (0 when nothing drafts) and every id that ends it (the tokenizer's EOS too).

        req: the request's settings."""
        drafting = (req.uses_draft and self.pair.draft is not None) or req.uses_lookup
        eos = set(req.extra_eos)
        if self.pair.tokenizer is not None:
            eos |= set(getattr(self.pair.tokenizer, "eos_token_ids", ()) or ())
        return Decode(
            sampling=req.sampling,
            k=req.k if drafting else K(0),
            max_tokens=req.max_tokens,
            seed=req.seed,
            eos_ids=tuple(sorted(eos)),
            lookup=req.drafter.lookup,
            verify=req.verify,
            draft_stop=req.draft_stop,
            tree=req.tree if drafting else TREE_OFF,
        )

    def adaptive(self, req: Request) -> AdaptiveK:
        """The store's adaptive k chooser for ``req``'s pair, drafter and sampler (its saved
        estimates, or fresh ones from the target's pass-cost probe, taken once and shared by
        the ranks); ``finish`` saves what it learns. The store must be set.

        req: the request (its prompt is what a probe runs on)."""
        pair, world, store = self.pair, self.world, self.choosers
        draft = pair.draft if req.uses_draft else None
        if world.distributed and store.pass_ratio is None:  # one curve for all ranks
            ids = list(req.prompt_ids)
            store.pass_ratio = shared_probe(world, store, pair.target, pair.target_id, ids)
        lookup = req.drafter.lookup  # (suffix lookup keyed as True, as saved before)
        look = lookup is not None and (True if lookup.is_suffix else lookup.key)
        drafter = f"{pair.draft_id if draft is not None else 'none'}|lookup={look}"
        return store.get(
            pair.target, pair.target_id, drafter, req.sampling, list(req.prompt_ids),
            verify=req.verify, tokens=req.max_tokens,
        )  # fmt: skip

    def finish(self, chooser: AdaptiveK, stats: Stats, origin: str) -> None:
        """Save what ``chooser`` (``adaptive``'s) learned (rank 0 only), and say in
        ``stats.auto`` what auto decided from (``origin``: ChooserStore.origin's, read
        before the chooser ran) and where it stood."""
        stats.auto = {"from": origin, **chooser.summary()}
        if self.world.leader:
            self.choosers.save(chooser)

    def start(
        self,
        req: Request,
        *,
        kv: KVState | None = None,
        stats: Stats | None = None,
        lockstep: Lockstep | None = None,
        chooser: KChooser | None = None,
    ) -> Generation:
        """A generation of ``req.prompt_ids`` under ``req``, not yet running: iterate its
        ``tokens()`` or ``text()``. kv: caches to reuse (a prompt cache); stats: filled live
        (a fresh one if None); lockstep: the ranks' per-round check (default: a plain one
        when distributed); chooser: the k chooser to use as it is, in place of the store's
        or a fresh one for ``req.k`` (the bench keeps its own per system: an AdaptiveK for
        auto, a FixedK holding its measured curve for a fixed k's auto trees)."""
        pair, world, ids = self.pair, self.world, list(req.prompt_ids)
        draft = pair.draft if req.uses_draft else None
        k = req.k if (draft is not None or req.uses_lookup) else K(0)
        saved, chooser = None, chooser if k.auto or k.fixed else None  # (k 0: nothing drafts)
        if chooser is None and k.auto and self.choosers is not None:
            chooser = saved = self.adaptive(req)
        elif chooser is None:
            # a fixed k's greedy auto trees are sized by the target's probe once one has run
            # (auto's), as a server's batch sizes them; it runs none itself. Not a sampled
            # row's (the guess: trees.SideSizer.plan_rows), nor over ranks: every rank must
            # plan the same tree, and SharedK guesses the curve there.
            greedy = req.sampling.greedy and not world.distributed
            trees = k.fixed > 0 and req.tree.auto and greedy and self.choosers is not None
            chooser = make_chooser(k, self.choosers.known_curve(pair.target_id) if trees else None)
        chooser = for_drafter(chooser, draft)
        if world.distributed and lockstep is None:
            lockstep = Lockstep(world)
        if world.distributed and k.auto:
            # rank 0 decides k for all (each rank's timings differ); the lockstep hash
            # travels in the same collective
            chooser = SharedK(chooser, world, lockstep)
        decode = self.decode(req)
        parts = Parts(
            kv=kv,
            stats=stats if stats is not None else Stats(),
            chooser=chooser,
            lookup_memory=self.memory if req.uses_lookup and not world.distributed else None,
            lockstep=lockstep,
            vocab_size=pair.shared if draft is not None else None,
        )
        return Generation(self, ids, draft, req, decode, parts, saved)


class Generation:
    """One generation, built by Session.start. Iterate ``tokens()`` (token events) or
    ``text()`` (events carrying text, stop strings applied), once; then ``finish()`` saves
    what the adaptive chooser learned. ``stats`` is filled live; ``lockstep`` is the ranks'
    check (None when not distributed)."""

    def __init__(self, session, ids, draft, req, decode: Decode, parts: Parts, saved):
        self.session, self.ids, self.draft, self.req = session, ids, draft, req
        self._decode, self.parts, self._saved = decode, parts, saved
        store = session.choosers
        self._origin = store.origin(saved) if saved is not None and store is not None else ""
        self.stats, self.lockstep = parts.stats, parts.lockstep

    def tokens(self) -> Iterator[TokenEvent]:
        """The engine's token events (from_draft: the drafter proposed the token)."""
        pair = self.session.pair
        return generate_tokens(pair.target, self.draft, self.ids, self.decode(), self.parts)

    def decode(self) -> Decode:
        """What the engine is asked for (request.Decode): a batch runs the same settings."""
        return self._decode

    def text(self) -> Iterator[TokenEvent]:
        """Token events with the text each completed (UTF-8 safe), ending at a stop string;
        closing it early closes the engine's generator (its KVState stays exact)."""
        tokenizer = self.session.pair.tokenizer
        text = stream_text(tokenizer, self.tokens(), self.req.stop, self.stats)
        if self.req.time_limit_s is None and not self.req.min_indent:
            return text
        return editor_limits(text, self.req.time_limit_s, self.req.min_indent, self.stats)

    def prefill(self) -> None:
        """Put the prompt into the caches and generate nothing (an editor's warm-up)."""
        pair = self.session.pair
        prefill(pair.target, self.draft, self.ids, kv=self.parts.kv, stats=self.stats)

    def finish(self) -> None:
        """Save the adaptive chooser's estimates (rank 0, choosers from the store only), and
        say in ``stats.auto`` what auto decided from (``from``) and where it stood."""
        if self._saved is not None:
            self.session.finish(self._saved, self.stats, self._origin)
