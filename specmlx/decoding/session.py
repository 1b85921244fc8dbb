"""One place builds a generation: a loaded pair and one request's settings -> a running
generation. Here, and nowhere else: which drafter runs, the k chooser (adaptive state from
the store, the target's pass-cost curve probed across ranks, the ranks' shared k), the EOS ids,
the lookup memory, the lockstep check and the text stream. The CLI, the server's worker and
the bench call it; none of them assembles a generation itself.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import mlx.nn as nn

from ..core.acceptance import DEFAULT_VERIFY
from ..core.sampling import SamplingParams
from ..core.stats import Stats, TokenEvent
from ..distributed.ranks import Lockstep, SharedK, World, shared_probe
from ..drafting.choosers import ChooserStore, KSetting, make_chooser
from ..drafting.lookup import LookupMemory
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


@dataclass
class Request:
    """One generation's settings.

    sampling: temperature and filters; num_draft: k (an int, "auto" or a KChooser to use as
    it is); max_tokens: the budget; seed: None for random; stop: stop strings (text only);
    use_draft: speculate with the pair's draft model; lookup: prompt lookup (first, when
    both); extra_eos: ids that end generation besides the tokenizer's (e.g. end of infill);
    verify: "block" or "token"; draft_stop: per-token stopping (auto k with a draft);
    time_limit_s, min_indent: an editor's limits on the text (stream.editor_limits:
    llama.cpp's t_max_predict_ms and n_indent; None: none)."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    num_draft: KSetting = "auto"
    max_tokens: int = 256
    seed: int | None = None
    stop: Sequence[str] = ()
    use_draft: bool = True
    lookup: bool = False
    extra_eos: tuple[int, ...] = ()
    verify: str = DEFAULT_VERIFY
    draft_stop: bool = False
    time_limit_s: float | None = None
    min_indent: int | None = None


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

    def start(
        self,
        prompt_ids: Sequence[int],
        req: Request,
        *,
        kv: KVState | None = None,
        stats: Stats | None = None,
        lockstep: Lockstep | None = None,
    ) -> Generation:
        """A generation of ``prompt_ids`` under ``req``, not yet running: iterate its
        ``tokens()`` or ``text()``. kv: caches to reuse (a prompt cache); stats: filled live
        (a fresh one if None); lockstep: the ranks' per-round check (default: a plain one
        when distributed)."""
        pair, world, ids = self.pair, self.world, list(prompt_ids)
        draft = pair.draft if req.use_draft else None
        num_draft: KSetting = req.num_draft if (draft is not None or req.lookup) else 0
        saved = None
        if num_draft == "auto" and self.choosers is not None:
            store = self.choosers
            if world.distributed and store.pass_ratio is None:  # one curve for all ranks
                store.pass_ratio = shared_probe(world, store, pair.target, pair.target_id, ids)
            drafter = f"{pair.draft_id if draft is not None else 'none'}|lookup={req.lookup}"
            num_draft = saved = store.get(
                pair.target, pair.target_id, drafter, req.sampling, ids, verify=req.verify
            )
        if world.distributed and lockstep is None:
            lockstep = Lockstep(world)
        if world.distributed and not isinstance(num_draft, int):
            # rank 0 decides k for all (each rank's timings differ); the lockstep hash
            # travels in the same collective
            num_draft = SharedK(make_chooser(num_draft), world, lockstep)
        eos = set(req.extra_eos)
        if pair.tokenizer is not None:
            eos |= set(getattr(pair.tokenizer, "eos_token_ids", ()) or ())
        memory = self.memory if req.lookup and not world.distributed else None
        engine_kwargs = dict(
            sampling=req.sampling,
            num_draft=num_draft,
            lookup=req.lookup,
            lookup_memory=memory,
            vocab_size=pair.shared if draft is not None else None,
            max_tokens=req.max_tokens,
            seed=req.seed,
            eos_ids=sorted(eos),
            kv=kv,
            lockstep=lockstep,
            verify=req.verify,
            draft_stop=req.draft_stop,
        )
        stats = stats if stats is not None else Stats()
        return Generation(self, ids, draft, req, stats, engine_kwargs, saved, lockstep)


class Generation:
    """One generation, built by Session.start. Iterate ``tokens()`` (token events) or
    ``text()`` (events carrying text, stop strings applied), once; then ``finish()`` saves
    what the adaptive chooser learned. ``stats`` is filled live; ``lockstep`` is the ranks'
    check (None when not distributed)."""

    def __init__(self, session, ids, draft, req, stats, engine_kwargs, saved, lockstep):
        self.session, self.ids, self.draft, self.req = session, ids, draft, req
        self.stats, self.lockstep = stats, lockstep
        self._kwargs, self._saved = engine_kwargs, saved

    def tokens(self) -> Iterator[TokenEvent]:
        """The engine's token events (from_draft: the drafter proposed the token)."""
        pair = self.session.pair
        return generate_tokens(pair.target, self.draft, self.ids, stats=self.stats, **self._kwargs)

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
        prefill(pair.target, self.draft, self.ids, kv=self._kwargs["kv"], stats=self.stats)

    def finish(self) -> None:
        """Save the adaptive chooser's estimates (rank 0, choosers from the store only)."""
        if self._saved is not None and self.session.world.leader:
            self.session.choosers.save(self._saved)
